//! The MariaDB backend against a real server. `scripts/test-all.sh` uses
//! the one on 127.0.0.1:3306 when it answers (or starts one of its own) and
//! sets `TOWER_LOCK_MYSQL_URL`; run without it, every test here fails and
//! says how to start one.
//!
//! `GET_LOCK` names are global to the server, so every test locks keys of
//! its own (the test's name and this process's id).

mod common;

use std::io::{BufReader, Write};
use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;
use tower_lock::backend::mysql::{MysqlBackend, MysqlOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError, LockMode, Wait};

fn my_url() -> String {
    std::env::var("TOWER_LOCK_MYSQL_URL").unwrap_or_else(|_| {
        panic!(
            "TOWER_LOCK_MYSQL_URL is not set. Run scripts/test-all.sh, which uses or starts \
             a MariaDB server, or start one (Debian: apt-get install mariadb-server; \
             service mariadb start) and set TOWER_LOCK_MYSQL_URL=mysql://root@127.0.0.1:3306/test"
        )
    })
}

fn key(test: &str, name: &str) -> String {
    format!("t-{test}-{}-{name}", std::process::id())
}

async fn backend_with(options: MysqlOptions) -> MysqlBackend {
    let url = my_url();
    MysqlBackend::connect_with(&url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach MariaDB at {url}: {e}"))
}

async fn backend() -> MysqlBackend {
    backend_with(MysqlOptions::default().session_lease(Duration::from_secs(4))).await
}

async fn plain_backend() -> MysqlBackend {
    backend_with(
        MysqlOptions::default()
            .session_lease(Duration::from_secs(4))
            .cohort(CohortOptions::off()),
    )
    .await
}

/// Installs MariaDB's `metadata_lock_info` plugin (shipped with the
/// server), which listing locks needs; installing it again is a warning.
async fn lock_info_plugin() {
    static INSTALLED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    INSTALLED
        .get_or_init(|| async {
            raw()
                .await
                .query_drop("INSTALL SONAME 'metadata_lock_info'")
                .await
                .unwrap_or_else(|e| {
                    panic!("cannot install the metadata_lock_info plugin listing locks needs: {e}")
                })
        })
        .await;
}

async fn raw() -> mysql_async::Conn {
    mysql_async::Conn::from_url(my_url()).await.unwrap()
}

/// The lock name the backend uses for `key`.
const NAME: &str = "IF(CHAR_LENGTH(?) <= 64, ?, CONCAT('/', LEFT(SHA2(?, 256), 63)))";

/// The connection holding `key`'s lock, if any.
async fn holder_of(conn: &mut mysql_async::Conn, key: &str) -> Option<u64> {
    conn.exec_first::<Option<u64>, _, _>(format!("SELECT IS_USED_LOCK({NAME})"), (key, key, key))
        .await
        .unwrap()
        .flatten()
}

/// Waits until `key` is free on the server.
async fn settle_free(key: &str) {
    let mut conn = raw().await;
    for _ in 0..500 {
        if holder_of(&mut conn, key).await.is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{key} is still held on the server");
}

/// The backend in one mode, for the conformance suite.
struct Mariadb {
    mode: &'static str,
    cohort: bool,
}

impl Mariadb {
    fn options(&self) -> MysqlOptions {
        let options = MysqlOptions::default().session_lease(Duration::from_secs(4));
        if self.cohort {
            options
        } else {
            options.cohort(CohortOptions::off())
        }
    }
}

impl common::contract::Subject for Mariadb {
    type Backend = MysqlBackend;

    fn namespace(&self, test: &str) -> String {
        key(test, self.mode)
    }

    /// The server frees a user lock only for its connection.
    fn breaks_with(&self) -> Option<tower_lock::backend::BreakScope> {
        Some(tower_lock::backend::BreakScope::Sessions)
    }

    async fn connect(&self, _test: &str) -> MysqlBackend {
        lock_info_plugin().await;
        backend_with(self.options()).await
    }

    async fn connect_through_proxy(
        &self,
        _test: &str,
    ) -> Option<(Vec<common::fault_proxy::FaultProxy>, MysqlBackend)> {
        let (proxy, through) = common::proxied_url(&my_url()).await;
        // TCP through the proxy: by default the driver moves a connection
        // to a server on this host onto its Unix socket, round the proxy.
        let sep = if through.contains('?') { '&' } else { '?' };
        let through = format!("{through}{sep}prefer_socket=false");
        let backend = MysqlBackend::connect_with(&through, self.options())
            .await
            .unwrap_or_else(|e| panic!("cannot reach MariaDB through a proxy: {e}"));
        Some((vec![proxy], backend))
    }

    /// Without a cohort each waiter waits in `GET_LOCK` on a connection of
    /// its own, and MariaDB wakes them in no set order.
    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    /// `GET_LOCK` names are only seen one by one: each key the test took.
    async fn assert_nothing_left(&self, _test: &str, keys: &[String]) {
        for key in keys {
            settle_free(key).await;
        }
    }
}

mod conformance {
    mod cohort {
        crate::common::contract::conformance!(crate::Mariadb {
            mode: "cohort",
            cohort: true
        });
    }
    mod one_get_lock_per_lock {
        crate::common::contract::conformance!(crate::Mariadb {
            mode: "plain",
            cohort: false
        });
    }
}

/// A new process connects while another waits for a lock: the wait's
/// statement draws its token from the sequence, and a `CREATE SEQUENCE IF
/// NOT EXISTS` at connect would queue behind it for the whole wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_connects_while_another_process_waits_for_a_lock() {
    let k = key("connect-while-waiting", "k");
    let (holder, waiter) = (plain_backend().await, plain_backend().await);
    let held = holder.lock(k.as_str()).await.unwrap();
    let waiting = {
        let k = k.clone();
        tokio::spawn(async move {
            let g = waiter.lock(k.as_str()).wait(Duration::from_secs(20)).await;
            g.unwrap().release().await.unwrap();
        })
    };
    // The waiter's GET_LOCK is in the server.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let newcomer = MysqlBackend::connect_with(
        &my_url(),
        MysqlOptions::default().connect_timeout(Duration::from_secs(5)),
    )
    .await;
    assert!(
        newcomer.is_ok(),
        "a backend could not connect while another waited for a lock: {:?}",
        newcomer.err()
    );
    // It can lock at once, too.
    let other = newcomer.unwrap();
    let mine = other
        .lock(key("connect-while-waiting", "other").as_str())
        .await;
    mine.unwrap().release().await.unwrap();
    println!(
        "connected and locked in {:?} while a waiter waited",
        started.elapsed()
    );
    held.release().await.unwrap();
    waiting.await.unwrap();
    settle_free(&k).await;
}

