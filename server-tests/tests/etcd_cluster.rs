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

/// The backend on a cluster of its test's own, with or without cohorting.
struct OnTheCluster<'a> {
    cluster: &'a Cluster,
    cohort: bool,
}

impl OnTheCluster<'_> {
    fn root(&self, test: &str) -> String {
        format!("/conformance-{test}-{}", self.cohort)
    }

    async fn at(&self, hosts: &str, test: &str) -> EtcdBackend {
        let url = format!("etcd://{hosts}");
        let options = EtcdOptions::default()
            .root(self.root(test))
            .lease_ttl(Duration::from_secs(4))
            .cohort(common::contract::cohort(self.cohort));
        EtcdBackend::connect_with(&url, options)
            .await
            .unwrap_or_else(|e| panic!("cannot reach etcd at {url}: {e}"))
    }
}

impl common::contract::Subject for OnTheCluster<'_> {
    type Backend = EtcdBackend;

    async fn connect(&self, test: &str) -> EtcdBackend {
        self.at(&self.cluster.hosts(), test).await
    }

    /// Through a follower alone, as `the_holders_member_cut_off_*` does.
    async fn connect_through_proxy(&self, test: &str) -> Option<(Vec<FaultProxy>, EtcdBackend)> {
        let follower = self.cluster.host(self.cluster.follower().await);
        let proxy = FaultProxy::start(follower.parse().unwrap()).await.unwrap();
        let backend = self.at(&proxy.addr().to_string(), test).await;
        Some((vec![proxy], backend))
    }

    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        let hosts: Vec<String> = self.cluster.hosts().split(',').map(str::to_owned).collect();
        let raw = etcd_client::Client::connect(hosts, None).await.unwrap();
        let keys = etcd_client::GetOptions::new()
            .with_prefix()
            .with_keys_only();
        common::contract::until_nothing_left("keys", || {
            let (mut raw, keys) = (raw.clone(), keys.clone());
            async move {
                let got = raw.get(self.root(test), Some(keys)).await.unwrap();
                got.kvs()
                    .iter()
                    .map(|kv| kv.key_str().unwrap_or("?").to_owned())
                    .collect()
            }
        })
        .await;
    }
}

/// The conformance suite on a three-member cluster, with cohorting and
/// without.
#[test]
fn conformance_with_cohorting_on_and_off() {
    common::contract::on_servers_of_its_own(
        Cluster::start(Engine::Etcd, "conformance"),
        |cluster, cohort| common::contract::every_contract_test(&OnTheCluster { cluster, cohort }),
    );
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
    let (told, granted) =
        common::cut_off_holder_is_told_first(&held, &[proxy], &other, "k", false).await;
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
