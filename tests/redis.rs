//! The Redis backend against a real redis-server. `scripts/test-all.sh` starts
//! one and sets `TOWER_LOCK_REDIS_URL`.
#![cfg(feature = "redis")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::AsyncCommands;
use tower_lock::backend::{RedisBackend, RedisOptions};
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

/// Every Redis key under `prefix`.
async fn keys_under(url: &str, prefix: &str) -> Vec<String> {
    let mut conn = raw(url).await;
    let mut keys: Vec<String> = conn.keys(format!("{prefix}*")).await.unwrap();
    keys.sort();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_under_contention_with_increasing_tokens() {
    let b = backend("contention").await;
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (b, inside, tokens) = (b.clone(), inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..15 {
                let g = b.lock("hot").wait(Duration::from_secs(30)).await.unwrap();
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokens.lock().unwrap().push(g.token());
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let tokens = std::mem::take(&mut *tokens.lock().unwrap());
    assert_eq!(tokens.len(), 240);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing"
    );
    // Only the fencing counter stays behind.
    let url = redis_url();
    assert_eq!(
        keys_under(&url, &prefix("contention")).await,
        [format!("{}{{hot}}:fence", prefix("contention"))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_passes_to_local_waiters_with_one_redis_acquire_per_eight_grants() {
    let b = backend("baton").await;
    let url = redis_url();
    let fence = format!("{}{{k}}:fence", prefix("baton"));
    let mut conn = raw(&url).await;
    let first = b.lock("k").await.unwrap();
    let counter: u64 = conn.get(&fence).await.unwrap();
    let tokens = Arc::new(Mutex::new(vec![first.token().get()]));
    let waiters: Vec<_> = (0..16)
        .map(|_| {
            let (b, tokens) = (b.clone(), tokens.clone());
            tokio::spawn(async move {
                let g = b.lock("k").wait(Duration::from_secs(10)).await.unwrap();
                tokens.lock().unwrap().push(g.token().get());
                g.release().await.unwrap();
            })
        })
        .collect();
    // Let every waiter queue behind the holder.
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    // 17 grants from three Redis acquisitions, each reserving 8 tokens:
    // consecutive tokens, the counter two blocks further.
    let tokens = tokens.lock().unwrap().clone();
    let t0 = tokens[0];
    assert_eq!(tokens, (t0..t0 + 17).collect::<Vec<_>>());
    let after: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(after, counter + 16);
    assert_eq!(keys_under(&url, &prefix("baton")).await, [fence]);
}

#[tokio::test]
async fn a_release_wakes_the_waiter_long_before_the_lease_ends() {
    let b = backend("wake").await;
    let holder = b.lock("k").lease(Duration::from_secs(60)).await.unwrap();
    let waiter = {
        // Another instance, as another process would be: the waiter must
        // learn of the release from Redis, not from this process's queue.
        let b = backend("wake").await;
        // A waiter relying on the lease would wait 60 s; the budget is 10.
        tokio::spawn(async move { b.lock("k").wait(Duration::from_secs(10)).await })
    };
    // The waiter listens on the key's release channel rather than polling.
    let url = redis_url();
    let channel = format!("{}{{k}}:rel", prefix("wake"));
    let mut subscribed = 0;
    for _ in 0..100 {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut raw(&url).await)
            .await
            .unwrap();
        subscribed = n;
        if n > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(subscribed, 1, "the waiter did not subscribe to {channel}");
    holder.release().await.unwrap();
    let g = waiter
        .await
        .unwrap()
        .expect("the waiter was not woken by the release");
    g.release().await.unwrap();
    assert!(b.lock("k").fail_fast().await.is_ok());
}

#[tokio::test]
async fn renewal_keeps_a_lock_past_its_lease() {
    let b = backend("renew").await;
    let g = b.lock("k").lease(Duration::from_millis(300)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(!g.is_lost());
    assert!(matches!(
        b.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let other = backend("renew").await; // another "process"
    assert!(matches!(
        other.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    g.release().await.unwrap();
    assert!(other.lock("k").fail_fast().await.is_ok());
}

#[tokio::test]
async fn a_lock_taken_away_is_reported_lost() {
    let url = redis_url();
    let b = backend("taken").await;
    let g = b.lock("k").lease(Duration::from_millis(600)).await.unwrap();
    let key = b.redis_key(&LockKey::new("k").unwrap());
    let _: () = raw(&url).await.del(&key).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("not told the lock was lost");
    assert!(g
        .held()
        .lost_signal()
        .reason()
        .unwrap()
        .contains("another owner"));
}

#[tokio::test]
async fn read_write_and_semaphore() {
    let b = backend("modes").await;
    let r1 = b.lock("doc").read().await.unwrap();
    let other = backend("modes").await;
    let r2 = other.lock("doc").read().fail_fast().await.unwrap();
    assert!(matches!(
        other.lock("doc").write().fail_fast().await,
        Err(LockError::Busy)
    ));
    drop(r1);
    r2.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await; // the dropped one releases in the background
    let w = other
        .lock("doc")
        .write()
        .wait(Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(
        b.lock("doc").read().fail_fast().await,
        Err(LockError::Busy)
    ));
    w.release().await.unwrap();

    let s1 = b.lock("pool").semaphore(2).await.unwrap();
    let s2 = other.lock("pool").semaphore(2).await.unwrap();
    assert!(matches!(
        backend("modes")
            .await
            .lock("pool")
            .semaphore(2)
            .fail_fast()
            .await,
        Err(LockError::Busy)
    ));
    s1.release().await.unwrap();
    let s3 = backend("modes")
        .await
        .lock("pool")
        .semaphore(2)
        .fail_fast()
        .await
        .unwrap();
    assert!(s3.token() > s2.token());
    s2.release().await.unwrap();
    s3.release().await.unwrap();
    let url = redis_url();
    let left = keys_under(&url, &prefix("modes")).await;
    assert!(
        left.iter().all(|k| k.ends_with(":fence")),
        "left behind: {left:?}"
    );
}

#[tokio::test]
async fn multi_key_through_the_core() {
    let b = backend("multi").await;
    let set = b.lock_all(["b", "a"]).await.unwrap();
    let other = backend("multi").await;
    assert!(matches!(
        other.lock_all(["a", "c"]).fail_fast().await,
        Err(LockError::Busy)
    ));
    set.release().await.unwrap();
    other
        .lock_all(["a", "c"])
        .fail_fast()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[tokio::test]
async fn an_unreachable_server_is_a_clear_error() {
    let err = RedisBackend::connect("redis://127.0.0.1:1/")
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
    assert!(
        err.to_string().contains("redis lock backend unavailable"),
        "{err}"
    );
}

/// Runs a redis-py script against `url`; its stdout, trimmed.
fn python(script: &str, url: &str) -> std::process::Child {
    Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(script)
        .arg(url)
        .stdout(Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3 with redis-py (Debian python3-redis) is needed")
}

fn first_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.trim().to_owned()
}

#[tokio::test]
async fn interoperates_with_redis_py_lock() {
    let url = redis_url();
    let b = backend("redispy").await;
    let name = b.redis_key(&LockKey::new("order-1").unwrap());

    // redis-py holds: we wait, and get it once Python releases.
    let mut py = python(
        &format!(
            "import sys, time, redis\n\
             r = redis.Redis.from_url(sys.argv[1])\n\
             l = r.lock({name:?}, timeout=10)\n\
             assert l.acquire(blocking=False)\n\
             print('held', flush=True)\n\
             time.sleep(0.5)\n\
             l.release()\n"
        ),
        &url,
    );
    assert_eq!(first_line(&mut py), "held");
    assert!(matches!(
        b.lock("order-1").fail_fast().await,
        Err(LockError::Busy)
    ));
    let g = b
        .lock("order-1")
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(py.wait().unwrap().success());

    // We hold: redis-py cannot take it, then can once we release.
    let mut py = python(
        &format!(
            "import sys, redis\n\
             r = redis.Redis.from_url(sys.argv[1])\n\
             l = r.lock({name:?}, timeout=10)\n\
             print('busy' if not l.acquire(blocking=False) else 'got', flush=True)\n\
             print('got' if l.acquire(blocking=True, blocking_timeout=10) else 'timeout', flush=True)\n\
             l.release()\n"
        ),
        &url,
    );
    assert_eq!(first_line(&mut py), "busy");
    g.release().await.unwrap();
    assert_eq!(first_line(&mut py), "got");
    assert!(py.wait().unwrap().success());
}

// ---- other processes ----------------------------------------------------

/// Runs this test binary again as a child in `role`.
fn child(role: &str, test: &str, extra: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child_entry",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("TOWER_LOCK_CHILD", role)
    .env("TOWER_LOCK_CHILD_PREFIX", prefix(test))
    .env("TOWER_LOCK_REDIS_URL", redis_url())
    .stdout(Stdio::piped());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
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
    let url = redis_url();
    let prefix = std::env::var("TOWER_LOCK_CHILD_PREFIX").unwrap();
    let b = backend_at(&url, &prefix).await;
    match role.as_str() {
        "worker" => {
            let mut conn = raw(&url).await;
            let inside = format!("{prefix}inside");
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
                tokio::time::sleep(Duration::from_millis(1)).await;
                let _: i64 = conn.decr(&inside, 1).await.unwrap();
                g.release().await.unwrap();
            }
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

#[tokio::test]
async fn excludes_between_processes() {
    let test = "procs";
    let mut a = child("worker", test, &[]);
    let mut b = child("worker", test, &[]);
    assert_eq!(read_value(&mut a, "overlaps"), "0");
    assert_eq!(read_value(&mut b, "overlaps"), "0");
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
}

#[tokio::test]
async fn a_release_reaches_redis_when_the_process_exits_right_after() {
    let test = "exit";
    let b = backend(test).await;
    for how in ["await", "drop_flush"] {
        let mut c = child("release_and_exit", test, &[("HOW", how.into())]);
        read_value(&mut c, "token");
        assert!(c.wait().unwrap().success());
        // Other connections see the release a moment later; a lost one
        // would keep the key for the child's whole lease.
        let g = b.lock("exit").wait(Duration::from_secs(5)).await;
        g.expect("the child's release was lost")
            .release()
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_killed_holder_frees_the_key_when_its_lease_ends() {
    let test = "killed";
    let mut holder = child("holder", test, &[("LEASE_MS", "1000".into())]);
    read_value(&mut holder, "token");
    holder.kill().unwrap(); // SIGKILL: no release, no renewal
    holder.wait().unwrap();
    let b = backend(test).await;
    assert!(matches!(
        b.lock("held").fail_fast().await,
        Err(LockError::Busy)
    ));
    let g = b.lock("held").wait(Duration::from_secs(10)).await.unwrap();
    g.release().await.unwrap();
}

#[tokio::test]
async fn a_paused_holder_loses_the_lock_and_its_stale_token_is_refused() {
    let test = "paused";
    let url = redis_url();
    let mut holder = child("holder", test, &[("LEASE_MS", "600".into())]);
    let stale: u64 = read_value(&mut holder, "token").parse().unwrap();
    let pid = holder.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());

    // The lease runs out while the holder is stopped; we take the key and
    // write with our (higher) token.
    let b = backend(test).await;
    let g = b.lock("held").wait(Duration::from_secs(10)).await.unwrap();
    assert!(g.token().get() > stale);
    assert!(fenced_write(&url, &format!("{}store", prefix(test)), g.token().get()).await);

    assert!(Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    // The holder wakes, learns at its next renewal that the lock is gone,
    // and its write is refused by the fenced store.
    assert_eq!(read_value(&mut holder, "stale_write"), "refused");
    assert!(holder.wait().unwrap().success());
    g.release().await.unwrap();
}

#[tokio::test]
async fn a_restarted_server_makes_the_holder_lost_and_tokens_keep_rising() {
    // Its own server, since the test restarts it.
    let server = Server::start();
    let (port, url) = (server.port, server.url());
    let b = backend_at(&url, "restart:").await;
    let g = b.lock("k").lease(Duration::from_secs(3)).await.unwrap();

    drop(server);
    let server = Server::start_on(port);

    tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("the holder was not told its lock was lost");
    // The restarted server forgot the lock and the counter; a new holder's
    // token is still higher, so storage can refuse the old one.
    let other = backend_at(&url, "restart:").await;
    let g2 = other.lock("k").wait(Duration::from_secs(10)).await.unwrap();
    assert!(g2.token() > g.token());
    g2.release().await.unwrap();
    drop(g);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_restart_quarantine_no_one_takes_a_key_an_old_holder_may_still_hold() {
    let server = Server::start();
    let (port, url) = (server.port, server.url());
    let quarantined = |url: String| async move {
        RedisBackend::connect_with(
            &url,
            RedisOptions::default()
                .prefix("q:")
                .restart_quarantine(Duration::from_millis(1500)),
        )
        .await
        .unwrap()
    };
    // A new server waits once too: the marker tells an empty server apart.
    let b = quarantined(url.clone()).await;
    assert!(matches!(
        b.lock("k").lease(Duration::from_secs(30)).await,
        Err(LockError::Config(_))
    ));
    let lease = Duration::from_millis(1500);
    assert!(matches!(
        b.lock("k").lease(lease).fail_fast().await,
        Err(LockError::Busy)
    ));
    let g = b
        .lock("k")
        .lease(lease)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();

    // Restarted mid-hold: the holder may be inside its lease for 1.5 s more.
    drop(server);
    let server = Server::start_on(port);
    let other = quarantined(url.clone()).await;
    let restarted = std::time::Instant::now();
    assert!(matches!(
        other.lock("k").lease(lease).fail_fast().await,
        Err(LockError::Busy)
    ));
    let g2 = other
        .lock("k")
        .lease(lease)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        restarted.elapsed() >= Duration::from_millis(1400),
        "granted {:?} after the restart, inside the old holder's lease",
        restarted.elapsed()
    );
    assert!(
        g.is_lost(),
        "the old holder was not told before the next grant"
    );
    assert!(g2.token() > g.token());
    g2.release().await.unwrap();
    drop(g);
    drop(server);
}

// ---- Redlock --------------------------------------------------------------

/// A redis-server of the test's own, on a free port, stopped when dropped.
struct Server {
    port: u16,
    child: Child,
}

impl Server {
    fn start() -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::start_on(port)
    }

    /// On `port`, as after a restart.
    fn start_on(port: u16) -> Server {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (Debian redis-server) is needed");
        let s = Server { port, child };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return s;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {port} did not start");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redlock_url(servers: &[Server]) -> String {
    let addrs: Vec<String> = servers
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port))
        .collect();
    format!("redlock://{}", addrs.join(","))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_excludes_and_cleans_up() {
    use tower_lock::backend::RedlockBackend;
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let url = redlock_url(&servers);
    let a = RedlockBackend::connect(&url).await.unwrap();
    let b = RedlockBackend::connect(&url).await.unwrap();
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
    assert!(matches!(
        a.lock("k").read().await,
        Err(LockError::InvalidMode(_))
    ));
    for s in &servers {
        let keys = keys_under(&s.url(), "lock:").await;
        assert_eq!(keys, ["lock:{k}:fence"], "left behind on {}", s.url());
    }
}

#[tokio::test]
async fn redlock_works_with_one_of_three_down_and_says_why_with_two() {
    use tower_lock::backend::RedlockBackend;
    let mut servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let url = redlock_url(&servers);
    let backend = RedlockBackend::connect(&url).await.unwrap();
    drop(servers.pop());
    let g = backend
        .lock("k")
        .wait(Duration::from_secs(5))
        .await
        .unwrap();
    g.release().await.unwrap();

    drop(servers.pop());
    let err = backend
        .lock("k")
        .wait(Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
    assert!(
        err.to_string().contains("only 1 of 3 instances answered"),
        "{err}"
    );
}

#[tokio::test]
async fn redlock_holder_is_told_when_a_majority_is_gone() {
    use tower_lock::backend::RedlockBackend;
    let mut servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let backend = RedlockBackend::connect(&redlock_url(&servers))
        .await
        .unwrap();
    let g = backend
        .lock("k")
        .lease(Duration::from_millis(600))
        .await
        .unwrap();
    drop(servers.pop());
    drop(servers.pop());
    tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("not told the lock was lost");
    assert!(g
        .held()
        .lost_signal()
        .reason()
        .unwrap()
        .contains("majority"));
}
