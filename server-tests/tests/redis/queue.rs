//! The queue of an exclusive lock: waiters in different processes take it
//! in the order they asked, a release wakes only the next one's process,
//! and one that gives up leaves no place behind.

use super::*;

/// A waiter in its own process (backend) on `key`: records its turn in
/// `order`, holds for `hold`, releases.
pub(super) fn waiter<B: Backend + Clone>(
    b: &B,
    key: &str,
    name: &'static str,
    order: &Arc<Mutex<Vec<&'static str>>>,
    hold: Duration,
) -> tokio::task::JoinHandle<()> {
    let (b, key, order) = (b.clone(), key.to_owned(), order.clone());
    tokio::spawn(async move {
        let g = b
            .lock(key.as_str())
            .wait(Duration::from_secs(10))
            .await
            .unwrap();
        order.lock().unwrap().push(name);
        tokio::time::sleep(hold).await;
        g.release().await.unwrap();
    })
}

/// How long each waiter of the order test holds the lock.
pub(super) const HOLD: Duration = Duration::from_millis(5);

/// Without a queue every waiter woken by a release asks at once and the
/// fastest wins: three waiters would come out in their order by chance
/// one round in six.
#[tokio::test]
async fn waiters_in_different_processes_take_the_lock_in_the_order_they_asked() {
    let test = "fifo";
    let holder = backend(test).await;
    let (a, b, c) = (
        backend(test).await,
        backend(test).await,
        backend(test).await,
    );
    for round in 0..5 {
        let key = format!("k{round}");
        let held = holder.lock(key.as_str()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let first = waiter(&c, &key, "c", &order, HOLD);
        queued(test, &key, 1).await;
        let second = waiter(&a, &key, "a", &order, HOLD);
        queued(test, &key, 2).await;
        let third = waiter(&b, &key, "b", &order, HOLD);
        queued(test, &key, 3).await;
        held.release().await.unwrap();
        for w in [first, second, third] {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["c", "a", "b"], "round {round}");
    }
    for backend in [&holder, &a, &b, &c] {
        backend.flush().await;
    }
    no_queue_left(test).await;
}

/// A waiter that gives up before its turn leaves the queue: a release then
/// names the one behind it, which takes the lock.
#[tokio::test]
async fn a_waiter_that_gives_up_leaves_the_queue_to_the_next() {
    let test = "gives-up";
    let (holder, quitter, patient) = (
        backend(test).await,
        backend(test).await,
        backend(test).await,
    );
    let queue = format!("{}{{k}}:queue", prefix(test));
    let held = holder.lock("k").await.unwrap();
    let gave_up = {
        let quitter = quitter.clone();
        tokio::spawn(async move { quitter.lock("k").wait(Duration::from_millis(300)).await })
    };
    queued(test, "k", 1).await;
    let next = {
        let patient = patient.clone();
        tokio::spawn(async move { patient.lock("k").wait(Duration::from_secs(10)).await })
    };
    queued(test, "k", 2).await;
    let mut conn = raw(&redis_url()).await;
    let waiting: Vec<String> = conn.zrange(&queue, 0, -1).await.unwrap();
    assert_eq!(waiting.len(), 2, "both waiters queued: {waiting:?}");
    assert!(matches!(
        gave_up.await.unwrap(),
        Err(LockError::Timeout { .. })
    ));
    quitter.flush().await;
    let waiting: Vec<String> = conn.zrange(&queue, 0, -1).await.unwrap();
    assert_eq!(waiting.len(), 1, "the one that gave up left: {waiting:?}");
    held.release().await.unwrap();
    next.await.unwrap().unwrap().release().await.unwrap();
    for backend in [&holder, &quitter, &patient] {
        backend.flush().await;
    }
    no_queue_left(test).await;
}

/// A release grants the lock to the first waiter in its own script, with
/// the waiter's fencing tokens: the key is the waiter's as the release
/// answers, before the waiter's process has heard of it, for no longer
/// than the waiter's place lives (3 s), and the waiter holds it with no
/// acquire of its own. Named only, the lock would be free until the
/// waiter came to take it.
#[tokio::test]
async fn a_release_grants_the_lock_to_the_first_waiter_directly() {
    let test = "direct";
    let (holder, waiter) = (backend(test).await, backend(test).await);
    let lock = format!("{}{{k}}", prefix(test));
    let mut conn = raw(&redis_url()).await;
    for round in 0..3 {
        let held = holder.lock("k").await.unwrap();
        let before = held.token();
        let next = {
            let waiter = waiter.clone();
            tokio::spawn(async move { waiter.lock("k").wait(Duration::from_secs(10)).await })
        };
        settled(&redis_url(), &lock).await;
        held.release().await.unwrap();
        let owner: Option<String> = conn.get(&lock).await.unwrap();
        let left: i64 = conn.pttl(&lock).await.unwrap();
        assert!(
            owner.is_some(),
            "round {round}: the release left the lock free for the waiter to take"
        );
        assert!(
            (1..=3000).contains(&left),
            "round {round}: granted for {left} ms, not at most the place's 3 s"
        );
        let g = next.await.unwrap().unwrap();
        assert!(
            g.token() > before,
            "round {round}: {} after {before}",
            g.token()
        );
        assert!(!g.is_lost(), "round {round}: the grant is not held");
        g.release().await.unwrap();
        let owner: Option<String> = conn.get(&lock).await.unwrap();
        assert_eq!(owner, None, "round {round}: the waiter's release freed it");
    }
    for backend in [&holder, &waiter] {
        backend.flush().await;
    }
    no_queue_left(test).await;
}

/// What a hand-off between processes costs the server, a count that does
/// not drift: one script, the holder's release, which grants the lock to
/// the waiter (`GET` and `EXISTS`: the holder's and a queue; `TIME`;
/// `ZPOPMIN`, `ZSCORE`, `ZREM` and `HGET`, `HDEL`: the waiter's place and
/// terms; `SET` of the lock and `SET … GET` of the fence; `PUBLISH`), and
/// nothing from the waiter, which holds the lock as it hears. Every
/// command a script runs costs the server several times the command
/// itself, and this script runs before the next holder hears.
#[tokio::test]
async fn a_hand_off_costs_the_server_one_release_script_of_eleven_commands() {
    let server = Server::start();
    let (holder, waiter) = (
        backend_at(&server.url(), "lock:").await,
        backend_at(&server.url(), "lock:").await,
    );
    let mut conn = raw(&server.url()).await;
    // The scripts loaded, the fence in place.
    holder.lock("k").await.unwrap().release().await.unwrap();
    let held = holder.lock("k").await.unwrap();
    let next = tokio::spawn(async move { waiter.lock("k").wait(Duration::from_secs(10)).await });
    settled(&server.url(), "lock:{k}").await;
    count_commands(&mut conn).await;
    held.release().await.unwrap();
    let g = next.await.unwrap().unwrap();
    let (run, stats) = commands_run(&mut conn).await;
    g.release().await.unwrap();
    let expected = calls(&[
        ("evalsha", 1),
        ("exists", 1),
        ("get", 1),
        ("hdel", 1),
        ("hget", 1),
        ("publish", 1),
        ("set", 2),
        ("time", 1),
        ("zpopmin", 1),
        ("zrem", 1),
        ("zscore", 1),
    ]);
    assert_eq!(run, expected, "{stats}");
}

/// A release grants the lock to a waiter that never comes (its task is
/// stuck): it holds the lock back no longer than its grant's lease (its
/// own, 300 ms here: at most its place's 3 s), and the waiter behind takes
/// it then, within its wait of 2 s; left to look when the holder's lease
/// of 30 s would end, it would give up first. Once the stuck waiter is
/// dropped, its grant is released at once, as a holder's lock is.
#[tokio::test]
async fn a_granted_waiter_that_does_not_come_holds_the_lock_back_only_for_its_grant() {
    let test = "stuck";
    let (holder, stuck, patient) = (
        backend(test).await,
        backend(test).await,
        backend(test).await,
    );
    for (round, drop_it) in [false, true].into_iter().enumerate() {
        let held = holder
            .lock("k")
            .lease(Duration::from_secs(30))
            .await
            .unwrap();
        // Queued first, then never polled again.
        let lease = match drop_it {
            false => Duration::from_millis(300),
            true => Duration::from_secs(10),
        };
        let mut forgotten = Box::pin(std::future::IntoFuture::into_future(
            stuck.lock("k").lease(lease).wait(Duration::from_secs(30)),
        ));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut forgotten)
                .await
                .is_err()
        );
        queued(test, "k", 1).await;
        let wait = match drop_it {
            false => Duration::from_secs(2),
            // Under the grant's 3 s: only its release frees the lock in time.
            true => Duration::from_millis(1500),
        };
        let next = {
            let patient = patient.clone();
            tokio::spawn(async move { patient.lock("k").wait(wait).await })
        };
        queued(test, "k", 2).await;
        held.release().await.unwrap();
        if drop_it {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(forgotten);
            stuck.flush().await;
        }
        next.await
            .unwrap()
            .unwrap_or_else(|e| {
                panic!("round {round}: the waiter behind did not take the lock: {e}")
            })
            .release()
            .await
            .unwrap();
    }
    for backend in [&holder, &stuck, &patient] {
        backend.flush().await;
    }
    no_queue_left(test).await;
}

