//! The Redis backend against a real redis-server. `scripts/test-all.sh` starts
//! one and sets `TOWER_LOCK_REDIS_URL` (and three more for Redlock); run
//! without it, every test here fails and says how to start one.
//!
//! This package always builds tower-lock with the `redis` feature, so these
//! tests are never skipped by a feature set. The TLS tests at the end need
//! this package's `redis-tls` feature (on by default) and start their own TLS
//! servers, with certificates made by `openssl`; with
//! `--no-default-features`, one test checks that TLS URLs are refused,
//! saying why.

#[path = "../common/mod.rs"]
mod common;
mod conformance;
mod one_server;
mod processes;
mod queue;
mod redlock;
mod redlock_queue;
mod tls;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::check_two_process_log;
use common::fault_proxy::{Fault as ProxyFault, FaultProxy};

use redis::AsyncCommands;
use tower_lock::backend::redis::{RedisBackend, RedisOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError, LockKey};

fn redis_url() -> String {
    std::env::var("TOWER_LOCK_REDIS_URL").unwrap_or_else(|_| {
        panic!(
            "TOWER_LOCK_REDIS_URL is not set. Run scripts/test-all.sh, which starts a \
             redis-server, or start one (redis-server --port 6390 --save '') and set \
             TOWER_LOCK_REDIS_URL=redis://127.0.0.1:6390"
        )
    })
}

/// A backend whose keys live under a prefix of this test's own.
async fn backend(test: &str) -> RedisBackend {
    backend_at(&redis_url(), &prefix(test)).await
}

async fn backend_at(url: &str, prefix: &str) -> RedisBackend {
    RedisBackend::connect_with(url, RedisOptions::default().prefix(prefix))
        .await
        .unwrap_or_else(|e| panic!("cannot reach Redis at {url}: {e}"))
}

fn prefix(test: &str) -> String {
    format!("t-{test}-{}:", std::process::id())
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Starts counting the commands a server runs, scripts' included (its
/// command statistics reset), and keeping every command with its
/// arguments in its slow log.
async fn count_commands(conn: &mut redis::aio::MultiplexedConnection) {
    for args in [
        &["CONFIG", "SET", "slowlog-log-slower-than", "0"][..],
        &["SLOWLOG", "RESET"],
        &["CONFIG", "RESETSTAT"],
    ] {
        let () = redis::cmd(args[0])
            .arg(&args[1..])
            .query_async(conn)
            .await
            .unwrap();
    }
}

/// What the server ran since [`count_commands`]: each command's calls, by
/// name (sorted), and the whole of `INFO commandstats` to show.
async fn commands_run(
    conn: &mut redis::aio::MultiplexedConnection,
) -> (Vec<(String, u64)>, String) {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    let mut calls: Vec<(String, u64)> = stats
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let n = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            (!matches!(name, "config|resetstat" | "slowlog|reset")).then(|| (name.to_owned(), n))
        })
        .collect();
    calls.sort();
    (calls, stats)
}

/// `(name, calls)` pairs as [`commands_run`] gives them.
fn calls(expected: &[(&str, u64)]) -> Vec<(String, u64)> {
    expected
        .iter()
        .map(|(name, n)| (name.to_string(), *n))
        .collect()
}

/// Every Redis key under `prefix`.
async fn keys_under(url: &str, prefix: &str) -> Vec<String> {
    let mut conn = raw(url).await;
    let mut keys: Vec<String> = conn.keys(format!("{prefix}*")).await.unwrap();
    keys.sort();
    keys
}