#[tokio::test]
async fn one_process_never_holds_a_key_twice_and_only_exclusive_locks_are_offered() {
    let k = key("twice", "k");
    let db = plain_backend().await;
    let first = db.lock(k.as_str()).await.unwrap();
    assert!(matches!(
        db.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    for mode in [
        LockMode::Read,
        LockMode::Write,
        LockMode::Semaphore { permits: 2 },
    ] {
        let e = db.lock(k.as_str()).mode(mode).await;
        assert!(matches!(e, Err(LockError::InvalidMode(_))), "{e:?}");
    }
    first.release().await.unwrap();
    settle_free(&k).await;
}

#[tokio::test]
async fn timed_out_and_cancelled_waits_leave_no_waiter_on_the_server() {
    let k = key("cancel", "k");
    let (holder, waiter) = (plain_backend().await, plain_backend().await);
    let held = holder.lock(k.as_str()).await.unwrap();
    let timed_out = waiter
        .lock(k.as_str())
        .wait(Duration::from_millis(300))
        .await;
    assert!(
        matches!(timed_out, Err(LockError::Timeout { .. })),
        "{timed_out:?}"
    );
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move { waiter.lock(k.as_str()).wait(Wait::Forever).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    waiter.flush().await;
    // A waiter left on the server would take the lock once it is released,
    // and keep it.
    held.release().await.unwrap();
    settle_free(&k).await;
    let again = waiter.lock(k.as_str()).fail_fast().await.unwrap();
    again.release().await.unwrap();
    settle_free(&k).await;
}

#[tokio::test]
async fn sql_takes_the_same_lock_long_keys_hashed() {
    let db = plain_backend().await;
    let mut conn = raw().await;
    // Keys of `n` characters: the name is the key up to 64 characters
    // (`CHAR_LENGTH`, not bytes: `é` is two), hashed beyond.
    let prefix = key("sql", "").chars().count();
    let of = |n: usize, c: &str| key("sql", &c.repeat(n - prefix));
    let keys = [
        key("sql", "k"),
        of(100, "x"),
        of(64, "x"),
        of(65, "x"),
        of(64, "é"),
        of(65, "é"),
    ];
    for k in keys {
        let got: Option<i64> = conn
            .exec_first(format!("SELECT GET_LOCK({NAME}, 0)"), (&k, &k, &k))
            .await
            .unwrap();
        assert_eq!(got, Some(1));
        assert!(matches!(
            db.lock(k.as_str()).fail_fast().await,
            Err(LockError::Busy)
        ));
        conn.exec_drop(format!("SELECT RELEASE_LOCK({NAME})"), (&k, &k, &k))
            .await
            .unwrap();
        let g = db.lock(k.as_str()).fail_fast().await.unwrap();
        let by_sql: Option<i64> = conn
            .exec_first(format!("SELECT GET_LOCK({NAME}, 0)"), (&k, &k, &k))
            .await
            .unwrap();
        assert_eq!(by_sql, Some(0));
        g.release().await.unwrap();
        settle_free(&k).await;
    }
}

#[tokio::test]
async fn a_killed_connection_tells_the_holder_and_the_next_token_is_higher() {
    let k = key("killed-conn", "k");
    let (holder, next) = (plain_backend().await, plain_backend().await);
    let held = holder.lock(k.as_str()).await.unwrap();
    let mut conn = raw().await;
    let id = holder_of(&mut conn, &k).await.expect("held on the server");
    conn.query_drop(format!("KILL {id}")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder was not told");
    let g = next.lock(k.as_str()).fail_fast().await.unwrap();
    assert!(g.token() > held.token());
    g.release().await.unwrap();
    drop(held);
    holder
        .lock(k.as_str())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    settle_free(&k).await;
}

/// A server killed can restart with its sequence below tokens it handed
/// out (InnoDB never wrote the last updates); `RESTART` leaves the same
/// state behind without killing the machine's server.
#[tokio::test]
async fn tokens_stay_above_a_sequence_that_went_back() {
    let k = key("seq-back", "k");
    let sequence = format!("t_seq_back_{}", std::process::id());
    let options = || {
        MysqlOptions::default()
            .session_lease(Duration::from_secs(4))
            .sequence(sequence.as_str())
    };
    let before = backend_with(options()).await;
    let g = before.lock(k.as_str()).await.unwrap();
    let first = g.token();
    g.release().await.unwrap();
    let mut conn = raw().await;
    conn.query_drop(format!("ALTER SEQUENCE {sequence} RESTART WITH 1"))
        .await
        .unwrap();
    // A new process's connections, as after a server restart.
    let after = backend_with(options()).await;
    let g = after.lock(k.as_str()).await.unwrap();
    let second = g.token();
    g.release().await.unwrap();
    // Dropped before the check, so that a failure leaves nothing behind.
    conn.query_drop(format!("DROP SEQUENCE {sequence}"))
        .await
        .unwrap();
    settle_free(&k).await;
    assert!(
        second > first,
        "token {second} after the sequence went back, {first} before"
    );
}

/// A sequence made by hand that the clock floor cannot keep rising is
/// refused when connecting, saying what it needs.
#[tokio::test]
async fn a_token_sequence_that_could_wrap_or_run_out_is_refused() {
    let mut conn = raw().await;
    for (i, options) in ["CYCLE", "INCREMENT 2", "MAXVALUE 1000000"]
        .iter()
        .enumerate()
    {
        let sequence = format!("t_seq_bad_{}_{i}", std::process::id());
        conn.query_drop(format!("CREATE SEQUENCE {sequence} {options}"))
            .await
            .unwrap();
        let refused = MysqlBackend::connect_with(
            &my_url(),
            MysqlOptions::default().sequence(sequence.as_str()),
        )
        .await;
        conn.query_drop(format!("DROP SEQUENCE {sequence}"))
            .await
            .unwrap();
        match refused {
            Err(LockError::Config(m)) => assert!(m.contains("INCREMENT 1, NOCYCLE"), "{m}"),
            other => panic!("{options}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn connections_are_bounded_and_given_back() {
    let keys: Vec<String> = (0..3).map(|i| key("pool", &i.to_string())).collect();
    let waited = Duration::from_millis(300);
    let db = backend_with(
        MysqlOptions::default()
            .max_connections(2)
            .connect_timeout(waited)
            .cohort(CohortOptions::off()),
    )
    .await;
    let a = db.lock(keys[0].as_str()).await.unwrap();
    let b = db.lock(keys[1].as_str()).await.unwrap();
    // Every connection held for the whole wait: refused, saying why.
    let asked = Instant::now();
    let e = db.lock(keys[2].as_str()).await.unwrap_err();
    assert!(asked.elapsed() >= waited, "refused before the wait ran out");
    assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains("max_connections"), "{e}");
    // A lock that fails fast does not wait for a connection either.
    let asked = Instant::now();
    let e = db.lock(keys[2].as_str()).fail_fast().await.unwrap_err();
    assert!(asked.elapsed() < waited, "waited {:?}", asked.elapsed());
    assert!(e.to_string().contains("max_connections"), "{e}");
    a.release().await.unwrap();
    let c = db.lock(keys[2].as_str()).await.unwrap();
    assert_eq!(db.connections(), 2);
    b.release().await.unwrap();
    c.release().await.unwrap();
    for k in &keys {
        settle_free(k).await;
    }
}

/// A burst a little over the limit waits for a connection to be given
/// back, as a pool does, instead of failing (32 requests at once, each
/// releasing in the background, failed with the default limit of 32).
#[tokio::test]
async fn an_acquisition_waits_for_a_connection_given_back() {
    let keys: Vec<String> = (0..3).map(|i| key("pool-wait", &i.to_string())).collect();
    let db = backend_with(
        MysqlOptions::default()
            .max_connections(2)
            .connect_timeout(Duration::from_secs(10))
            .cohort(CohortOptions::off()),
    )
    .await;
    let a = db.lock(keys[0].as_str()).await.unwrap();
    let b = db.lock(keys[1].as_str()).await.unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        a.release().await.unwrap();
    });
    let c = db.lock(keys[2].as_str()).await.unwrap();
    release.await.unwrap();
    assert_eq!(db.connections(), 2, "the freed connection is reused");
    b.release().await.unwrap();
    c.release().await.unwrap();
    for k in &keys {
        settle_free(k).await;
    }
}

#[tokio::test]
async fn bad_urls_and_an_unreachable_server_are_clear_errors_within_the_timeout() {
    for bad in ["mysql://root@db:notaport/x", "postgres://x", "mysql:/x"] {
        let e = MysqlBackend::connect(bad).await.unwrap_err();
        assert!(matches!(e, LockError::Config(_)), "{bad}: {e:?}");
    }
    let port = common::free_port();
    let started = Instant::now();
    let e = MysqlBackend::connect_with(
        &format!("mysql://root@127.0.0.1:{port}/test"),
        MysqlOptions::default().connect_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

// ---- other processes -------------------------------------------------------

fn child(role: &str, k: &str, extra: &[(&str, String)]) -> common::KillOnDrop {
    let mut env = vec![
        ("TOWER_LOCK_CHILD_KEY", k.to_owned()),
        ("TOWER_LOCK_MYSQL_URL", my_url()),
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
    settle_free(&k).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_key_as_soon_as_the_server_sees_it_go() {
    let k = key("killed", "k");
    let mut holder = child("holder", &k, &[]);
    let mut out = BufReader::new(holder.0.stdout.take().unwrap());
    common::expect_word(&mut out, "held");
    let db = plain_backend().await;
    assert!(matches!(
        db.lock(k.as_str()).fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let (db, k) = (db.clone(), k.clone());
        tokio::spawn(async move {
            let g = db.lock(k.as_str()).wait(Duration::from_secs(30)).await;
            (g, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let killed_at = Instant::now();
    holder.0.kill().unwrap();
    holder.0.wait().unwrap();
    let (g, at) = waiting.await.unwrap();
    eprintln!(
        "kill -9 of the holder: the waiter had the lock {} ms later",
        at.duration_since(killed_at).as_millis()
    );
    g.unwrap().release().await.unwrap();
    settle_free(&k).await;
}

#[tokio::test]
#[ignore = "run as a child process by the tests above"]
async fn child_entry() {
    let Ok(role) = std::env::var("TOWER_LOCK_CHILD") else {
        return;
    };
    let k = std::env::var("TOWER_LOCK_CHILD_KEY").unwrap();
    let db = backend().await;
    match role.as_str() {
        "worker" => {
            let log = std::env::var("TOWER_LOCK_CHILD_LOG").unwrap();
            common::worker_child(&db, &k, &log).await;
        }
        "holder" => {
            let g = db.lock(k.as_str()).await.unwrap();
            println!("held");
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(g);
        }
        other => panic!("unknown child role {other}"),
    }
}
