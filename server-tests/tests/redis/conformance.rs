//! The conformance suite (`common::contract`) on one redis-server, with and
//! without cohorting, and on Redlock's three instances.

use super::*;

use tower_lock::backend::redis::redlock::RedlockBackend;

/// The single-server backend in one mode, under a prefix of each test's own.
pub struct Redis {
    pub mode: &'static str,
    pub cohort: bool,
}

impl Redis {
    fn prefix(&self, test: &str) -> String {
        prefix(&format!("{test}-{}", self.mode))
    }

    async fn at(&self, url: &str, test: &str) -> RedisBackend {
        let options = RedisOptions::default()
            .prefix(self.prefix(test))
            .cohort(common::contract::cohort(self.cohort));
        RedisBackend::connect_with(url, options)
            .await
            .unwrap_or_else(|e| panic!("cannot reach Redis at {url}: {e}"))
    }
}

impl common::contract::Subject for Redis {
    type Backend = RedisBackend;

    async fn connect(&self, test: &str) -> RedisBackend {
        self.at(&redis_url(), test).await
    }

    async fn connect_through_proxy(&self, test: &str) -> Option<(Vec<FaultProxy>, RedisBackend)> {
        let proxy = FaultProxy::start(socket_addr(&redis_url())).await.unwrap();
        let backend = self.at(&format!("redis://{}/", proxy.addr()), test).await;
        Some((vec![proxy], backend))
    }

    /// Without a cohort each waiter retries on its own when it hears of a
    /// release: Redis has no queue.
    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    /// Nor any share without one: the releasing process asks again at
    /// once, before the others hear of the release, and wins most races
    /// (seen: 86 holds against 1,147). A fair hand-off is the per-request
    /// cost issue's.
    fn takes_turns_across_processes(&self) -> bool {
        self.cohort
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        no_lock_left(&[redis_url()], &self.prefix(test)).await;
    }
}

/// Waits until no key but fencing counters (kept on purpose: tokens rise
/// across holders) is left under `prefix` on any of `urls`.
/// Within a second: a queue's keys left behind would outlive that (a
/// place lasts 3 s), and `flush` has waited for every background release.
pub(super) async fn no_lock_left(urls: &[String], prefix: &str) {
    let mut left = Vec::new();
    for _ in 0..50 {
        left.clear();
        for url in urls {
            let keys = keys_under(url, prefix).await;
            left.extend(keys.into_iter().filter(|k| !k.ends_with(":fence")));
        }
        if left.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("keys left behind under {prefix}: {left:?}");
}

/// Redlock over three redis-servers of each test's own.
pub struct Redlock {
    pub cohort: bool,
    servers: Vec<Server>,
}

impl Redlock {
    pub fn start(cohort: bool) -> Self {
        let servers = (0..3).map(|_| Server::start()).collect();
        Redlock { cohort, servers }
    }
}

impl common::contract::Subject for Redlock {
    type Backend = RedlockBackend;

    async fn connect(&self, _test: &str) -> RedlockBackend {
        RedlockBackend::connect(&redlock_url(&self.servers))
            .await
            .unwrap()
            .with_cohort(common::contract::cohort(self.cohort))
    }

    /// Through a proxy to each instance, all cut: the holder can reach no
    /// majority (`redlock_holder_cut_off_from_a_majority_*` cuts two).
    async fn connect_through_proxy(
        &self,
        _test: &str,
    ) -> Option<(Vec<FaultProxy>, RedlockBackend)> {
        let mut proxies = Vec::new();
        for server in &self.servers {
            proxies.push(FaultProxy::start(server.addr()).await.unwrap());
        }
        let list: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
        let backend = RedlockBackend::connect(&format!("redlock://{}", list.join(",")))
            .await
            .unwrap()
            .with_cohort(common::contract::cohort(self.cohort));
        Some((proxies, backend))
    }

    async fn assert_nothing_left(&self, _test: &str, _keys: &[String]) {
        let urls: Vec<String> = self.servers.iter().map(Server::url).collect();
        no_lock_left(&urls, "lock:").await;
    }
}

mod redis_cohort {
    crate::common::contract::conformance!(super::Redis {
        mode: "cohort",
        cohort: true
    });
}

mod redis_one_acquire_per_lock {
    crate::common::contract::conformance!(super::Redis {
        mode: "plain",
        cohort: false
    });
}

mod redlock_cohort {
    crate::common::contract::conformance!(super::Redlock::start(true));
}

mod redlock_one_round_per_lock {
    crate::common::contract::conformance!(super::Redlock::start(false));
}