/// Waits until `channel` has `n` subscribers; fails the test if it has not
/// within two seconds.
async fn subscribers(channel: &str, n: i64) {
    let url = redis_url();
    for _ in 0..100 {
        let (_, subscribed): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query_async(&mut raw(&url).await)
            .await
            .unwrap();
        if subscribed == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{channel} did not get {n} subscribers");
}

/// Waits until `n` channels matching `pattern` have subscribers; fails the
/// test if they have not within two seconds.
async fn listening(pattern: &str, n: usize) {
    listening_at(&redis_url(), pattern, n).await
}

/// [`listening`] on the server at `url`.
async fn listening_at(url: &str, pattern: &str, n: usize) {
    for _ in 0..100 {
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg(pattern)
            .query_async(&mut raw(url).await)
            .await
            .unwrap();
        if channels.len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{pattern} did not get {n} channels listened to");
}

// ---- other processes ----------------------------------------------------

/// Runs this test binary again as a child in `role`, on the test's key
/// prefix and Redis, with `extra` in its environment.
fn child(role: &str, test: &str, extra: &[(&str, String)]) -> common::KillOnDrop {
    let mut env = vec![
        ("TOWER_LOCK_CHILD_PREFIX", prefix(test)),
        ("TOWER_LOCK_REDIS_URL", redis_url()),
    ];
    env.extend(extra.iter().cloned());
    common::spawn_child(role, &env)
}

/// A line `name=value` from the child's output.
fn read_value(child: &mut Child, name: &str) -> String {
    let reader = BufReader::new(child.stdout.as_mut().unwrap());
    for line in reader.lines() {
        let line = line.unwrap();
        // libtest may print `test child_entry ... ` on the same line.
        let field = format!("{name}=");
        if let Some(v) = line.split_whitespace().find_map(|w| w.strip_prefix(&field)) {
            return v.to_owned();
        }
    }
    panic!("the child never printed {name}=");
}

/// A store that refuses writes carrying a fencing token lower than the
/// highest it has seen.
const FENCED_WRITE: &str = r#"
local seen = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < seen then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"#;

async fn fenced_write(url: &str, store: &str, token: u64) -> bool {
    let accepted: i64 = redis::Script::new(FENCED_WRITE)
        .key(store)
        .arg(token.to_string())
        .invoke_async(&mut raw(url).await)
        .await
        .unwrap();
    accepted == 1
}

/// Entry point of the child processes (ignored when run as a test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by the tests above as a child process"]
async fn child_entry() {
    let Ok(role) = std::env::var("TOWER_LOCK_CHILD") else {
        return;
    };
    #[cfg(feature = "redis-tls")]
    if role == "tls_lock" {
        return tls::tls_lock_child().await;
    }
    if role == "redlock_holder" {
        // Takes the key on the Redlock servers given, says so, and holds it
        // (renewing) until killed.
        let url = std::env::var("REDLOCK_URL").unwrap();
        let lease = Duration::from_millis(std::env::var("LEASE_MS").unwrap().parse().unwrap());
        let b = tower_lock::backend::redis::redlock::RedlockBackend::connect(&url)
            .await
            .unwrap();
        let g = b.lock("held").lease(lease).await.unwrap();
        println!("token={}", g.token());
        std::io::stdout().flush().unwrap();
        return std::future::pending().await;
    }
    let url = redis_url();
    let prefix = std::env::var("TOWER_LOCK_CHILD_PREFIX").unwrap();
    let b = backend_at(&url, &prefix).await;
    match role.as_str() {
        "worker" => {
            let mut conn = raw(&url).await;
            let inside = format!("{prefix}inside");
            // Redis orders the log's entries, whatever the processes' clocks.
            let log = format!("{prefix}log");
            let me = std::process::id();
            // Both workers start together: connected, then told to go.
            println!("ready");
            std::io::stdout().flush().unwrap();
            std::io::stdin().read_line(&mut String::new()).unwrap();
            let _: i64 = conn.rpush(&log, format!("start {me}")).await.unwrap();
            let mut overlaps = 0;
            for _ in 0..100 {
                let g = b
                    .lock("shared")
                    .wait(Duration::from_secs(30))
                    .await
                    .unwrap();
                let n: i64 = conn.incr(&inside, 1).await.unwrap();
                if n != 1 {
                    overlaps += 1;
                }
                let _: i64 = conn.rpush(&log, format!("enter {me}")).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
                let _: i64 = conn.rpush(&log, format!("leave {me}")).await.unwrap();
                let _: i64 = conn.decr(&inside, 1).await.unwrap();
                g.release().await.unwrap();
            }
            let _: i64 = conn.rpush(&log, format!("end {me}")).await.unwrap();
            println!("overlaps={overlaps}");
        }
        "holder" => {
            let lease = Duration::from_millis(std::env::var("LEASE_MS").unwrap().parse().unwrap());
            let g = b.lock("held").lease(lease).await.unwrap();
            println!("token={}", g.token());
            // Work until told the lock is gone, then try to write anyway.
            g.lost().await;
            let store = format!("{prefix}store");
            let accepted = fenced_write(&url, &store, g.token().get()).await;
            println!(
                "stale_write={}",
                if accepted { "accepted" } else { "refused" }
            );
        }
        "release_and_exit" => {
            // On one thread: a task that is not polled before the exit below
            // (such as a release left to the background) never runs.
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let b = backend_at(&url, &prefix).await;
                    let g = b.lock("exit").lease(Duration::from_secs(60)).await.unwrap();
                    println!("token={}", g.token());
                    match std::env::var("HOW").unwrap().as_str() {
                        "await" => g.release().await.unwrap(),
                        "drop_flush" => {
                            drop(g);
                            b.flush().await;
                        }
                        _ => drop(g),
                    }
                    // At once, without the runtime's orderly shutdown.
                    std::process::exit(0);
                })
            })
            .join()
            .unwrap();
        }
        other => panic!("unknown child role {other}"),
    }
}

// ---- shared by the modules ----------------------------------------------

/// When `signal` fires, by the clock of a task of its own (so that the
/// moment is taken when the signal wakes it, not when the test looks).
fn when_lost(signal: &tower_lock::LostSignal) -> tokio::task::JoinHandle<Instant> {
    let signal = signal.clone();
    tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    })
}

/// Waits for a `when_lost` task; `limit` only bounds a hang, the callers
/// assert the guarantee on the instant.
async fn lost_at(task: tokio::task::JoinHandle<Instant>, limit: Duration, what: &str) -> Instant {
    tokio::time::timeout(limit, task)
        .await
        .unwrap_or_else(|_| panic!("{what}: the holder was never told its lock was lost"))
        .unwrap()
}

