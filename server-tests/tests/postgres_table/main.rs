//! The PostgreSQL backend's lease-table mode against a real server, straight
//! and through PgBouncer in transaction pooling. `scripts/test-all.sh`
//! starts both and sets `TOWER_LOCK_POSTGRES_URL` and
//! `TOWER_LOCK_PGBOUNCER_URL`; run without them, every test here fails and
//! says how to start them.
//!
//! Every test locks keys of its own (the test's name and this process's
//! id) in the default table, and checks that no row of them is left (one
//! counts the rows written, in a table of its own).

#[path = "../common/mod.rs"]
mod common;
mod routines;
mod turns;
mod wakeups;

use std::time::Duration;

use tower_lock::backend::postgres::{PostgresBackend, PostgresOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError, LockMode};

const TABLE: &str = "tower_lock_leases";

fn env_url(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set. Run scripts/test-all.sh, which starts PostgreSQL (or uses the \
             one on 127.0.0.1:5432) and PgBouncer in transaction pooling in front of it \
             (Debian: apt-get install postgresql pgbouncer), and sets TOWER_LOCK_POSTGRES_URL \
             and TOWER_LOCK_PGBOUNCER_URL"
        )
    })
}

fn pg_url() -> String {
    env_url("TOWER_LOCK_POSTGRES_URL")
}

fn bouncer_url() -> String {
    env_url("TOWER_LOCK_PGBOUNCER_URL")
}

fn key(test: &str, name: &str) -> String {
    format!("t-{test}-{}-{name}", std::process::id())
}

fn options() -> PostgresOptions {
    PostgresOptions::default().lease_table(TABLE)
}

async fn connect(url: &str, options: PostgresOptions) -> PostgresBackend {
    PostgresBackend::connect_with(url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e}"))
}

async fn direct() -> PostgresBackend {
    connect(&pg_url(), options()).await
}

/// Statements through PgBouncer; notifications straight from the server.
async fn bounced() -> PostgresBackend {
    connect(&bouncer_url(), options().listen_url(pg_url())).await
}

