//! The Redis backend under Sentinel: a master, two replicas and three
//! Sentinels that each test starts on loopback (`tests/common/sentinel.rs`),
//! so that it can kill the master and cut replication.

mod common;

use std::time::{Duration, Instant};

use common::sentinel::SentinelGroup;
use tower_lock::backend::redis::{RedisBackend, RedisOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError};

fn options() -> RedisOptions {
    RedisOptions::default().cohort(CohortOptions::off())
}

async fn backend(url: &str, options: RedisOptions) -> RedisBackend {
    RedisBackend::connect_with(url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect through the Sentinels at {url}: {e}"))
}

/// The lock keys left on the Redis server `port` (fencing counters aside).
async fn lock_keys(group: &SentinelGroup, port: u16) -> Vec<String> {
    let mut conn = group.redis_conn(port).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("lock:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    keys.into_iter()
        .filter(|k| !k.ends_with(":fence"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_follows_the_master_through_a_failover() {
    let mut group = SentinelGroup::start("follows").await;
    let b = backend(&group.url(""), options()).await;
    let g = b.lock("k").await.unwrap();
    let first = g.token();
    g.release().await.unwrap();
    let old = group.redis[0];
    group.kill_redis(0);
    let new = group.failed_over_from(old).await;
    let g = common::lock_after_failover(&b, "k").await;
    assert!(g.token() > first, "tokens rise across the failover");
    assert_eq!(
        lock_keys(&group, new).await.len(),
        1,
        "held on the new master"
    );
    g.release().await.unwrap();
    b.flush().await;
    assert!(
        lock_keys(&group, new).await.is_empty(),
        "released there too"
    );
}

/// Replication is asynchronous: a lock the replicas never received is gone
/// after a failover, and the next client is granted it while its holder
/// still counts on it. The holder is told at its next renewal, and its
/// fencing token is below the new holder's (the new master's config epoch
/// is in the token), so a fenced store refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_loses_an_unreplicated_lock_and_its_token_is_refusable() {
    let mut group = SentinelGroup::start("loses").await;
    let url = group.url("");
    let (a, b) = (
        backend(&url, options()).await,
        backend(&url, options()).await,
    );
    // The key's fencing counter reaches the replicas; the increments made
    // while replication is cut do not.
    a.lock("k").await.unwrap().release().await.unwrap();
    // Stopped, and their links closed by the master: a stopped replica
    // would still find in its socket whatever the master sent before dying.
    group.signal_replicas("STOP");
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut group.redis_conn(group.redis[0]).await)
        .await
        .unwrap();
    for _ in 0..3 {
        a.lock("k").await.unwrap().release().await.unwrap();
    }
    let held = a
        .lock("k")
        .lease(Duration::from_secs(20))
        .await
        .expect("the master grants without its replicas");
    let old = group.redis[0];
    group.kill_redis(0);
    // Running again, the replicas have what they had when stopped.
    group.signal_replicas("CONT");
    group.failed_over_from(old).await;
    let other = common::lock_after_failover(&b, "k").await;
    assert!(
        other.token() > held.token(),
        "the new holder's token {} must exceed the lost one's {}",
        other.token().get(),
        held.token().get()
    );
    // Above whatever the replaced master could still hand out: the
    // failover's config epoch is in the token's high part.
    let epoch = group.config_epoch(0).await.expect("Sentinel 0 answers");
    assert!(epoch > 0, "a failover raises the config epoch");
    assert!(
        other.token().get() > held.token().get() + (epoch << 36),
        "the new holder's token {} carries the config epoch {epoch} (the lost one's: {})",
        other.token().get(),
        held.token().get()
    );
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder whose lock the failover lost was not told");
    drop(held);
    other.release().await.unwrap();
}

/// With `wait_for_replicas`, a lock the replicas do not acknowledge is
/// refused (and released), so a failover cannot lose it; a lock they do
/// acknowledge stays taken on the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_replicas_refuses_what_a_failover_could_lose() {
    let mut group = SentinelGroup::start("waits").await;
    let url = group.url("?wait_replicas=2&wait_timeout_ms=200");
    let a = backend(&url, options()).await;
    let b = backend(&group.url(""), options()).await;
    group.signal_replicas("STOP");
    match a.lock("cut").fail_fast().await {
        Err(LockError::Backend { .. }) => {}
        other => panic!("expected a refusal naming the replicas, got {other:?}"),
    }
    a.flush().await;
    assert!(
        lock_keys(&group, group.redis[0]).await.is_empty(),
        "the refused lock was released"
    );
    group.signal_replicas("CONT");
    // Refused until both replicas have caught up (one may reconnect).
    let deadline = Instant::now() + Duration::from_secs(20);
    let held = loop {
        match a.lock("kept").lease(Duration::from_secs(30)).await {
            Ok(held) => break held,
            Err(LockError::Backend { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("both replicas acknowledge once replication flows: {e}"),
        }
    };
    let old = group.redis[0];
    group.kill_redis(0);
    group.failed_over_from(old).await;
    // The new master has the lock: nobody else gets it.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match b.lock("kept").fail_fast().await {
            Err(LockError::Busy) => break,
            Ok(g) => panic!("the failover lost an acknowledged lock: {:?}", g.token()),
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "no answer after the failover: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    drop(held);
    a.flush().await;
}

/// One Sentinel that answers while the others do not may be the one cut
/// off from a failover the others made: a majority must answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_of_sentinels_is_not_trusted() {
    let group = SentinelGroup::start("minority").await;
    group.signal_sentinel(1, "STOP");
    group.signal_sentinel(2, "STOP");
    let started = Instant::now();
    let refused = RedisBackend::connect_with(&group.url(""), options()).await;
    let waited = started.elapsed();
    group.signal_sentinel(1, "CONT");
    group.signal_sentinel(2, "CONT");
    match refused {
        Err(LockError::Backend { message, .. }) => {
            assert!(message.contains("1 of 3 Sentinels"), "{message}")
        }
        Err(e) => panic!("refused, but not for want of a majority: {e}"),
        Ok(_) => panic!("connected on the word of 1 Sentinel of 3"),
    }
    assert!(waited < Duration::from_secs(5), "refused after {waited:?}");
    let b = backend(&group.url(""), options()).await;
    b.lock("k").await.unwrap().release().await.unwrap();
}

/// The Sentinel the backend listens to for master switches is pinged: when
/// it stops answering (here paused), the backend listens to another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_sentinel_is_not_listened_to() {
    let group = SentinelGroup::start("silent").await;
    let b = backend(&group.url(""), options()).await;
    let listened = wait_for_subscriber(&group, None).await;
    group.signal_sentinel(listened, "STOP");
    let started = Instant::now();
    let now_listened = wait_for_subscriber(&group, Some(listened)).await;
    group.signal_sentinel(listened, "CONT");
    assert_ne!(now_listened, listened);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "moved after {:?}",
        started.elapsed()
    );
    b.lock("k").await.unwrap().release().await.unwrap();
}

/// The Sentinel, other than `not`, with a subscriber, within 10 s.
async fn wait_for_subscriber(group: &SentinelGroup, not: Option<usize>) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for i in (0..3).filter(|i| Some(*i) != not) {
            if group.has_subscriber(i).await == Some(true) {
                return i;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no Sentinel but {not:?} has the backend's subscription after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A failed command sends the backend to the Sentinels (the master may
/// have moved), but a master that fails every command does not make it ask
/// them on every command: the asks are spaced out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_failing_in_a_row_do_not_flood_the_sentinels() {
    let group = SentinelGroup::start("paced").await;
    let b = backend(&group.url(""), options()).await;
    b.lock("k").await.unwrap().release().await.unwrap();
    let mut master = group.redis_conn(group.redis[0]).await;
    let acl = |rule: &str| {
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg("default").arg(rule);
        cmd
    };
    // Every lock script now fails (NOPERM), on the same master.
    let _: () = acl("-@scripting").query_async(&mut master).await.unwrap();
    let before: u64 = group.connections_received(0).await;
    let started = Instant::now();
    let mut failed = 0;
    while started.elapsed() < Duration::from_secs(3) {
        match b.lock("k").fail_fast().await {
            Err(LockError::Backend { .. }) => failed += 1,
            other => panic!("a lock script ran without EVAL rights: {other:?}"),
        }
    }
    let asked = group.connections_received(0).await - before;
    let _: () = acl("+@scripting").query_async(&mut master).await.unwrap();
    assert!(failed >= 5, "{failed} failures");
    assert!(
        asked <= 40,
        "{asked} connections to a Sentinel for {failed} failed commands in 3 s"
    );
    let g = b.lock("k").wait(Duration::from_secs(5)).await.unwrap();
    g.release().await.unwrap();
}

#[tokio::test]
async fn sentinel_urls_are_checked_and_unreachable_sentinels_fail_in_time() {
    for bad in [
        "redis+sentinel://127.0.0.1:1",
        "redis+sentinel://127.0.0.1/m",
        "redis+sentinel://127.0.0.1:1/m?wait_replicas=two",
        // WAIT n 0 would wait forever.
        "redis+sentinel://127.0.0.1:1/m?wait_replicas=1&wait_timeout_ms=0",
        "redis+sentinel://127.0.0.1:1/m?wait_replicas=1&wait_timeout_ms=5000",
    ] {
        assert!(
            matches!(RedisBackend::connect(bad).await, Err(LockError::Config(_))),
            "{bad}"
        );
    }
    let port = common::free_port();
    let started = Instant::now();
    let unreachable = RedisBackend::connect(&format!("redis+sentinel://127.0.0.1:{port}/m")).await;
    assert!(matches!(unreachable, Err(LockError::Backend { .. })));
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Dropped, the backend leaves no task running: not the master follower,
/// not its Sentinel connection, not the connections' own tasks.
#[tokio::test]
async fn a_dropped_backend_leaves_no_task_behind() {
    let group = SentinelGroup::start("tasks").await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let b = backend(&group.url(""), options()).await;
    b.lock("k").await.unwrap().release().await.unwrap();
    assert!(metrics.num_alive_tasks() > before);
    drop(b);
    common::no_task_left_after(before).await;
}

/// The backend through the Sentinels of a group of its test's own, with or
/// without cohorting.
struct ThroughSentinels<'a> {
    group: &'a SentinelGroup,
    cohort: bool,
}

impl common::contract::Subject for ThroughSentinels<'_> {
    type Backend = RedisBackend;

    async fn connect(&self, _test: &str) -> RedisBackend {
        let options = RedisOptions::default().cohort(common::contract::cohort(self.cohort));
        backend(&self.group.url(""), options).await
    }

    /// The master's address comes from the Sentinels: there is no one link
    /// to cut (the failover tests stop the master instead).
    async fn connect_through_proxy(
        &self,
        _test: &str,
    ) -> Option<(Vec<common::fault_proxy::FaultProxy>, RedisBackend)> {
        None
    }

    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    /// As on one server: no share without a cohort (redis/conformance.rs).
    fn takes_turns_across_processes(&self) -> bool {
        self.cohort
    }

    async fn assert_nothing_left(&self, _test: &str, _keys: &[String]) {
        common::contract::until_nothing_left("lock keys", || async {
            let mut left = Vec::new();
            for &port in &self.group.redis {
                left.extend(lock_keys(self.group, port).await);
            }
            left
        })
        .await;
    }
}

/// The conformance suite through the Sentinels, with cohorting and
/// without.
#[test]
fn conformance_with_cohorting_on_and_off() {
    common::contract::on_servers_of_its_own(
        SentinelGroup::start("conformance"),
        |group, cohort| common::contract::every_contract_test(&ThroughSentinels { group, cohort }),
    );
}

/// Through Sentinel an acquisition confirms the master, which a release
/// cannot do for it: a release names the first waiter instead of granting
/// it the lock, and the free lock is that waiter's for its turn (100 ms).
/// A named waiter that never comes (its task is stuck) holds it back no
/// longer: the waiter behind, told as well, takes it well within its wait
/// of 600 ms. Granted the lock for its lease (up to 3 s), the stuck waiter
/// would hold it past that wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_waiter_that_does_not_come_holds_the_lock_back_only_for_its_turn() {
    let group = SentinelGroup::start("stuck").await;
    let url = group.url("");
    let (holder, stuck, patient) = (
        backend(&url, RedisOptions::default()).await,
        backend(&url, RedisOptions::default()).await,
        backend(&url, RedisOptions::default()).await,
    );
    let master = group.redis[0];
    let queued = |n: usize| {
        let group = &group;
        async move {
            let mut conn = group.redis_conn(master).await;
            for _ in 0..100 {
                let waiting: usize = redis::cmd("ZCARD")
                    .arg("lock:{k}:queue")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                if waiting == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("the queue did not get {n} waiters");
        }
    };
    let held = holder
        .lock("k")
        .lease(Duration::from_secs(30))
        .await
        .unwrap();
    // Queued first, then never polled again.
    let mut forgotten = Box::pin(std::future::IntoFuture::into_future(
        stuck.lock("k").wait(Duration::from_secs(30)),
    ));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut forgotten)
            .await
            .is_err()
    );
    queued(1).await;
    let next = {
        let patient = patient.clone();
        tokio::spawn(async move { patient.lock("k").wait(Duration::from_millis(600)).await })
    };
    queued(2).await;
    held.release().await.unwrap();
    next.await
        .unwrap()
        .expect("the waiter behind took the lock")
        .release()
        .await
        .unwrap();
    drop(forgotten);
    for backend in [&holder, &stuck, &patient] {
        backend.flush().await;
    }
    assert!(lock_keys(&group, master).await.is_empty(), "nothing left");
}
