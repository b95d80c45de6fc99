//! The Redis backend against a real redis-server. `scripts/test-all.sh` starts
//! one and sets `TOWER_LOCK_REDIS_URL` (and three more for Redlock); run
//! without it, every test here fails and says how to start one.
//!
//! Cargo.toml's dev-dependency on this crate turns the `redis` feature on
//! for every test build, plain `cargo test` included, so these tests are
//! always built: they are never skipped by a feature set. The exceptions are
//! the TLS tests at the end, which need the `redis-tls` feature
//! (`cargo test --all-features`, as scripts/test-all.sh runs them) and start
//! their own TLS servers, with certificates made by `openssl`; without the
//! feature, one test checks that TLS URLs are refused, saying why.

#[cfg(not(feature = "redis"))]
compile_error!(
    "tests/redis.rs needs the `redis` feature (Cargo.toml's self dev-dependency enables it); \
     run scripts/test-all.sh, or `cargo test --all-features` with the servers it starts"
);

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fault_proxy::{Fault as ProxyFault, FaultProxy};
use common::{check_two_process_log, free_port};

use redis::AsyncCommands;
use tower_lock::backend::{CohortOptions, RedisBackend, RedisOptions};
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
    common::excludes_with_increasing_tokens(&[b], "hot", 16, 15).await;
    // Only the fencing counter stays behind.
    let url = redis_url();
    assert_eq!(
        keys_under(&url, &prefix("contention")).await,
        [format!("{}{{hot}}:fence", prefix("contention"))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_left_for_a_waiter_that_never_takes_it_goes_back_within_the_bound() {
    // A waiter whose future is never polled again after the lock is passed
    // to it: the lock left for it must not stay with this process (renewed
    // all along) past the cohort's time bound.
    let options = RedisOptions::default()
        .prefix(prefix("parked"))
        .cohort(CohortOptions::default().max_hold(Duration::from_millis(300)));
    let here = RedisBackend::connect_with(&redis_url(), options)
        .await
        .unwrap();
    let elsewhere = backend("parked").await;
    let held = here.lock("k").await.unwrap();
    let mut forgotten = Box::pin(std::future::IntoFuture::into_future(
        here.lock("k").wait(tower_lock::Wait::Forever),
    ));
    // Polled until it is queued behind the holder, then never again.
    assert!(
        tokio::time::timeout(Duration::from_millis(50), &mut forgotten)
            .await
            .is_err()
    );
    drop(held);
    let taken = elsewhere.lock("k").wait(Duration::from_secs(5)).await;
    assert!(
        taken.is_ok(),
        "the lock stayed with the forgotten waiter: {taken:?}"
    );
    taken.unwrap().release().await.unwrap();
    drop(forgotten);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_passes_to_local_waiters_with_one_redis_acquire_per_bound() {
    let cohort = CohortOptions::default()
        .max_grants(8)
        .max_hold(Duration::from_secs(60));
    let options = RedisOptions::default()
        .prefix(prefix("baton"))
        .cohort(cohort);
    let b = RedisBackend::connect_with(&redis_url(), options)
        .await
        .unwrap();
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
    // consecutive within a block; between blocks the counter may jump to
    // the server's clock, which it never falls behind.
    let tokens = tokens.lock().unwrap().clone();
    let mut runs = vec![1];
    for pair in tokens.windows(2) {
        assert!(pair[1] > pair[0], "tokens rise: {tokens:?}");
        if pair[1] == pair[0] + 1 {
            *runs.last_mut().unwrap() += 1;
        } else {
            runs.push(1);
        }
    }
    assert_eq!(runs, [8, 8, 1], "{tokens:?}");
    let after: u64 = conn.get(&fence).await.unwrap();
    assert!(after >= counter + 16);
    assert_eq!(after, tokens[16] + 7, "the last block's end");
    assert_eq!(keys_under(&url, &prefix("baton")).await, [fence]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_connections_with_queues_of_their_own_take_turns() {
    let (a, b) = (backend("turns").await, backend("turns").await);
    let counts = common::take_turns(&a, &b, "k", Duration::from_millis(1500)).await;
    common::assert_neither_starved(counts);
    a.flush().await;
    b.flush().await;
    let fence = format!("{}{{k}}:fence", prefix("turns"));
    assert_eq!(keys_under(&redis_url(), &prefix("turns")).await, [fence]);
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
async fn waiters_in_one_process_are_served_in_arrival_order() {
    let b = backend("fifo").await;
    let holder = b.lock("k").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    // More waiters than one Redis acquisition serves (8 grants): the order
    // holds across the lock going back to Redis and being taken again.
    for i in 0..20 {
        let (b, order) = (b.clone(), order.clone());
        waiters.push(tokio::spawn(async move {
            let g = b.lock("k").wait(Duration::from_secs(10)).await.unwrap();
            order.lock().unwrap().push(i);
            tokio::task::yield_now().await;
            g.release().await.unwrap();
        }));
        // On the current-thread runtime this runs waiter i until it queues.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
    }
    holder.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..20).collect::<Vec<_>>());

    // In every mode: a reader that arrives after a queued writer waits for
    // it, though it could share with the reader holding the key.
    let reader = b.lock("doc").read().await.unwrap();
    let writer = {
        let b = b.clone();
        tokio::spawn(async move { b.lock("doc").write().wait(Duration::from_secs(10)).await })
    };
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    assert!(!writer.is_finished());
    let late = b.lock("doc").read().fail_fast().await;
    assert!(
        matches!(late, Err(LockError::Busy)),
        "a reader overtook a queued writer: {late:?}"
    );
    reader.release().await.unwrap();
    writer.await.unwrap().unwrap().release().await.unwrap();
}

#[tokio::test]
async fn tokens_keep_rising_when_the_fencing_counter_expires() {
    let url = redis_url();
    let b = backend("fence-expiry").await;
    let fence = format!("{}{{k}}:fence", prefix("fence-expiry"));
    let mut conn = raw(&url).await;
    let day_ms = 24 * 3600 * 1000;
    let mut last = 0;
    for round in 0..3 {
        // A burst of acquisitions moves the counter on; then it expires.
        for i in 0..50 {
            let g = if i % 5 == 0 {
                b.lock("k").read().await.unwrap()
            } else {
                b.lock("k").await.unwrap()
            };
            assert!(
                g.token().get() > last,
                "round {round}: token {} after {last}",
                g.token()
            );
            last = g.token().get();
            g.release().await.unwrap();
        }
        // The counter outlives its key by a day, not forever.
        let ttl: i64 = conn.pttl(&fence).await.unwrap();
        assert!(ttl > day_ms - 60_000 && ttl <= day_ms, "{fence} PTTL {ttl}");
        let _: bool = conn.pexpire(&fence, 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let exists: bool = conn.exists(&fence).await.unwrap();
        assert!(!exists, "{fence} did not expire");
    }
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_is_not_handed_to_the_next_local_waiter() {
    let url = redis_url();
    let cohort = CohortOptions::default()
        .max_grants(8)
        .max_hold(Duration::from_secs(60));
    let options = RedisOptions::default()
        .prefix(prefix("lost-baton"))
        .cohort(cohort);
    let b = RedisBackend::connect_with(&url, options).await.unwrap();
    let lease = Duration::from_millis(600);
    let g = b.lock("k").lease(lease).await.unwrap();
    let lost = when_lost(g.held().lost_signal());
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.lock("k").lease(lease).wait(Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Taken away in Redis: the holder's renewal finds it gone.
    let key = b.redis_key(&LockKey::new("k").unwrap());
    let deleted: i64 = raw(&url).await.del(&key).await.unwrap();
    assert_eq!(deleted, 1, "the lock was not in Redis under {key}");
    lost_at(lost, 2 * lease, "taken away").await;
    let first = g.token().get();
    drop(g);
    // Handed on, the waiter would hold nothing in Redis, with the next token
    // of the lost lock's block.
    let next = waiter.await.unwrap().unwrap();
    let exists: bool = raw(&url).await.exists(&key).await.unwrap();
    assert!(
        exists,
        "the waiter was given the lost lock: {key} is not in Redis"
    );
    assert!(
        next.token().get() >= first + 8,
        "token {} is from the lost lock's block (from {first})",
        next.token()
    );
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_taken_away_is_reported_lost_within_a_renewal_and_before_its_lease_ends() {
    let url = redis_url();
    let b = backend("taken").await;
    let lease = Duration::from_millis(600);
    let asked = Instant::now();
    let g = b.lock("k").lease(lease).await.unwrap();
    let lost = when_lost(g.held().lost_signal());
    let key = b.redis_key(&LockKey::new("k").unwrap());
    let deleted: i64 = raw(&url).await.del(&key).await.unwrap();
    let taken = Instant::now();
    assert_eq!(deleted, 1, "the lock was not in Redis under {key}");
    let lost = lost_at(lost, 2 * lease, "taken away").await;
    told_within_a_renewal(lost, asked, lease, taken, "the key was deleted");
    assert!(g
        .held()
        .lost_signal()
        .reason()
        .unwrap()
        .contains("another owner"));
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

/// A holder's renewals fail (see [`Fault`]) while Redis stays up, and a
/// second client, connected directly, waits for the key. The holder must be
/// told before its lease can have ended, and before the other client is
/// granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_or_timed_out_renewal_is_told_before_the_lease_ends_and_anyone_else_is_granted() {
    let url = redis_url();
    let lease = Duration::from_millis(900);
    let user = format!("tower-lock-test-{}", std::process::id());
    for fault in [Fault::Silent, Fault::Cut, Fault::Refused] {
        let test = format!("cutoff-{fault:?}");
        let addr = socket_addr(&url);
        let proxy = FaultProxy::start(addr).await.unwrap();
        let holder_url = match fault {
            Fault::Refused => {
                let _: () = redis::cmd("ACL")
                    .arg(&["SETUSER", &user, "reset", "on", ">pw", "~*", "&*", "+@all"])
                    .query_async(&mut raw(&url).await)
                    .await
                    .unwrap();
                format!("redis://{user}:pw@{addr}/")
            }
            _ => format!("redis://{}/", proxy.addr()),
        };
        let holder = backend_at(&holder_url, &prefix(&test)).await;
        let other = backend(&test).await;
        let g = holder.lock("k").lease(lease).await.unwrap();
        let lost = when_lost(g.held().lost_signal());
        // A few renewals go through first.
        tokio::time::sleep(lease + lease / 4).await;
        assert!(!g.is_lost(), "{fault:?}: lost before the fault");
        let waiter = tokio::spawn(async move {
            let g = other
                .lock("k")
                .lease(lease)
                .wait(Duration::from_secs(10))
                .await;
            (Instant::now(), g)
        });
        // Every renewal Redis granted was sent before `last_sent`, so the
        // lease lasted at most until `last_sent + lease`.
        let (last_sent, why) = match fault {
            Fault::Silent => (
                proxy.set(ProxyFault::Freeze).await,
                "renewing the lease timed out",
            ),
            Fault::Cut => (proxy.set(ProxyFault::Drop).await, "renewing the lease"),
            Fault::Refused => {
                let _: () = redis::cmd("ACL")
                    .arg(&["SETUSER", &user, "-@scripting"])
                    .query_async(&mut raw(&url).await)
                    .await
                    .unwrap();
                (Some(Instant::now()), "renewing the lease failed")
            }
        };
        let last_sent = last_sent.expect("the holder's requests went through the proxy");
        let lost = lost_at(lost, 2 * lease, &format!("{fault:?}")).await;
        let (granted, g2) = waiter.await.unwrap();
        let g2 = g2.unwrap_or_else(|e| panic!("{fault:?}: Redis did not grant the key: {e}"));
        let reason = told_in_time(&g, lost, last_sent, lease, granted, &format!("{fault:?}"));
        assert!(reason.contains(why), "{fault:?}: {reason}");
        assert!(g2.token() > g.token());
        g2.release().await.unwrap();
        drop(g);
        drop(proxy);
    }
    let _: () = redis::cmd("ACL")
        .arg(&["DELUSER", &user])
        .query_async(&mut raw(&url).await)
        .await
        .unwrap();
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
    .stdin(Stdio::piped())
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
    #[cfg(feature = "redis-tls")]
    if role == "tls_lock" {
        return tls_lock_child().await;
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

#[tokio::test]
async fn excludes_between_processes() {
    let test = "procs";
    let url = redis_url();
    let log = format!("{}log", prefix(test));
    let _: () = raw(&url).await.del(&log).await.unwrap();
    let mut kids: Vec<(Child, BufReader<ChildStdout>)> = (0..2)
        .map(|_| {
            let mut c = child("worker", test, &[]);
            let out = BufReader::new(c.stdout.take().unwrap());
            (c, out)
        })
        .collect();
    for (_, out) in &mut kids {
        common::expect_word(out, "ready");
    }
    for (c, _) in &mut kids {
        writeln!(c.stdin.as_mut().unwrap(), "go").unwrap();
    }
    for (c, out) in &mut kids {
        let mut line = String::new();
        let mut overlaps = None;
        while out.read_line(&mut line).unwrap() > 0 {
            overlaps = overlaps.or_else(|| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix("overlaps="))
                    .map(str::to_owned)
            });
            line.clear();
        }
        assert_eq!(overlaps.as_deref(), Some("0"));
        assert!(c.wait().unwrap().success());
    }
    let entries: Vec<String> = raw(&url).await.lrange(&log, 0, -1).await.unwrap();
    check_two_process_log(&entries, 100);
    let _: () = raw(&url).await.del(&log).await.unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_makes_the_holder_lost_and_tokens_keep_rising() {
    // Its own server, since the test restarts it.
    let server = Server::start();
    let (port, url) = (server.port, server.url());
    let b = backend_at(&url, "restart:").await;
    let lease = Duration::from_secs(3);
    let asked = Instant::now();
    let g = b.lock("k").lease(lease).await.unwrap();
    let lost = when_lost(g.held().lost_signal());

    drop(server);
    let killed = Instant::now();
    let server = Server::start_on(port);

    let lost = lost_at(lost, 2 * lease, "restart").await;
    // The renewal that finds the failure starts at once, on the dropped
    // connection.
    told_within_a_renewal(lost, asked, lease, killed, "the server was killed");
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
        Self::start_on(free_port())
    }

    /// On `port`, as after a restart.
    fn start_on(port: u16) -> Server {
        Self::spawn(port, &["--port", &port.to_string()])
    }

    /// Serving TLS only, on a free port, with the certificate `ca` made for
    /// 127.0.0.1; clients are not asked for certificates.
    #[cfg(feature = "redis-tls")]
    fn start_tls(ca: &TestCa) -> Server {
        let port = free_port();
        let path = |name: &str| ca.path(name).to_str().unwrap().to_owned();
        Self::spawn(
            port,
            &[
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &path("server.crt"),
                "--tls-key-file",
                &path("server.key"),
                "--tls-ca-cert-file",
                &path("ca.crt"),
                "--tls-auth-clients",
                "no",
            ],
        )
    }

    /// A redis-server with `args`, once `port` takes connections.
    fn spawn(port: u16, args: &[&str]) -> Server {
        let mut child = Command::new("redis-server")
            .args(args)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run redis-server ({e}): install it with `apt-get install \
                     redis-server` (scripts/test-all.sh does, as root)"
                )
            });
        for _ in 0..100 {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("redis-server {args:?} exited at once ({status}); its error is above");
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Server { port, child };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("redis-server on port {port} did not start");
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
        ([127, 0, 0, 1], self.port).into()
    }

    /// Sends `sig` (`-STOP`, `-CONT`) to the server.
    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status();
        assert!(status.is_ok_and(|s| s.success()), "kill {sig} failed");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
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
    contend_from_two(&a, &b).await;
    assert!(matches!(
        a.lock("k").read().await,
        Err(LockError::InvalidMode(_))
    ));
    for s in &servers {
        let keys = keys_under(&s.url(), "lock:").await;
        assert_eq!(keys, ["lock:{k}:fence"], "left behind on {}", s.url());
    }
}

/// The longest one Redlock round can take: an attempt on every instance and
/// its undo, each bounded by an instance connection's timeouts (200 ms for
/// an answer; on a broken connection, two connection attempts of 200 ms
/// each and a pause of up to 200 ms between them). "At once" means within
/// one round, not after retries or the caller's wait.
const ONE_ROUND: Duration = Duration::from_millis(2 * (200 + 2 * 200 + 200));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_works_with_one_of_three_down_and_fails_at_once_with_two() {
    use tower_lock::backend::RedlockBackend;
    let wait = Duration::from_secs(10);
    // Down as a killed server (connections refused) or a stopped one
    // (connections accepted, nothing answered).
    for stop in [false, true] {
        let mut servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
        let backend = RedlockBackend::connect(&redlock_url(&servers))
            .await
            .unwrap();
        let take_down = |servers: &mut Vec<Server>| {
            let s = servers.pop().unwrap();
            if stop {
                s.signal("-STOP");
                // Kept, stopped, until the end of the round.
                servers.insert(0, s);
            }
        };
        take_down(&mut servers);
        let g = backend.lock("k").wait(wait).await.unwrap();
        g.release().await.unwrap();

        take_down(&mut servers);
        let started = Instant::now();
        let err = backend.lock("k").wait(wait).await.unwrap_err();
        let took = started.elapsed();
        let how = if stop { "stopped" } else { "killed" };
        eprintln!("{how}: failed after {took:?}");
        assert!(matches!(err, LockError::Backend { .. }), "{how}: {err}");
        assert!(
            err.to_string().contains("only 1 of 3 instances answered"),
            "{how}: {err}"
        );
        assert!(
            took < ONE_ROUND,
            "{how}: failed after {took:?} of a {wait:?} wait, not at once"
        );
    }
}

/// A round that reaches fewer than a majority is undone on every instance:
/// on the one that granted it, and on one that did not answer in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_undoes_a_failed_round_on_every_instance() {
    use tower_lock::backend::RedlockBackend;
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let backend = RedlockBackend::connect(&redlock_url(&servers))
        .await
        .unwrap();
    let (lock, fence) = ("lock:{k}", "lock:{k}:fence");
    let run = |server: &Server, cmd: redis::Cmd| {
        let url = server.url();
        async move {
            let v: redis::Value = cmd.query_async(&mut raw(&url).await).await.unwrap();
            v
        }
    };
    let held_by_someone_else = || {
        let mut c = redis::cmd("SET");
        c.arg(lock).arg("someone-else").arg("PX").arg(60_000);
        c
    };
    let exists = |key: &str| {
        let mut c = redis::cmd("EXISTS");
        c.arg(key);
        c
    };

    // Two instances held by someone else: the third grants, and the round
    // (one of three) is undone there.
    run(&servers[0], held_by_someone_else()).await;
    run(&servers[1], held_by_someone_else()).await;
    let r = backend.lock("k").fail_fast().await;
    assert!(matches!(r, Err(LockError::Busy)), "{r:?}");
    assert_eq!(
        run(&servers[2], exists(fence)).await,
        redis::Value::Int(1),
        "the free instance never granted the round"
    );
    assert_eq!(
        run(&servers[2], exists(lock)).await,
        redis::Value::Int(0),
        "the instance that granted the failed round still holds it"
    );

    // One held by someone else, one silent past the round's timeout, one
    // free: the round is undone on the free one, and on the silent one,
    // where the attempt lands once it runs again.
    run(&servers[1], redis::cmd("FLUSHALL")).await;
    run(&servers[2], redis::cmd("FLUSHALL")).await;
    servers[1].signal("-STOP");
    let r = backend.lock("k").fail_fast().await;
    servers[1].signal("-CONT");
    assert!(matches!(r, Err(LockError::Busy)), "{r:?}");
    assert_eq!(run(&servers[2], exists(fence)).await, redis::Value::Int(1));
    assert_eq!(
        run(&servers[2], exists(lock)).await,
        redis::Value::Int(0),
        "the instance that granted the failed round still holds it"
    );
    let mut landed = false;
    for _ in 0..50 {
        if run(&servers[1], exists(fence)).await == redis::Value::Int(1) {
            landed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(landed, "the attempt never reached the silent instance");
    // Undone: the key goes within moments, not at the end of its lease.
    let mut undone = false;
    for _ in 0..50 {
        if run(&servers[1], exists(lock)).await == redis::Value::Int(0) {
            undone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(undone, "the silent instance kept the failed round");
}

#[tokio::test]
async fn a_request_reenters_its_own_lock() {
    common::reenters_under_the_layer(backend("reentry").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_a_request_reenters_its_own_lock() {
    use tower_lock::backend::RedlockBackend;
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let backend = RedlockBackend::connect(&redlock_url(&servers))
        .await
        .unwrap();
    common::reenters_under_the_layer(backend).await;
}

/// An acquisition whose wait runs out while its round is still in flight
/// (two instances silent) must not leave the round behind: the silent
/// instances grant it once they run again, and without an undo the key
/// would be held by no one on a majority until the lease ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_undoes_a_round_cancelled_in_flight() {
    use tower_lock::backend::RedlockBackend;
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let url = redlock_url(&servers);
    let backend = RedlockBackend::connect(&url).await.unwrap();
    // Load the scripts on every instance, as in any running service: a
    // script the server does not know yet would not grant after the cancel.
    backend
        .lock("warm-up")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    servers[1].signal("-STOP");
    servers[2].signal("-STOP");
    // Shorter than the per-instance answer timeout: the round is in flight
    // when the wait runs out.
    let r = backend.lock("k").wait(Duration::from_millis(50)).await;
    assert!(matches!(r, Err(LockError::Timeout { .. })), "{r:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    servers[1].signal("-CONT");
    servers[2].signal("-CONT");
    backend.flush().await;
    let other = RedlockBackend::connect(&url).await.unwrap();
    let r = other.lock("k").fail_fast().await;
    assert!(
        r.is_ok(),
        "the cancelled round was left behind and holds the key: {r:?}"
    );
}

/// The holder reaches two of the three servers through proxies, and loses
/// both paths while every server stays up; a second client, connected
/// directly, waits for the key. The holder must be told before its lease
/// can have ended on a majority, and before the other client is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_holder_cut_off_from_a_majority_is_told_before_anyone_else_is_granted() {
    use tower_lock::backend::RedlockBackend;
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let proxies = [
        FaultProxy::start(servers[0].addr()).await.unwrap(),
        FaultProxy::start(servers[1].addr()).await.unwrap(),
    ];
    let holder = RedlockBackend::connect(&format!(
        "redlock://{},{},127.0.0.1:{}",
        proxies[0].addr(),
        proxies[1].addr(),
        servers[2].port
    ))
    .await
    .unwrap();
    let other = RedlockBackend::connect(&redlock_url(&servers))
        .await
        .unwrap();
    let lease = Duration::from_millis(900);
    let g = holder.lock("k").lease(lease).await.unwrap();
    let lost = when_lost(g.held().lost_signal());
    // A few renewals go through first.
    tokio::time::sleep(lease + lease / 4).await;
    assert!(!g.is_lost(), "lost before the fault");
    let waiter = tokio::spawn(async move {
        let g = other
            .lock("k")
            .lease(lease)
            .wait(Duration::from_secs(10))
            .await;
        (Instant::now(), g)
    });
    let mut last_sent = None;
    for p in &proxies {
        let sent = p
            .set(ProxyFault::Freeze)
            .await
            .expect("no request through the proxy");
        last_sent = last_sent.max(Some(sent));
    }
    let last_sent = last_sent.unwrap();
    let lost = lost_at(lost, 2 * lease, "redlock").await;
    let (granted, g2) = waiter.await.unwrap();
    let g2 = g2.unwrap_or_else(|e| panic!("the servers did not grant the key: {e}"));
    // A renewal a majority granted reached one of the two cut-off servers,
    // so it was sent before `last_sent`.
    let reason = told_in_time(&g, lost, last_sent, lease, granted, "redlock");
    assert!(reason.contains("majority"), "{reason}");
    g2.release().await.unwrap();
    drop(g);
}

// ---- TLS ------------------------------------------------------------------

/// A throw-away CA and a server certificate it signed for 127.0.0.1, made
/// with `openssl` in a directory of their own, removed when dropped.
#[cfg(feature = "redis-tls")]
struct TestCa {
    dir: std::path::PathBuf,
}

#[cfg(feature = "redis-tls")]
impl TestCa {
    fn new() -> TestCa {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-tls-{}-{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ca = TestCa { dir };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        ca.openssl(&[
            &["req", "-x509"],
            &ec,
            &["-days", "1", "-subj", "/CN=tower-lock test CA"],
            &["-keyout", "ca.key", "-out", "ca.crt"],
        ]);
        ca.openssl(&[
            &["req"],
            &ec,
            &[
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]);
        std::fs::write(
            ca.path("server.ext"),
            "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        ca.openssl(&[&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "server.ext",
            "-out",
            "server.crt",
        ]]);
        ca
    }

    fn openssl(&self, args: &[&[&str]]) {
        let args = args.concat();
        let out = Command::new("openssl")
            .args(&args)
            .current_dir(&self.dir)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run openssl ({e}), which makes the TLS tests' certificates: install \
                     it with `apt-get install openssl` (scripts/test-all.sh does, as root)"
                )
            });
        assert!(
            out.status.success(),
            "openssl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name)
    }

    /// The CA certificate, PEM.
    fn pem(&self) -> Vec<u8> {
        std::fs::read(self.path("ca.crt")).unwrap()
    }
}

#[cfg(feature = "redis-tls")]
impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Takes `k` with `a`, checks `b` is refused it meanwhile, releases it and
/// takes it with `b`.
#[cfg(feature = "redis-tls")]
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

async fn excludes_and_releases(a: &impl Backend, b: &impl Backend) {
    let g = a.lock("k").await.unwrap();
    assert!(
        matches!(b.lock("k").fail_fast().await, Err(LockError::Busy)),
        "a second holder"
    );
    g.release().await.unwrap();
    b.lock("k")
        .fail_fast()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rediss_trusting_a_private_ca_locks_exclude_and_release() {
    let ca = TestCa::new();
    let server = Server::start_tls(&ca);
    let url = server.tls_url();
    let options = || {
        RedisOptions::default()
            .prefix("tls:")
            .tls_root_certificate(ca.pem())
    };
    let a = RedisBackend::connect_with(&url, options()).await.unwrap();
    let b = RedisBackend::connect_with(&url, options()).await.unwrap();
    excludes_and_releases(&a, &b).await;
    // Contended from two backends: one holder at a time, tokens rising.
    contend_from_two(&a, &b).await;
    // Released in Redis: only the fencing counter is left.
    let keys = keys_under(&format!("{url}#insecure"), "tls:").await;
    assert_eq!(keys, ["tls:{k}:fence"]);
}

#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn rediss_refuses_a_certificate_it_cannot_verify_unless_insecure() {
    let ca = TestCa::new();
    let server = Server::start_tls(&ca);
    let url = server.tls_url();
    let other = TestCa::new();
    // Neither the system's trust store nor another CA vouch for the server.
    for options in [
        RedisOptions::default(),
        RedisOptions::default().tls_root_certificate(other.pem()),
    ] {
        let started = Instant::now();
        let err = RedisBackend::connect_with(&url, options).await.unwrap_err();
        let took = started.elapsed();
        assert!(matches!(err, LockError::Backend { .. }), "{err}");
        assert!(
            err.to_string().contains("certificate verify failed"),
            "{err}"
        );
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
    // `#insecure` checks nothing, and works.
    let insecure = format!("{url}#insecure");
    let a = RedisBackend::connect(&insecure).await.unwrap();
    let b = tower_lock::backend::connect(&insecure).await.unwrap();
    excludes_and_releases(&a, &b).await;
    // A root certificate that is not one, or one given for a plain URL.
    for (url, pem) in [
        (url.as_str(), b"not a certificate".to_vec()),
        (&server.url(), ca.pem()),
    ] {
        let options = RedisOptions::default().tls_root_certificate(pem);
        let err = RedisBackend::connect_with(url, options).await.unwrap_err();
        assert!(matches!(err, LockError::Config(_)), "{url}: {err}");
    }
}

#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn a_plain_url_to_a_tls_port_fails_clearly_within_the_timeout() {
    let ca = TestCa::new();
    let tls = Server::start_tls(&ca);
    let plain = Server::start();
    let timeout = Duration::from_secs(1);
    let options = || {
        RedisOptions::default()
            .connect_timeout(timeout)
            .response_timeout(timeout)
    };
    for (url, options, hint) in [
        (tls.url(), options(), "if it expects TLS, use rediss://"),
        // And the other way round: TLS to a server that does not speak it.
        (
            plain.tls_url(),
            options().tls_root_certificate(ca.pem()),
            "if the server does not speak TLS, use redis://",
        ),
    ] {
        let started = Instant::now();
        let err = RedisBackend::connect_with(&url, options).await.unwrap_err();
        let took = started.elapsed();
        eprintln!("{url}: {err} (after {took:?})");
        assert!(matches!(err, LockError::Backend { .. }), "{url}: {err}");
        assert!(err.to_string().contains(&url), "{url}: {err}");
        assert!(err.to_string().contains(hint), "{url}: {err}");
        // One try and two retries of the connection manager, at most.
        assert!(took < 4 * timeout, "{url}: took {took:?}: {err}");
    }
}

#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlocks_locks_over_tls_and_checks_certificates() {
    use tower_lock::backend::RedlockBackend;
    let ca = TestCa::new();
    let servers: Vec<Server> = (0..3).map(|_| Server::start_tls(&ca)).collect();
    let list = redlock_url(&servers).replace("redlock://", "");
    let insecure = format!("redlocks://{list}#insecure");
    let a = RedlockBackend::connect(&insecure).await.unwrap();
    let b = RedlockBackend::connect(&insecure).await.unwrap();
    excludes_and_releases(&a, &b).await;
    // Checked against the system's trust store, which lacks the test CA;
    // and plain connections to TLS ports: no instance answers.
    for url in [format!("redlocks://{list}"), format!("redlock://{list}")] {
        let b = RedlockBackend::connect(&url).await.unwrap();
        let err = b.lock("k").fail_fast().await.unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{url}: {err}");
    }
    assert!(matches!(
        RedlockBackend::connect(&format!("redlock://{list}#insecure")).await,
        Err(LockError::Config(_))
    ));
    // The test CA trusted through OpenSSL's SSL_CERT_FILE, read once per
    // process: in a child, through `backend::connect`.
    let urls = [format!("redlocks://{list}"), servers[0].tls_url()];
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TOWER_LOCK_CHILD", "tls_lock")
        .env("TOWER_LOCK_TLS_URLS", urls.join(" "))
        .env("SSL_CERT_FILE", ca.path("ca.crt"))
        .env_remove("SSL_CERT_DIR")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for url in &urls {
        assert!(stdout.contains(&format!("locked {url}")), "{url}: {stdout}");
    }
}

/// The child of the test above: takes and releases a lock through every URL
/// of `TOWER_LOCK_TLS_URLS`.
#[cfg(feature = "redis-tls")]
async fn tls_lock_child() {
    let urls = std::env::var("TOWER_LOCK_TLS_URLS").unwrap();
    for url in urls.split(' ') {
        let b = tower_lock::backend::connect(url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        let g = b
            .lock("k")
            .fail_fast()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        g.release().await.unwrap();
        println!("locked {url}");
    }
}

#[cfg(not(feature = "redis-tls"))]
#[tokio::test]
async fn without_the_redis_tls_feature_a_tls_url_is_a_config_error_naming_it() {
    use tower_lock::backend::RedlockBackend;
    let names_the_feature = |url: &str, err: LockError| match err {
        LockError::Config(m) if m.contains("`redis-tls` feature") => {}
        other => panic!("{url}: {other}"),
    };
    let rediss = "rediss://127.0.0.1:6379/";
    let redlocks = "redlocks://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3";
    names_the_feature(rediss, RedisBackend::connect(rediss).await.unwrap_err());
    names_the_feature(
        redlocks,
        RedlockBackend::connect(redlocks).await.unwrap_err(),
    );
    for url in [rediss, redlocks] {
        names_the_feature(url, tower_lock::backend::connect(url).await.err().unwrap());
    }
}
