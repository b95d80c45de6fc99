//! The conformance suite (`common::contract`) on PostgreSQL's advisory
//! locks, with and without cohorting.

use super::*;

/// The advisory-lock backend in one mode. Its sessions carry the test's
/// namespace as their `application_name`, so that what they hold or await
/// in `pg_locks` can be told apart from every other client's.
pub struct Advisory {
    mode: &'static str,
    cohort: bool,
}

impl Advisory {
    async fn at(&self, url: &str, test: &str) -> PostgresBackend {
        use common::contract::Subject;
        let sep = if url.contains('?') { '&' } else { '?' };
        let url = format!("{url}{sep}application_name={}", self.namespace(test));
        let options = PostgresOptions::default().session_lease(Duration::from_secs(4));
        let options = if self.cohort {
            options
        } else {
            options.cohort(CohortOptions::off())
        };
        PostgresBackend::connect_with(&url, options)
            .await
            .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e}"))
    }
}

impl common::contract::Subject for Advisory {
    type Backend = PostgresBackend;

    /// Advisory locks keep only a hash of their key.
    fn lists(&self) -> bool {
        false
    }

    /// A semaphore's permits are advisory locks on other hashes.
    fn inspects_semaphores(&self) -> bool {
        false
    }

    /// The URL's `application_name`, which the backend keeps.
    fn holder_identity(&self, test: &str) -> Option<String> {
        Some(format!("({})", self.namespace(test)))
    }

    /// The server frees an advisory lock only for its session.
    fn breaks_with(&self) -> Option<tower_lock::backend::BreakScope> {
        Some(tower_lock::backend::BreakScope::Sessions)
    }

    fn namespace(&self, test: &str) -> String {
        key(test, self.mode)
    }

    async fn connect(&self, test: &str) -> PostgresBackend {
        self.at(&pg_url(), test).await
    }

    async fn connect_through_proxy(
        &self,
        test: &str,
    ) -> Option<(Vec<common::fault_proxy::FaultProxy>, PostgresBackend)> {
        let (proxy, through) = common::proxied_url(&pg_url()).await;
        Some((vec![proxy], self.at(&through, test).await))
    }

    fn server_frees_a_silent_holder(&self) -> bool {
        false
    }

    /// Without a cohort each waiter waits in `pg_advisory_lock` on a
    /// session of its own: the server serves them in the order their
    /// requests reach it, which for one process's concurrent waiters is
    /// not the order they asked in.
    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    async fn assert_nothing_left(&self, test: &str, keys: &[String]) {
        let client = raw().await;
        for key in keys {
            settle(&client, key, (0, 0)).await;
        }
        let mine: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                 WHERE l.locktype = 'advisory' AND a.application_name = $1",
                &[&self.namespace(test)],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            mine, 0,
            "advisory locks held or awaited by {test}'s sessions"
        );
    }
}

mod cohort {
    crate::common::contract::conformance!(super::Advisory {
        mode: "cohort",
        cohort: true
    });
}

mod one_session_lock_per_lock {
    crate::common::contract::conformance!(super::Advisory {
        mode: "plain",
        cohort: false
    });
}