fn socket_addr(url: &str) -> std::net::SocketAddr {
    let hostport = url
        .strip_prefix("redis://")
        .unwrap_or_else(|| panic!("{url} is not a redis:// URL"))
        .trim_end_matches('/');
    hostport
        .parse()
        .unwrap_or_else(|e| panic!("{url}: the tests need redis://IP:PORT ({e})"))
}

/// How a holder's renewals are made to fail while Redis stays up.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Its connections go through a proxy that stops passing anything:
    /// renewals go unanswered.
    Silent,
    /// Its connections go through a proxy that closes them and refuses new
    /// ones.
    Cut,
    /// It connects as a Redis user whose scripting rights are revoked:
    /// renewals are answered with an error.
    Refused,
}

/// Asserts a holder that asked for its lock at `asked` and lost it at `fault`
/// (no renewal succeeding after) was told at `lost`: before the lease ended
/// (it counts from when the acquire was sent, which is after `asked`), and
/// within two thirds of the lease of the fault (the next renewal starts
/// within a third and ends, answered or timed out, within another).
fn told_within_a_renewal(
    lost: Instant,
    asked: Instant,
    lease: Duration,
    fault: Instant,
    what: &str,
) {
    assert!(
        lost < asked + lease,
        "told {:?} after asking for a {lease:?} lease: after it ended",
        lost - asked
    );
    assert!(
        lost < fault + lease * 2 / 3,
        "told {:?} after {what}",
        lost - fault
    );
}

/// Asserts the holder of `g` was told (at `lost`) before its lease can have
/// ended (every request the server granted was sent before `last_sent`) and
/// before someone else was `granted` the key; returns the reason it was told.
fn told_in_time(
    g: &tower_lock::LockGuard,
    lost: Instant,
    last_sent: Instant,
    lease: Duration,
    granted: Instant,
    what: &str,
) -> String {
    assert!(
        lost < last_sent + lease,
        "{what}: told {:?} after the holder's last request went out, past its {lease:?} lease",
        lost - last_sent
    );
    assert!(
        lost < granted,
        "{what}: another client was granted the key {:?} before the holder was told",
        lost - granted
    );
    let reason = g.held().lost_signal().reason().unwrap().to_owned();
    eprintln!(
        "{what}: told {:?} after the last request went out, {:?} before the next grant: {reason}",
        lost - last_sent,
        granted - lost
    );
    reason
}

/// A redis-server of the test's own (`tower_lock_servers`), on a free
/// port, stopped when dropped.
struct Server {
    port: u16,
    inner: tower_lock_servers::Server,
    dir: std::path::PathBuf,
}

impl Server {
    fn start() -> Server {
        Self::wrap(|work, name| {
            tower_lock_servers::Server::start(tower_lock_servers::Kind::Redis, work, name)
        })
    }

    /// A directory of its own, and the server `start` makes in it.
    fn wrap(
        start: impl FnOnce(&std::path::Path, &str) -> Result<tower_lock_servers::Server, String>,
    ) -> Server {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let work =
            std::env::temp_dir().join(format!("tower-lock-redis-tests-{}", std::process::id()));
        let name = format!("redis{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let inner = start(&work, &name).unwrap_or_else(|e| {
            panic!(
                "cannot start redis-server ({e}): install it with `apt-get install \
                 redis-server` (scripts/test-all.sh does, as root)"
            )
        });
        Server {
            port: inner.addr.port(),
            inner,
            dir: work.join(name),
        }
    }

    /// `kill -9`.
    fn kill(&mut self) {
        self.inner.kill();
    }

    /// Starts a killed server again, on the same port, empty.
    fn restart(&mut self) {
        self.inner.restart().unwrap();
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The same address as a TLS URL.
    #[cfg(feature = "redis-tls")]
    fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.port)
    }

    fn addr(&self) -> std::net::SocketAddr {
        self.inner.addr
    }

    /// Sends `sig` (`STOP`, `CONT`) to the server.
    fn signal(&self, sig: &str) {
        assert!(self.inner.is_running(), "the server runs");
        self.inner.signal(sig);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Stopped before its files go.
        self.inner.signal("CONT");
        self.inner.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn redlock_url(servers: &[Server]) -> String {
    let addrs: Vec<String> = servers
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port))
        .collect();
    format!("redlock://{}", addrs.join(","))
}

/// Four tasks, two on each backend, take key `k` ten times each: one holder
/// at a time, and each task's tokens rising.
async fn contend_from_two<B: Backend + Clone>(a: &B, b: &B) {
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for backend in [a.clone(), b.clone(), a.clone(), b.clone()] {
        let inside = inside.clone();
        tasks.push(tokio::spawn(async move {
            let mut tokens = Vec::new();
            for _ in 0..10 {
                let g = backend
                    .lock("k")
                    .wait(Duration::from_secs(30))
                    .await
                    .unwrap();
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokens.push(g.token());
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await.unwrap();
            }
            tokens
        }));
    }
    for t in tasks {
        let tokens = t.await.unwrap();
        assert!(tokens.windows(2).all(|w| w[0] < w[1]));
    }
}
