//! The conformance suite (`common::contract`) on one ZooKeeper server, with
//! and without cohorting.

use super::*;

/// The backend in one mode, under a root of each test's own.
pub struct Zookeeper {
    pub mode: &'static str,
    pub cohort: bool,
}

impl Zookeeper {
    fn root(&self, test: &str) -> String {
        root(&format!("{test}-{}", self.mode))
    }

    async fn at(&self, addr: &str, test: &str) -> ZookeeperBackend {
        let options = ZookeeperOptions::default()
            .root(self.root(test))
            .session_timeout(Duration::from_secs(4))
            .label("conformance")
            .cohort(common::contract::cohort(self.cohort));
        ZookeeperBackend::connect_with(&format!("zk://{addr}"), options)
            .await
            .unwrap_or_else(|e| panic!("cannot reach ZooKeeper at {addr}: {e}"))
    }
}

impl common::contract::Subject for Zookeeper {
    type Backend = ZookeeperBackend;

    async fn connect(&self, test: &str) -> ZookeeperBackend {
        self.at(&zk_addr(), test).await
    }

    async fn connect_through_proxy(
        &self,
        test: &str,
    ) -> Option<(Vec<FaultProxy>, ZookeeperBackend)> {
        let proxy = FaultProxy::start(zk_addr().parse().unwrap()).await.unwrap();
        let backend = self.at(&proxy.addr().to_string(), test).await;
        Some((vec![proxy], backend))
    }

    fn holder_identity(&self, _test: &str) -> Option<String> {
        Some(format!("conformance, pid {} on ", std::process::id()))
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        settle(&raw(&zk_addr()).await, &self.root(test), 0).await;
    }
}

mod cohort {
    crate::common::contract::conformance!(super::Zookeeper {
        mode: "cohort",
        cohort: true
    });
}

mod one_node_per_lock {
    crate::common::contract::conformance!(super::Zookeeper {
        mode: "plain",
        cohort: false
    });
}
