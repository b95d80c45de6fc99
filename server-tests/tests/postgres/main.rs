//! The PostgreSQL backend against a real server. `scripts/test-all.sh` uses
//! the one on 127.0.0.1:5432 when it answers (or starts one of its own) and
//! sets `TOWER_LOCK_POSTGRES_URL`; run without it, every test here fails
//! and says how to start one.
//!
//! Advisory locks are global to a database, so every test locks keys of its
//! own (the test's name and this process's id), and checks `pg_locks` for
//! what it left behind.

#[path = "../common/mod.rs"]
mod common;
mod conformance;

use std::io::{BufReader, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_lock::backend::postgres::{PostgresBackend, PostgresOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError, LockMode, Wait};

fn pg_url() -> String {
    std::env::var("TOWER_LOCK_POSTGRES_URL").unwrap_or_else(|_| {
        panic!(
            "TOWER_LOCK_POSTGRES_URL is not set. Run scripts/test-all.sh, which uses or starts \
             a PostgreSQL server, or start one (Debian: apt-get install postgresql; \
             service postgresql start) and set \
             TOWER_LOCK_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test"
        )
    })
}

/// A key of this test's own: advisory locks are shared by every client of
/// the database.
fn key(test: &str, name: &str) -> String {
    format!("t-{test}-{}-{name}", std::process::id())
}

async fn backend_with(options: PostgresOptions) -> PostgresBackend {
    let url = pg_url();
    PostgresBackend::connect_with(&url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e}"))
}

async fn backend() -> PostgresBackend {
    backend_with(PostgresOptions::default().session_lease(Duration::from_secs(4))).await
}

/// A backend whose every acquisition goes to the server.
async fn plain_backend() -> PostgresBackend {
    backend_with(
        PostgresOptions::default()
            .session_lease(Duration::from_secs(4))
            .cohort(CohortOptions::off()),
    )
    .await
}

/// A plain client, to look at what the server holds.
async fn raw() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// `(granted, waiting)` advisory locks on `key`, across every session.
async fn locks_on(client: &tokio_postgres::Client, key: &str) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted) \
             FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1, 0)",
            &[&key],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Waits until `key` has `expected` granted and waiting locks on the server.
async fn settle(client: &tokio_postgres::Client, key: &str, expected: (i64, i64)) {
    for _ in 0..500 {
        if locks_on(client, key).await == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{key}: expected {expected:?} (granted, waiting), found {:?}",
        locks_on(client, key).await
    );
}

