//! The ZooKeeper backend on a three-server ensemble that each test starts
//! on loopback (`common::cluster`), so that it can kill and pause servers:
//! what a holder keeps, and what it is told, when the leader dies, when its
//! own server is cut off, when a follower stops, and during a rolling
//! restart.

mod common;

use std::time::Duration;

use common::cluster::{Cluster, Engine};
use common::fault_proxy::FaultProxy;
use tower_lock::backend::zookeeper::{ZookeeperBackend, ZookeeperOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::BackendExt;

async fn backend(hosts: &str) -> ZookeeperBackend {
    let url = format!("zk://{hosts}");
    let options = ZookeeperOptions::default()
        .root("/ensemble")
        .session_timeout(Duration::from_secs(4))
        .cohort(CohortOptions::off());
    ZookeeperBackend::connect_with(&url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach ZooKeeper at {url}: {e}"))
}

/// The backend on an ensemble of its test's own, with or without
/// cohorting.
struct OnTheEnsemble<'a> {
    cluster: &'a Cluster,
    cohort: bool,
}

impl OnTheEnsemble<'_> {
    fn root(&self, test: &str) -> String {
        format!("/conformance-{test}-{}", self.cohort)
    }

    async fn at(&self, hosts: &str, test: &str) -> ZookeeperBackend {
        let url = format!("zk://{hosts}");
        let options = ZookeeperOptions::default()
            .root(self.root(test))
            .session_timeout(Duration::from_secs(4))
            .cohort(common::contract::cohort(self.cohort));
        ZookeeperBackend::connect_with(&url, options)
            .await
            .unwrap_or_else(|e| panic!("cannot reach ZooKeeper at {url}: {e}"))
    }
}

impl common::contract::Subject for OnTheEnsemble<'_> {
    type Backend = ZookeeperBackend;

    async fn connect(&self, test: &str) -> ZookeeperBackend {
        self.at(&self.cluster.hosts(), test).await
    }

    /// Through a follower alone, as `the_holders_server_cut_off_*` does.
    async fn connect_through_proxy(
        &self,
        test: &str,
    ) -> Option<(Vec<FaultProxy>, ZookeeperBackend)> {
        let follower = self.cluster.host(self.cluster.follower().await);
        let proxy = FaultProxy::start(follower.parse().unwrap()).await.unwrap();
        let backend = self.at(&proxy.addr().to_string(), test).await;
        Some((vec![proxy], backend))
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        let client = zookeeper_client::Client::connect(&self.cluster.hosts())
            .await
            .unwrap();
        common::contract::until_nothing_left("lock nodes", || {
            common::zk_lock_nodes(&client, self.root(test))
        })
        .await;
    }
}

/// The conformance suite on a three-server ensemble, with cohorting and
/// without.
#[test]
fn conformance_with_cohorting_on_and_off() {
    common::contract::on_servers_of_its_own(
        Cluster::start(Engine::ZooKeeper, "conformance"),
        |cluster, cohort| common::contract::every_contract_test(&OnTheEnsemble { cluster, cohort }),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_mid_hold_is_kept_or_told_before_anyone_else_is_granted() {
    let mut cluster = Cluster::start(Engine::ZooKeeper, "leader").await;
    let (holder, other) = (
        backend(&cluster.hosts()).await,
        backend(&cluster.hosts()).await,
    );
    // The session lives in the ensemble, not in one server: the client
    // moves it to another server. Whether the holder keeps its lock depends
    // on whether the election and the reconnect end within the two thirds
    // of the session timeout the backend counts a session alive after its
    // last answered request; if not, the holder is told first.
    let outcome = common::cluster::kill_the_leader_mid_hold(
        &mut cluster,
        &holder,
        &other,
        Duration::from_secs(6),
    )
    .await;
    eprintln!("ZooKeeper leader killed mid-hold (4 s session): {outcome:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holders_server_cut_off_tells_it_before_anyone_else_is_granted() {
    let cluster = Cluster::start(Engine::ZooKeeper, "cutoff").await;
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
        "holder's server cut off: told after {told} ms, the other granted after {granted} ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_follower_changes_nothing() {
    let cluster = Cluster::start(Engine::ZooKeeper, "minority").await;
    let follower = cluster.follower().await;
    let hosts = cluster.hosts_except(follower);
    let (a, b) = (backend(&hosts).await, backend(&hosts).await);
    common::cluster::a_paused_follower_changes_nothing(&cluster, follower, &a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_keeps_exclusion() {
    let mut cluster = Cluster::start(Engine::ZooKeeper, "rolling").await;
    let (a, b) = (
        backend(&cluster.hosts()).await,
        backend(&cluster.hosts()).await,
    );
    let held = common::cluster::rolling_restart_under_load(&mut cluster, [&a, &b]).await;
    eprintln!("rolling restart of 3 servers: {held} holds, one at a time");
    assert!(held > 0);
}
