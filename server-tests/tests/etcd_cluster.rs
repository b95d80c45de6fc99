//! The etcd backend on a three-member cluster that each test starts on
//! loopback (`common::cluster`), so that it can kill and pause members:
//! what a holder keeps, and what it is told, when the leader dies, when its
//! own member is cut off, when a follower stops, and during a rolling
//! restart.

mod common;

use std::time::Duration;

use common::cluster::{AfterLeaderKill, Cluster, Engine};
use common::fault_proxy::FaultProxy;
use tower_lock::backend::etcd::{EtcdBackend, EtcdOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::BackendExt;

async fn backend(hosts: &str) -> EtcdBackend {
    let url = format!("etcd://{hosts}");
    let options = EtcdOptions::default()
        .root("/cluster")
        .lease_ttl(Duration::from_secs(4))
        .cohort(CohortOptions::off());
    EtcdBackend::connect_with(&url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach etcd at {url}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_mid_hold_the_holder_keeps_its_lock() {
    let mut cluster = Cluster::start(Engine::Etcd, "leader").await;
    let (holder, other) = (
        backend(&cluster.hosts()).await,
        backend(&cluster.hosts()).await,
    );
    // The lease lives on in the new leader, which starts every lease afresh,
    // and the keep-alives reach it through the other members: for longer
    // than the TTL, the lock stays held and is granted to no one else.
    let outcome = common::cluster::kill_the_leader_mid_hold(
        &mut cluster,
        &holder,
        &other,
        Duration::from_secs(6),
    )
    .await;
    assert_eq!(outcome, AfterLeaderKill::Kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holders_member_cut_off_tells_it_before_anyone_else_is_granted() {
    let cluster = Cluster::start(Engine::Etcd, "cutoff").await;
    // The holder reaches one follower only, through a proxy.
    let follower = cluster.follower().await;
    let proxy = FaultProxy::start(cluster.host(follower).parse().unwrap())
        .await
        .unwrap();
    let holder = backend(&proxy.addr().to_string()).await;
    let other = backend(&cluster.hosts()).await;
    let held = holder.lock("k").await.unwrap();
    let (told, granted) = common::cut_off_holder_is_told_first(&held, &proxy, &other, "k").await;
    eprintln!(
        "holder's member cut off: told after {told} ms, the other granted after {granted} ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_follower_changes_nothing() {
    let cluster = Cluster::start(Engine::Etcd, "minority").await;
    let follower = cluster.follower().await;
    let hosts = cluster.hosts_except(follower);
    let (a, b) = (backend(&hosts).await, backend(&hosts).await);
    common::cluster::a_paused_follower_changes_nothing(&cluster, follower, &a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_keeps_exclusion() {
    let mut cluster = Cluster::start(Engine::Etcd, "rolling").await;
    let (a, b) = (
        backend(&cluster.hosts()).await,
        backend(&cluster.hosts()).await,
    );
    let held = common::cluster::rolling_restart_under_load(&mut cluster, [&a, &b]).await;
    eprintln!("rolling restart of 3 members: {held} holds, one at a time");
    assert!(held > 0);
}