/// As [`bounced`], the listener's address given in the URL
/// (`listen=host:port`).
async fn bounced_by_url() -> PostgresBackend {
    let pg = pg_url();
    let rest = pg.split_once("://").map_or(pg.as_str(), |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let hosts = rest.split(['/', '?']).next().unwrap();
    let bouncer = bouncer_url();
    let join = if bouncer.contains('?') { '&' } else { '?' };
    connect(&format!("{bouncer}{join}listen={hosts}"), options()).await
}

/// A plain client, to look at the table.
async fn raw() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

async fn rows_of(client: &tokio_postgres::Client, key: &str) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM {TABLE} WHERE key = $1"),
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits until no row of `key` is left.
async fn settle_free(client: &tokio_postgres::Client, key: &str) {
    for _ in 0..300 {
        if rows_of(client, key).await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{key}: a lease row was left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_under_contention_with_increasing_tokens() {
    let k = key("contention", "hot");
    let (a, b) = (direct().await, direct().await);
    assert!(a.is_lease_table());
    common::excludes_with_increasing_tokens(&[a, b], &k, 8, 10).await;
    settle_free(&raw().await, &k).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_through_pgbouncer_in_transaction_pooling() {
    let k = key("bounced", "hot");
    // One backend straight to the server, one through the pooler: the same
    // rows.
    let (a, b) = (direct().await, bounced().await);
    common::excludes_with_increasing_tokens(&[a, b.clone()], &k, 8, 10).await;
    // Through the pooler alone, waiters polling.
    let (c, d) = (
        connect(&bouncer_url(), options()).await,
        connect(&bouncer_url(), options()).await,
    );
    common::excludes_with_increasing_tokens(&[c, d], &k, 4, 5).await;
    settle_free(&raw().await, &k).await;
}

/// The lease-table backend in one mode: straight to the server, or
/// through PgBouncer in transaction pooling (notifications straight from
/// the server).
struct LeaseTable {
    mode: &'static str,
    cohort: bool,
    bounced: bool,
}

impl LeaseTable {
    fn options(&self) -> PostgresOptions {
        let options = if self.cohort {
            options()
        } else {
            options().cohort(CohortOptions::off())
        };
        if self.bounced {
            options.listen_url(pg_url())
        } else {
            options
        }
    }
}

impl common::contract::Subject for LeaseTable {
    type Backend = PostgresBackend;

    fn namespace(&self, test: &str) -> String {
        key(test, self.mode)
    }

    async fn connect(&self, _test: &str) -> PostgresBackend {
        let url = if self.bounced {
            bouncer_url()
        } else {
            pg_url()
        };
        connect(&url, self.options()).await
    }

    async fn connect_through_proxy(
        &self,
        _test: &str,
    ) -> Option<(Vec<common::fault_proxy::FaultProxy>, PostgresBackend)> {
        let (proxy, through) = common::proxied_url(&pg_url()).await;
        // Statements and notifications both through the proxy: cut off
        // means cut off. The lease is the request's.
        Some((vec![proxy], connect(&through, self.options()).await))
    }

    /// Without a cohort each waiter tries again as it hears of a release:
    /// the table keeps no queue.
    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        let client = raw().await;
        let pattern = format!("{}:%", self.namespace(test));
        let query = format!("SELECT key FROM {TABLE} WHERE key LIKE $1 ORDER BY key");
        for _ in 0..300 {
            let rows = client.query(&query, &[&pattern]).await.unwrap();
            if rows.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let rows = client.query(&query, &[&pattern]).await.unwrap();
        let left: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        panic!("lease rows left behind: {left:?}");
    }
}

mod conformance {
    mod cohort {
        crate::common::contract::conformance!(crate::LeaseTable {
            mode: "cohort",
            cohort: true,
            bounced: false
        });
    }
    mod one_row_write_per_lock {
        crate::common::contract::conformance!(crate::LeaseTable {
            mode: "plain",
            cohort: false,
            bounced: false
        });
    }
    mod through_pgbouncer {
        crate::common::contract::conformance!(crate::LeaseTable {
            mode: "bounced",
            cohort: true,
            bounced: true
        });
    }
}

#[tokio::test]
async fn a_dead_holders_row_is_taken_over_once_it_expires() {
    let k = key("dead", "k");
    // Connected first: the table exists.
    let pg = direct().await;
    let client = raw().await;
    // What a holder that died leaves: a row nobody renews.
    client
        .execute(
            &format!(
                "INSERT INTO {TABLE} (key, owner, expires_at) \
                 VALUES ($1, 'dead', clock_timestamp() + interval '1 second')"
            ),
            &[&k],
        )
        .await
        .unwrap();
    assert!(matches!(
        pg.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    let g = pg
        .lock(k.as_str())
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    let owner: String = client
        .query_one(&format!("SELECT owner FROM {TABLE} WHERE key = $1"), &[&k])
        .await
        .unwrap()
        .get(0);
    assert_ne!(owner, "dead");
    g.release().await.unwrap();
    settle_free(&client, &k).await;
}

#[tokio::test]
async fn expired_rows_nobody_asks_for_are_swept() {
    let k = key("swept", "k");
    let _pg = direct().await;
    let client = raw().await;
    client
        .execute(
            &format!(
                "INSERT INTO {TABLE} (key, owner, expires_at) \
                 VALUES ($1, 'dead', clock_timestamp() - interval '1 second')"
            ),
            &[&k],
        )
        .await
        .unwrap();
    for _ in 0..50 {
        if rows_of(&client, &k).await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the expired row was not swept");
}

#[tokio::test]
async fn a_holder_whose_row_is_taken_is_told_lost() {
    let k = key("taken", "k");
    let pg = direct().await;
    let held = pg
        .lock(k.as_str())
        .lease(Duration::from_millis(600))
        .await
        .unwrap();
    let client = raw().await;
    let taken = client
        .execute(
            &format!("UPDATE {TABLE} SET owner = 'thief' WHERE key = $1"),
            &[&k],
        )
        .await
        .unwrap();
    assert_eq!(taken, 1);
    tokio::time::timeout(Duration::from_secs(5), held.lost())
        .await
        .expect("the holder was not told");
    assert!(held.is_lost());
    drop(held);
    client
        .execute(&format!("DELETE FROM {TABLE} WHERE key = $1"), &[&k])
        .await
        .unwrap();
}

/// A grant whose answer the network held back is known valid only from
/// when it was asked. Here the row is granted at once and its answer comes
/// just before the lease ends on the server: the holder must renew it at
/// once or be told lost before another process can take the row, not a
/// third of a lease later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_answered_late_is_renewed_or_told_lost_before_another_takes_it() {
    use common::fault_proxy::Fault;
    use std::sync::Arc;
    use std::time::Instant;

    let k = key("late", "k");
    let lease = Duration::from_millis(1500);
    let (proxy, through) = common::proxied_url(&pg_url()).await;
    let late = Arc::new(connect(&through, options()).await);
    let other = direct().await;
    // The key's statement connection open and its acquire prepared (once
    // the listener has heard, statements are prepared) before the fault: a
    // preparation held back would send the acquire only once healed.
    common::eventually("the listener hears its test notification", || {
        late.hears_releases()
    })
    .await;
    late.lock(k.as_str())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    settle_free(&raw().await, &k).await;

    // The server's answers to `late` held: its acquire is granted at once,
    // and it hears so only when the fault heals, 100 ms before the lease
    // ends on the server.
    proxy.set(Fault::FreezeDown).await;
    let acquiring = tokio::spawn({
        let (late, k) = (late.clone(), k.clone());
        async move {
            late.lock(k.as_str())
                .lease(lease)
                .wait(Duration::from_secs(10))
                .await
        }
    });
    tokio::time::sleep(lease - Duration::from_millis(100)).await;
    proxy.heal().await;
    let held = acquiring.await.unwrap().expect("granted once healed");
    // Should the answer come after the lease (a loaded machine), the grant
    // is known expired as it arrives: the holder must be told all the same.
    let signal = held.held().lost_signal().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });

    // Another process asks; whenever it gets the row, `late` was told.
    match other.lock(k.as_str()).lease(lease).wait(lease * 2).await {
        Ok(taken) => {
            let granted = Instant::now();
            assert!(
                told.is_finished(),
                "granted to another while the late holder was not told"
            );
            assert!(told.await.unwrap() <= granted);
            taken.release().await.unwrap();
        }
        Err(LockError::Timeout { .. }) => {
            // Renewed in time: still held, and the other never got it.
            assert!(!held.is_lost(), "neither renewed nor taken");
            told.abort();
        }
        Err(e) => panic!("{e}"),
    }
    drop(held);
    late.flush().await;
    settle_free(&raw().await, &k).await;
}

#[tokio::test]
async fn renewal_keeps_a_lock_past_its_lease() {
    let k = key("renewed", "k");
    let (pg, other) = (direct().await, direct().await);
    let held = pg
        .lock(k.as_str())
        .lease(Duration::from_millis(900))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!held.is_lost());
    assert!(matches!(
        other.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    held.release().await.unwrap();
    settle_free(&raw().await, &k).await;
}

#[tokio::test]
async fn timed_out_and_cancelled_waits_leave_no_row() {
    let k = key("cancelled", "k");
    let (holder, waiter) = (direct().await, bounced().await);
    let g = holder.lock(k.as_str()).await.unwrap();
    let timed_out = waiter
        .lock(k.as_str())
        .wait(Duration::from_millis(200))
        .await;
    assert!(
        matches!(timed_out, Err(LockError::Timeout { .. })),
        "{timed_out:?}"
    );
    // Cancelled at every point of an acquisition, the lock free.
    g.release().await.unwrap();
    // From before the statement is sent to after its answer is on the way.
    for after in [0, 1, 2, 5, 10, 20, 50, 100, 200, 300] {
        let attempt = waiter.lock(k.as_str());
        let _ = tokio::time::timeout(Duration::from_micros(after * 100), attempt).await;
    }
    waiter.flush().await;
    settle_free(&raw().await, &k).await;
    holder
        .lock(k.as_str())
        .fail_fast()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    settle_free(&raw().await, &k).await;
}

#[tokio::test]
async fn exclusive_only_and_bad_names_are_clear_errors() {
    let pg = direct().await;
    let read = pg
        .lock(key("modes", "r").as_str())
        .mode(LockMode::Read)
        .await;
    assert!(matches!(read, Err(LockError::InvalidMode(_))), "{read:?}");
    let bad =
        PostgresBackend::connect_with(&pg_url(), PostgresOptions::default().lease_table("x; DROP"))
            .await;
    assert!(matches!(bad, Err(LockError::Config(_))), "{bad:?}");
    let misspelled = PostgresBackend::connect(&format!("{}?lease_tablex", pg_url())).await;
    assert!(
        matches!(misspelled, Err(LockError::Config(_))),
        "{misspelled:?}"
    );
    let long = PostgresBackend::connect_with(
        &pg_url(),
        PostgresOptions::default().lease_table("t".repeat(64)),
    )
    .await;
    assert!(matches!(long, Err(LockError::Config(_))), "{long:?}");
    let listen_alone =
        PostgresBackend::connect_with(&pg_url(), PostgresOptions::default().listen_url(pg_url()))
            .await;
    assert!(matches!(listen_alone, Err(LockError::Config(_))));
    let from_url = PostgresBackend::connect(&format!("{}?lease_table", pg_url()))
        .await
        .unwrap();
    assert!(from_url.is_lease_table());
}

#[tokio::test]
async fn no_task_is_left_after_the_backend_is_dropped() {
    let before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let k = key("tasks", "k");
    {
        let pg = direct().await;
        let g = pg.lock(k.as_str()).await.unwrap();
        g.release().await.unwrap();
        pg.flush().await;
    }
    common::no_task_left_after(before).await;
    settle_free(&raw().await, &k).await;
}

// ---- other processes -------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_between_processes_one_through_pgbouncer() {
    let k = key("processes", "shared");
    let n = std::sync::atomic::AtomicUsize::new(0);
    common::two_processes_exclude(|log| {
        // The first child straight to the server, the second through the
        // pooler.
        let url = if n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
            pg_url()
        } else {
            bouncer_url()
        };
        common::spawn_child(
            "worker",
            &[
                ("TOWER_LOCK_CHILD_KEY", k.clone()),
                ("TOWER_LOCK_CHILD_URL", url),
                ("TOWER_LOCK_CHILD_LOG", log.to_owned()),
            ],
        )
    });
    settle_free(&raw().await, &k).await;
}

#[tokio::test]
#[ignore = "run as a child process by the tests above"]
async fn child_entry() {
    let Ok(role) = std::env::var("TOWER_LOCK_CHILD") else {
        return;
    };
    let k = std::env::var("TOWER_LOCK_CHILD_KEY").unwrap();
    let url = std::env::var("TOWER_LOCK_CHILD_URL").unwrap();
    let pg = connect(&url, options()).await;
    match role.as_str() {
        "worker" => {
            let log = std::env::var("TOWER_LOCK_CHILD_LOG").unwrap();
            common::worker_child(&pg, &k, &log).await;
        }
        other => panic!("unknown child role {other}"),
    }
}
