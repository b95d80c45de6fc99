//! Behaviour on one redis-server: exclusion, hand-over, renewal, loss,
//! modes, errors and redis-py interop.

use super::*;

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
    // The waiter listens for its turn rather than polling: on its own
    // process's channel for the key, once queued.
    super::queue::queued("wake", "k", 1).await;
    listening(&format!("{}{{k}}:rel:*", prefix("wake")), 1).await;
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

/// In every mode: a reader that arrives after a queued writer waits for
/// it, though it could share with the reader holding the key.
#[tokio::test]
async fn a_reader_arriving_after_a_queued_writer_waits_for_it() {
    let b = backend("fifo").await;
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

#[tokio::test]
async fn a_fencing_counter_ahead_of_the_clock_reserves_one_token_a_grant() {
    // A counter run ahead of the server's clock (as reservations of 65,536
    // tokens a grant, many grants a second, once made it) would restart
    // below tokens handed out if it expired. A grant then reserves one
    // token, not a block, so that the clock catches up.
    let url = redis_url();
    let prefix = prefix("fence-ahead");
    let many = RedisOptions::default()
        .prefix(&prefix)
        .cohort(CohortOptions::default().max_grants(65_536));
    let backend = RedisBackend::connect_with(&url, many).await.unwrap();
    let key = LockKey::new("k").unwrap();
    let fence = format!("{}:fence", backend.redis_key(&key));
    let mut conn = raw(&url).await;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let ahead = secs * 1_000_000 + micros + 1_000_000_000_000;
    let _: () = conn.set(&fence, ahead).await.unwrap();
    let held = backend.lock("k").await.unwrap();
    assert_eq!(held.token().get(), ahead + 1);
    let counter: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(counter, ahead + 1, "a block was reserved past the clock");
    held.release().await.unwrap();

    // Behind the clock, a grant reserves its whole block, from the clock.
    let _: () = conn.set(&fence, 5).await.unwrap();
    let held = backend.lock("k").await.unwrap();
    let counter: u64 = conn.get(&fence).await.unwrap();
    assert_eq!(
        held.token().get(),
        counter + 1 - 65_536,
        "the block ends at the counter"
    );
    assert!(
        counter > secs * 1_000_000,
        "the counter follows the clock: {counter}"
    );
    held.release().await.unwrap();
    let _: () = conn.del(&fence).await.unwrap();
}

/// This process's next waiter asks the moment the release is answered and
/// would often beat a waiter in another process woken by the release
/// message (a race: ten rounds, so that one lost is seen). The lock's
/// queue keeps them in the order they asked: the waiter elsewhere first.
#[tokio::test]
async fn a_release_heard_by_another_process_goes_there_before_the_next_waiter_here() {
    let here = backend("turns").await;
    let there = backend("turns").await;
    for round in 0..10 {
        let key = format!("k{round}");
        let holder = here.lock(key.as_str()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let hold = Duration::from_millis(20);
        let elsewhere = super::queue::waiter(&there, &key, "there", &order, hold);
        super::queue::queued("turns", &key, 1).await;
        let next = super::queue::waiter(&here, &key, "here", &order, hold);
        // Queued behind the holder, past the bound of its hand-offs.
        tokio::time::sleep(Duration::from_millis(60)).await;
        holder.release().await.unwrap();
        elsewhere.await.unwrap();
        next.await.unwrap();
        assert_eq!(*order.lock().unwrap(), ["there", "here"], "round {round}");
    }
}

/// A subscriber that heard the release but does not come for the lock
/// (here not a waiter at all) holds the next waiter back only briefly.
#[tokio::test]
async fn a_release_heard_by_a_listener_that_does_not_come_still_reaches_the_next_waiter() {
    let b = backend("listener").await;
    let channel = format!("{}{{k}}:rel", prefix("listener"));
    let client = redis::Client::open(redis_url()).unwrap();
    let mut listener = client.get_async_pubsub().await.unwrap();
    listener.subscribe(&channel).await.unwrap();
    subscribers(&channel, 1).await;
    let holder = b.lock("k").await.unwrap();
    let next = {
        let b = b.clone();
        tokio::spawn(async move { b.lock("k").wait(Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder.release().await.unwrap();
    let asked = Instant::now();
    let g = next.await.unwrap().unwrap();
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "{:?}",
        asked.elapsed()
    );
    g.release().await.unwrap();
}

/// What an uncontended lock and its release cost the server, counts that
/// do not drift: each script's keys and arguments (every one a Redis
/// object and a Lua string to the server, some 1,500 of its instructions)
/// and the commands the scripts run. Two scripts: the acquire with the
/// lock's key and fence and three arguments, running `SET NX` of the lock,
/// `TIME` and `SET … GET` of the fence; the release with the lock's key
/// and the token, running `GET`, `DEL` and `EXISTS`. Read off a
/// server of the test's own: its command statistics, and its slow log set
/// to keep every command with its arguments.
#[tokio::test]
async fn an_uncontended_lock_costs_the_server_two_small_scripts_of_six_commands() {
    let server = Server::start();
    let b = backend_at(&server.url(), "lock:").await;
    // The scripts loaded (`EVAL` the first time), the fence in place.
    b.lock("k").await.unwrap().release().await.unwrap();
    b.flush().await;
    let mut conn = raw(&server.url()).await;
    count_commands(&mut conn).await;
    b.lock("k").await.unwrap().release().await.unwrap();
    b.flush().await;
    let (run, stats) = commands_run(&mut conn).await;
    // Each entry: id, time, duration, the command with its arguments, ...
    let log: Vec<Vec<redis::Value>> = redis::cmd("SLOWLOG")
        .arg(&["GET", "100"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let scripts: Vec<Vec<String>> = log
        .into_iter()
        .rev()
        .map(|entry| redis::from_redis_value::<Vec<String>>(entry[3].clone()).unwrap())
        .filter(|args| args[0].eq_ignore_ascii_case("EVALSHA"))
        .collect();
    // Past `EVALSHA`, the hash and the count: keys and arguments.
    let sent: Vec<&[String]> = scripts.iter().map(|args| &args[3..]).collect();
    assert_eq!(
        sent.len(),
        2,
        "one acquire and one release script: {scripts:?}"
    );
    // Each key and argument costs the server an object and a Lua string:
    // the acquire sends its token, lease and tokens to reserve, leaving the
    // defaults out; the release, the lock and the token.
    assert_eq!(
        (sent[0].len(), &sent[0][..2]),
        (5, &["lock:{k}".to_owned(), "lock:{k}:fence".to_owned()][..]),
        "the acquire's keys and arguments: {scripts:?}"
    );
    assert_eq!(
        (sent[1].len(), &sent[1][..1]),
        (2, &["lock:{k}".to_owned()][..]),
        "the release's keys and arguments: {scripts:?}"
    );
    let expected = calls(&[
        ("del", 1),
        ("evalsha", 2),
        ("exists", 1),
        ("get", 1),
        ("set", 2),
        ("time", 1),
    ]);
    assert_eq!(run, expected, "{stats}");
}

/// A waiter's turn kept in the lock's key (`~` and its token, set by a
/// release that names it) is shown by inspection as that turn, not as an
/// owner, and keeps everyone else out, redis-py's `SET NX` included.
#[tokio::test]
async fn a_named_waiters_turn_is_inspected_as_its_turn_and_keeps_others_out() {
    let b = backend("turn").await;
    let name = format!("{}{{k}}", prefix("turn"));
    let mut conn = raw(&redis_url()).await;
    let () = redis::cmd("SET")
        .arg(&[name.as_str(), "~0123456789abcdef-waiter", "PX", "5000"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let seen = b.inspect(LockKey::new("k").unwrap()).await.unwrap();
    assert_eq!(seen.holders.len(), 1, "{seen:?}");
    assert_eq!(
        seen.holders[0].identity.as_deref(),
        Some("turn of waiter 0123456789abcdef-waiter")
    );
    assert!(seen.holders[0].token.is_none());
    assert!(matches!(
        b.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let taken: Option<String> = redis::cmd("SET")
        .arg(&[name.as_str(), "py-token", "NX", "PX", "5000"])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(taken, None, "redis-py took a waiter's turn");
    let () = conn.del(&name).await.unwrap();
}