/// What a release and the time after it do, in one step: the waiter is
/// granted the lock (key and fence set, the grant sent, as `hand_on` does),
/// its grant runs out unheard, the fencing counter is lost (`ARGV[3]`:
/// `lose`) or not, and a redis-py client takes the free key.
const GRANT_THEN_LOSE: &str = r#"
local c = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('SET', KEYS[2], string.format('%.0f', c + 1), 'PX', 86400000)
redis.call('PUBLISH', ARGV[2], 'releaser ' .. ARGV[1] .. ' ' .. string.format('%.0f', c + 1) .. ' 1')
if ARGV[3] == 'lose' then redis.call('DEL', KEYS[2]) end
redis.call('SET', KEYS[1], 'py-token', 'PX', 30000)
return 1
"#;

/// A grant the waiter heard too late to take (600 ms after its last look,
/// for a lease of 300 ms) is not taken later either: its next attempt
/// finds the key held by redis-py (which draws no fencing token), and a
/// wake after that answer must not make the old grant good, whether the
/// key's fencing counter survived or was lost (a restart without
/// persistence), when only its place in the clock tells grants apart.
/// Found by review: the waiter returned a lock redis-py held.
#[tokio::test]
async fn a_grant_heard_too_late_is_not_taken_after_a_busy_answer() {
    for lose in [false, true] {
        let test = if lose { "late-lost" } else { "late-kept" };
        let base = format!("{}{{k}}", prefix(test));
        let key = |suffix: &str| format!("{base}{suffix}");
        let mut conn = raw(&redis_url()).await;
        let (holder, waiter) = (backend(test).await, backend(test).await);
        let held = holder
            .lock("k")
            .lease(Duration::from_secs(30))
            .await
            .unwrap();
        let mut next = {
            let waiter = waiter.clone();
            tokio::spawn(async move {
                waiter
                    .lock("k")
                    .lease(Duration::from_millis(300))
                    .wait(Duration::from_secs(10))
                    .await
            })
        };
        queued(test, "k", 1).await;
        let token: String = conn
            .zrange::<_, Vec<String>>(key(":queue"), 0, 0)
            .await
            .unwrap()[0]
            .clone();
        let channel = format!("{base}:rel:{}", &token[..16]);
        // Right after one of its looks (each moves its place on), then
        // 600 ms: with a grant of 300 ms, too late to take.
        let place: Option<f64> = conn.zscore(key(":places"), &token).await.unwrap();
        for _ in 0..1500 {
            let now: Option<f64> = conn.zscore(key(":places"), &token).await.unwrap();
            if now != place {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
        let _: i64 = redis::cmd("EVAL")
            .arg(GRANT_THEN_LOSE)
            .arg(5)
            .arg(&base)
            .arg(key(":fence"))
            .arg(key(":queue"))
            .arg(key(":places"))
            .arg(key(":grants"))
            .arg(&token)
            .arg(&channel)
            .arg(if lose { "lose" } else { "keep" })
            .query_async(&mut conn)
            .await
            .unwrap();
        // Its next look finds redis-py's key and queues it again; then a
        // message for nobody here wakes it.
        for _ in 0..1000 {
            let again: Option<f64> = conn.zscore(key(":queue"), &token).await.unwrap();
            if again.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _: i64 = conn.publish(&channel, "x nobody").await.unwrap();
        let out = tokio::time::timeout(Duration::from_millis(500), &mut next).await;
        let owner: Option<String> = conn.get(&base).await.unwrap();
        if let Ok(taken) = out {
            let g = taken.unwrap();
            panic!(
                "{test}: the waiter came out with {:?} while the key is {owner:?}'s",
                g.map(|g| g.token())
            );
        }
        next.abort();
        drop(held);
        let _: i64 = conn.del(&base).await.unwrap();
        for backend in [&holder, &waiter] {
            backend.flush().await;
        }
    }
}

/// A broken lock goes to the first waiter of its queue at once, as a
/// released one does: within its wait of 600 ms, where looking when the
/// broken holder's lease of 30 s would end comes after a second.
#[tokio::test]
async fn a_broken_lock_goes_to_the_first_waiter() {
    let test = "broken";
    let (holder, waiter) = (backend(test).await, backend(test).await);
    let held = holder
        .lock("k")
        .lease(Duration::from_secs(30))
        .await
        .unwrap();
    let next = {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.lock("k").wait(Duration::from_millis(600)).await })
    };
    queued(test, "k", 1).await;
    holder
        .break_lock(
            LockKey::new("k").unwrap(),
            tower_lock::backend::BreakScope::LocksOnly,
        )
        .await
        .unwrap();
    next.await
        .unwrap()
        .expect("the waiter took the broken lock")
        .release()
        .await
        .unwrap();
    drop(held);
    for backend in [&holder, &waiter] {
        backend.flush().await;
    }
    no_queue_left(test).await;
}

/// A break of a key never locked (its fencing counter new) frees nothing
/// and raises the counter: the next grant's token is above it.
#[tokio::test]
async fn a_break_of_a_key_never_locked_raises_its_fence() {
    let test = "break-new";
    let backend = backend(test).await;
    let key = format!("k-{}", std::process::id());
    let broken = backend
        .break_lock(
            LockKey::new(key.as_str()).unwrap(),
            tower_lock::backend::BreakScope::LocksOnly,
        )
        .await
        .expect("a break of a key with no fencing counter yet");
    assert!(broken.holders.is_empty());
    let held = backend.lock(key.as_str()).await.unwrap();
    assert!(held.token() >= broken.floor);
    held.release().await.unwrap();
    backend.flush().await;
    no_queue_left(test).await;
}

/// Waits until `key`'s queue holds `n` waiters; fails the test if it has
/// not within two seconds.
pub(super) async fn queued(test: &str, key: &str, n: usize) {
    let queue = format!("{}{{{key}}}:queue", prefix(test));
    queued_at(&redis_url(), &queue, n).await
}

/// [`queued`] for the queue named `queue` on the server at `url`.
async fn queued_at(url: &str, queue: &str, n: usize) {
    let mut conn = raw(url).await;
    for _ in 0..100 {
        let waiting: usize = conn.zcard(queue).await.unwrap();
        if waiting == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{queue} did not get {n} waiters");
}

/// Waits until the one waiter of `lock` (a full key name) on the server
/// at `url` has settled: queued, listening on its process's channel, and
/// past the attempt it makes once it listens (a release published before
/// it listened would be missed otherwise). A release before that attempt
/// would race it: the attempt then finds the lock granted to its token and
/// takes it again, for the whole lease.
async fn settled(url: &str, lock: &str) {
    queued_at(url, &format!("{lock}:queue"), 1).await;
    listening_at(url, &format!("{lock}:rel:*"), 1).await;
    // The attempt follows its subscription's answer at once.
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Nothing of the queue stays once every waiter is gone.
async fn no_queue_left(test: &str) {
    let url = redis_url();
    for _ in 0..100 {
        let left: Vec<String> = keys_under(&url, &prefix(test))
            .await
            .into_iter()
            .filter(|k| !k.ends_with(":fence"))
            .collect();
        if left.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "{test}: keys left: {:?}",
        keys_under(&url, &prefix(test)).await
    );
}
