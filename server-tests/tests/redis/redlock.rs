//! Redlock over servers of the tests' own.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_excludes_and_cleans_up() {
    use tower_lock::backend::redis::redlock::RedlockBackend;
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
    use tower_lock::backend::redis::redlock::RedlockBackend;
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
                s.signal("STOP");
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
    use tower_lock::backend::redis::redlock::RedlockBackend;
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
    servers[1].signal("STOP");
    let r = backend.lock("k").fail_fast().await;
    servers[1].signal("CONT");
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

/// An acquisition whose wait runs out while its round is still in flight
/// (two instances silent) must not leave the round behind: the silent
/// instances grant it once they run again, and without an undo the key
/// would be held by no one on a majority until the lease ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_undoes_a_round_cancelled_in_flight() {
    use tower_lock::backend::redis::redlock::RedlockBackend;
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
    servers[1].signal("STOP");
    servers[2].signal("STOP");
    // Shorter than the per-instance answer timeout: the round is in flight
    // when the wait runs out.
    let r = backend.lock("k").wait(Duration::from_millis(50)).await;
    assert!(matches!(r, Err(LockError::Timeout { .. })), "{r:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    servers[1].signal("CONT");
    servers[2].signal("CONT");
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
    use tower_lock::backend::redis::redlock::RedlockBackend;
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

/// An operator's break reaches one of the three servers late (its requests
/// held in a proxy, less than the response timeout). While they are held,
/// no other client may be granted the key with a token under the floor the
/// break reports: a break that frees the servers it reaches first would
/// let a waiter take those two, below the counter the late server raises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_break_grants_nothing_under_its_floor_while_one_server_lags() {
    use tower_lock::backend::redis::redlock::RedlockBackend;
    use tower_lock::backend::BreakScope;
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let late = FaultProxy::start(servers[2].addr()).await.unwrap();
    let operator = RedlockBackend::connect(&format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},{}",
        servers[0].port,
        servers[1].port,
        late.addr()
    ))
    .await
    .unwrap();
    let holder = RedlockBackend::connect(&redlock_url(&servers))
        .await
        .unwrap();
    let waiter = RedlockBackend::connect(&redlock_url(&servers))
        .await
        .unwrap();
    // Connected before the fault, so that the waiter's attempt below and
    // the operator's requests go out at once.
    operator.inspect(LockKey::new("k").unwrap()).await.unwrap();
    waiter.inspect(LockKey::new("k").unwrap()).await.unwrap();
    let held = holder
        .lock("k")
        .lease(Duration::from_secs(10))
        .await
        .unwrap();
    late.set(ProxyFault::FreezeUp).await;
    let frozen = Instant::now();
    let broken = tokio::spawn({
        let operator = operator.clone();
        async move {
            operator
                .break_lock(LockKey::new("k").unwrap(), BreakScope::LocksOnly)
                .await
        }
    });
    // The two prompt servers have answered whatever the break sent them.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let during = waiter.lock("k").fail_fast().await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    late.heal().await;
    // Held back for less than the response timeout (200 ms), the late
    // server's answer counts, and nothing may be free before it.
    let held_back = frozen.elapsed() < Duration::from_millis(180);
    let broken = broken.await.unwrap().expect("the break");
    assert!(broken.floor > held.token(), "{broken:?}");
    if let Ok(g) = &during {
        assert!(
            g.token() >= broken.floor,
            "granted during the break with token {} under its floor {}",
            g.token(),
            broken.floor
        );
    }
    if held_back {
        assert!(
            during.is_err(),
            "granted before every counter was raised: {:?}",
            during.as_ref().map(|g| g.token())
        );
    }
    drop(during);
    waiter.flush().await;
    let next = waiter
        .lock("k")
        .wait(Duration::from_secs(5))
        .await
        .expect("free once broken");
    assert!(
        next.token() >= broken.floor,
        "{} < {}",
        next.token(),
        broken.floor
    );
    next.release().await.unwrap();
    drop(held);
    holder.flush().await;
}