#[tokio::test]
async fn one_process_never_holds_a_key_twice_through_session_reentrancy() {
    // Advisory locks are re-entrant per session: without care, two
    // acquisitions in one process would both be granted on one connection.
    let k = key("reentrancy", "k");
    let pg = plain_backend().await;
    let first = pg.lock(k.as_str()).await.unwrap();
    assert!(matches!(
        pg.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    let second = {
        let pg = pg.clone();
        let k = k.clone();
        tokio::spawn(async move { pg.lock(k.as_str()).wait(Duration::from_secs(10)).await })
    };
    let client = raw().await;
    settle(&client, &k, (1, 1)).await;
    assert!(!second.is_finished());
    first.release().await.unwrap();
    let second = second.await.unwrap().unwrap();
    settle(&client, &k, (1, 0)).await;
    second.release().await.unwrap();
    settle(&client, &k, (0, 0)).await;
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order() {
    let k = key("order", "k");
    let holder = plain_backend().await;
    let held = holder.lock(k.as_str()).await.unwrap();
    let client = raw().await;
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..3 {
        // A backend each: three processes, as far as the server can tell.
        let pg = plain_backend().await;
        let (order, key) = (order.clone(), k.clone());
        waiters.push(tokio::spawn(async move {
            let g = pg
                .lock(key.as_str())
                .wait(Duration::from_secs(10))
                .await
                .unwrap();
            order.lock().unwrap().push(i);
            g.release().await.unwrap();
        }));
        settle(&client, &k, (1, i + 1)).await;
    }
    held.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
    settle(&client, &k, (0, 0)).await;
}

#[tokio::test]
async fn timed_out_and_cancelled_waits_leave_no_waiter_on_the_server() {
    let k = key("cancel", "k");
    let (holder, waiter) = (plain_backend().await, plain_backend().await);
    let held = holder.lock(k.as_str()).await.unwrap();
    let client = raw().await;
    let timed_out = waiter
        .lock(k.as_str())
        .wait(Duration::from_millis(200))
        .await;
    assert!(
        matches!(timed_out, Err(LockError::Timeout { .. })),
        "{timed_out:?}"
    );
    settle(&client, &k, (1, 0)).await;
    // Cancelled: the future dropped while it waits in the server.
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move { waiter.lock(k.as_str()).wait(Wait::Forever).await })
    };
    settle(&client, &k, (1, 1)).await;
    waiting.abort();
    settle(&client, &k, (1, 0)).await;
    assert!(matches!(
        waiter.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    held.release().await.unwrap();
    waiter.flush().await;
    let again = waiter.lock(k.as_str()).fail_fast().await.unwrap();
    again.release().await.unwrap();
    settle(&client, &k, (0, 0)).await;
}

#[tokio::test]
async fn readers_share_and_writers_exclude() {
    let k = key("rw", "k");
    let (a, b) = (plain_backend().await, plain_backend().await);
    let r1 = a.lock(k.as_str()).mode(LockMode::Read).await.unwrap();
    let r2 = b
        .lock(k.as_str())
        .mode(LockMode::Read)
        .fail_fast()
        .await
        .unwrap();
    assert!(matches!(
        b.lock(k.as_str()).mode(LockMode::Write).fail_fast().await,
        Err(LockError::Busy)
    ));
    assert!(matches!(
        b.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    let client = raw().await;
    settle(&client, &k, (2, 0)).await;
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let w = b
        .lock(k.as_str())
        .mode(LockMode::Write)
        .fail_fast()
        .await
        .unwrap();
    assert!(matches!(
        a.lock(k.as_str()).mode(LockMode::Read).fail_fast().await,
        Err(LockError::Busy)
    ));
    w.release().await.unwrap();
    settle(&client, &k, (0, 0)).await;
}

/// Granted advisory locks on the permit keys of `key`'s semaphore.
async fn permits_held(client: &tokio_postgres::Client, key: &str, permits: i32) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_locks l, generate_series(0, $2 - 1) i \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
             AND ((l.classid::bigint << 32) | l.objid::bigint) \
             = hashtextextended($1 || E'\\x01permit' || i, 0)",
            &[&key, &permits],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_admits_its_permits_and_no_more() {
    let k = key("semaphore", "k");
    let sem = LockMode::Semaphore { permits: 3 };
    let (a, b) = (plain_backend().await, plain_backend().await);
    let client = raw().await;
    // Three permits, from two backends; the fourth is refused.
    let p1 = a.lock(k.as_str()).mode(sem).fail_fast().await.unwrap();
    let p2 = b.lock(k.as_str()).mode(sem).fail_fast().await.unwrap();
    let p3 = a.lock(k.as_str()).mode(sem).fail_fast().await.unwrap();
    assert!(matches!(
        b.lock(k.as_str()).mode(sem).fail_fast().await,
        Err(LockError::Busy)
    ));
    // SQL sees one lock per permit, none on the key itself.
    assert_eq!(permits_held(&client, &k, 3).await, 3);
    assert_eq!(locks_on(&client, &k).await, (0, 0));
    let tokens = [p1.token(), p2.token(), p3.token()];
    assert!(tokens[0] != tokens[1] && tokens[1] != tokens[2] && tokens[0] != tokens[2]);
    // A waiter gets a permit once they are given back.
    let waiter = {
        let (b, k) = (b.clone(), k.clone());
        tokio::spawn(async move {
            b.lock(k.as_str())
                .mode(sem)
                .wait(Duration::from_secs(10))
                .await
        })
    };
    for p in [p1, p2, p3] {
        p.release().await.unwrap();
    }
    waiter.await.unwrap().unwrap().release().await.unwrap();
    // Zero permits, through the backend itself: a clear error.
    let none = b
        .acquire(tower_lock::backend::LockRequest::new(
            tower_lock::LockKey::new(&k).unwrap(),
            LockMode::Semaphore { permits: 0 },
        ))
        .await;
    assert!(
        matches!(none, Err(LockError::InvalidMode(_))),
        "{:?}",
        none.err()
    );
    // Under contention: never more than the permits at once.
    let sem = LockMode::Semaphore { permits: 2 };
    let inside = Arc::new(Mutex::new((0usize, 0usize)));
    let mut tasks = Vec::new();
    for i in 0..6 {
        let backend = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (k, inside) = (k.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let g = backend
                    .lock(k.as_str())
                    .mode(sem)
                    .wait(Duration::from_secs(20))
                    .await
                    .unwrap();
                {
                    let mut n = inside.lock().unwrap();
                    n.0 += 1;
                    n.1 = n.1.max(n.0);
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
                inside.lock().unwrap().0 -= 1;
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let most = inside.lock().unwrap().1;
    assert!(most <= 2, "{most} holders of 2 permits at once");
    assert_eq!(most, 2, "the second permit was never used");
    for _ in 0..500 {
        if permits_held(&client, &k, 3).await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("a permit lock was left behind");
}

#[tokio::test]
async fn sql_takes_the_same_lock() {
    let k = key("sql", "k");
    let pg = plain_backend().await;
    let client = raw().await;
    let got: bool = client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
            &[&k],
        )
        .await
        .unwrap()
        .get(0);
    assert!(got);
    assert!(matches!(
        pg.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    client
        .query_one("SELECT pg_advisory_unlock(hashtextextended($1, 0))", &[&k])
        .await
        .unwrap();
    let g = pg.lock(k.as_str()).fail_fast().await.unwrap();
    let sql_sees_it: bool = client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
            &[&k],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!sql_sees_it);
    g.release().await.unwrap();
    settle(&client, &k, (0, 0)).await;
}

#[tokio::test]
async fn a_terminated_session_tells_the_holder_and_the_next_token_is_higher() {
    let k = key("terminated", "k");
    let (holder, next) = (plain_backend().await, plain_backend().await);
    let held = holder.lock(k.as_str()).await.unwrap();
    let client = raw().await;
    let terminated: i64 = client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks \
             WHERE locktype = 'advisory' AND objsubid = 1 AND granted \
             AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1, 0)",
            &[&k],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(terminated, 1);
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder was not told");
    assert!(held.is_lost());
    // The server frees the lock as the terminated process exits, which may
    // be just after the holder heard of it.
    let g = next
        .lock(k.as_str())
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(g.token() > held.token());
    g.release().await.unwrap();
    drop(held);
    // The holder's backend opens a new connection for its next lock.
    holder
        .lock(k.as_str())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    settle(&client, &k, (0, 0)).await;
}

#[tokio::test]
async fn connections_are_bounded_and_given_back() {
    let keys: Vec<String> = (0..3).map(|i| key("pool", &i.to_string())).collect();
    let holders = plain_backend().await;
    let mut held = Vec::new();
    for k in &keys {
        held.push(holders.lock(k.as_str()).await);
    }
    let pg = backend_with(
        PostgresOptions::default()
            .max_connections(2)
            .cohort(CohortOptions::off()),
    )
    .await;
    assert_eq!(pg.connections(), 1);
    // Two waits: the shared connection tries, a second one waits.
    let first = {
        let (pg, k) = (pg.clone(), keys[0].clone());
        tokio::spawn(async move { pg.lock(k.as_str()).wait(Duration::from_secs(10)).await })
    };
    let client = raw().await;
    settle(&client, &keys[0], (1, 1)).await;
    let e = pg
        .lock(keys[1].as_str())
        .wait(Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains("max_connections"), "{e}");
    for g in held {
        g.unwrap().release().await.unwrap();
    }
    first.await.unwrap().unwrap().release().await.unwrap();
    // The waiting connection went back to the pool and serves the next wait.
    let again = pg.lock(keys[1].as_str()).await.unwrap();
    again.release().await.unwrap();
    assert_eq!(pg.connections(), 2);
    for k in &keys {
        settle(&client, k, (0, 0)).await;
    }
}

#[tokio::test]
async fn bad_urls_and_an_unreachable_server_are_clear_errors_within_the_timeout() {
    for bad in ["postgres://app@db:notaport/x", "mysql://x", "postgres:/x"] {
        let e = PostgresBackend::connect(bad).await.unwrap_err();
        assert!(matches!(e, LockError::Config(_)), "{bad}: {e:?}");
    }
    let e = PostgresBackend::connect_with(
        &pg_url(),
        PostgresOptions::default().sequence("no such; thing"),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, LockError::Config(_)), "{e:?}");
    let port = common::free_port();
    let started = Instant::now();
    let e = PostgresBackend::connect_with(
        &format!("postgres://postgres@127.0.0.1:{port}/test"),
        PostgresOptions::default().connect_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

/// PgBouncer in transaction pooling, which `scripts/test-all.sh` starts in
/// front of the server.
fn bouncer_url() -> String {
    std::env::var("TOWER_LOCK_PGBOUNCER_URL").unwrap_or_else(|_| {
        panic!(
            "TOWER_LOCK_PGBOUNCER_URL is not set. Run scripts/test-all.sh, which starts \
             PgBouncer in transaction pooling in front of PostgreSQL (Debian: apt-get install \
             pgbouncer)"
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_transaction_pooler_advisory_locks_are_refused_never_shared() {
    let k = key("pooled", "k");
    let refused = |e: &LockError| e.to_string().contains("pooler in transaction mode");
    let mut backends = Vec::new();
    let mut refusals = 0;
    // Each backend's connections mark the server session they set up;
    // the pooler hands the second client a session the first marked.
    for _ in 0..4 {
        match PostgresBackend::connect_with(
            &bouncer_url(),
            PostgresOptions::default()
                .session_lease(Duration::from_secs(4))
                .cohort(CohortOptions::off()),
        )
        .await
        {
            Ok(b) => backends.push(b),
            Err(e) if refused(&e) => refusals += 1,
            Err(e) => panic!("an unclear error: {e}"),
        }
    }
    let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for b in backends {
        let (k, held) = (k.clone(), held.clone());
        tasks.push(tokio::spawn(async move {
            let mut refusals = 0;
            for _ in 0..20 {
                match b.lock(k.as_str()).wait(Duration::from_millis(500)).await {
                    Ok(g) => {
                        assert_eq!(
                            held.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                            0,
                            "two holders through the pooler"
                        );
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        held.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        if let Err(e) = g.release().await {
                            assert!(refused(&e), "an unclear error: {e}");
                            refusals += 1;
                        }
                    }
                    Err(e @ (LockError::Timeout { .. } | LockError::Busy)) => drop(e),
                    Err(e) => {
                        assert!(refused(&e), "an unclear error: {e}");
                        refusals += 1;
                    }
                }
            }
            refusals
        }));
    }
    for t in tasks {
        refusals += t.await.unwrap();
    }
    assert!(refusals > 0, "the pooler went unnoticed");
    // A lock granted on a pooled session and refused at its release stays
    // with that session: end those sessions (the pooler opens others).
    raw()
        .await
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks \
             WHERE locktype = 'advisory' AND objsubid = 1 \
             AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1, 0)",
            &[&k],
        )
        .await
        .unwrap();
    settle(&raw().await, &k, (0, 0)).await;
}

// ---- other processes -------------------------------------------------------

/// Runs this test binary's `child_entry` as another OS process.
fn child(role: &str, k: &str, extra: &[(&str, String)]) -> common::KillOnDrop {
    let mut env = vec![
        ("TOWER_LOCK_CHILD_KEY", k.to_owned()),
        ("TOWER_LOCK_POSTGRES_URL", pg_url()),
    ];
    env.extend(extra.iter().cloned());
    common::spawn_child(role, &env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_between_processes() {
    let k = key("processes", "shared");
    common::two_processes_exclude(|log| {
        child("worker", &k, &[("TOWER_LOCK_CHILD_LOG", log.to_owned())])
    });
    settle(&raw().await, &k, (0, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_key_as_soon_as_the_server_sees_it_go() {
    let k = key("killed", "k");
    let mut holder = child("holder", &k, &[]);
    let mut out = BufReader::new(holder.0.stdout.take().unwrap());
    common::expect_word(&mut out, "held");
    let pg = plain_backend().await;
    assert!(matches!(
        pg.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let (pg, k) = (pg.clone(), k.clone());
        tokio::spawn(async move {
            let g = pg.lock(k.as_str()).wait(Duration::from_secs(30)).await;
            (g, Instant::now())
        })
    };
    settle(&raw().await, &k, (1, 1)).await;
    let killed_at = Instant::now();
    holder.0.kill().unwrap();
    holder.0.wait().unwrap();
    let (g, at) = waiting.await.unwrap();
    eprintln!(
        "kill -9 of the holder: the waiter had the lock {} ms later",
        at.duration_since(killed_at).as_millis()
    );
    g.unwrap().release().await.unwrap();
    settle(&raw().await, &k, (0, 0)).await;
}

#[tokio::test]
#[ignore = "run as a child process by the tests above"]
async fn child_entry() {
    let Ok(role) = std::env::var("TOWER_LOCK_CHILD") else {
        return;
    };
    let k = std::env::var("TOWER_LOCK_CHILD_KEY").unwrap();
    let pg = backend().await;
    match role.as_str() {
        "worker" => {
            let log = std::env::var("TOWER_LOCK_CHILD_LOG").unwrap();
            common::worker_child(&pg, &k, &log).await;
        }
        "holder" => {
            let g = pg.lock(k.as_str()).await.unwrap();
            println!("held");
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(g);
        }
        other => panic!("unknown child role {other}"),
    }
}

/// A holder's session is named after the backend's label, its process
/// and host (`application_name`), unless the URL names it and no label
/// is set; `inspect` shows it.
#[tokio::test]
async fn inspect_names_the_holders_label_and_process() {
    use tower_lock::LockKey;
    let pid = std::process::id();
    for (label, url_name, shows) in [
        (Some("orders"), None, format!("(orders, pid {pid} on ")),
        (None, None, format!("(pid {pid} on ")),
        (None, Some("from-url"), "(from-url)".to_owned()),
        (
            Some("orders"),
            Some("from-url"),
            format!("(orders, pid {pid} on "),
        ),
    ] {
        let mut url = pg_url();
        if let Some(name) = url_name {
            let sep = if url.contains('?') { '&' } else { '?' };
            url = format!("{url}{sep}application_name={name}");
        }
        let mut options = PostgresOptions::default();
        if let Some(label) = label {
            options = options.label(label);
        }
        let pg = PostgresBackend::connect_with(&url, options).await.unwrap();
        let k = key("identity", "k");
        let held = pg.lock(k.as_str()).await.unwrap();
        let seen = backend()
            .await
            .inspect(LockKey::new(&k).unwrap())
            .await
            .unwrap();
        let who = seen.holders[0].identity.clone().unwrap_or_default();
        assert!(who.contains(&shows), "{label:?}, {url_name:?}: {who}");
        held.release().await.unwrap();
    }
}
