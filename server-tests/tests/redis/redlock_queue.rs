//! Redlock's queues: every instance queues a key's waiters at the score
//! each chose, so a release names the same waiter on all of them; waiters
//! in different processes take the lock in the order they asked, the
//! process that released included, and one that gives up leaves every
//! queue.

use super::queue::{waiter, HOLD};
use super::*;
use tower_lock::backend::redis::redlock::RedlockBackend;

/// Waits until `key`'s queue holds `n` waiters on every instance; fails
/// the test if it has not within two seconds.
async fn queued(servers: &[Server], key: &str, n: usize) {
    let queue = format!("lock:{{{key}}}:queue");
    for s in servers {
        let mut conn = raw(&s.url()).await;
        let mut waiting = 0;
        for _ in 0..100 {
            waiting = conn.zcard(&queue).await.unwrap();
            if waiting == n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(waiting, n, "waiters in {queue} on {}", s.url());
    }
}

/// Nothing but fencing counters stays on any instance once every waiter
/// is gone.
async fn nothing_left(servers: &[Server]) {
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    super::conformance::no_lock_left(&urls, "lock:").await;
}

/// Without the queues every waiter retries after a random pause, and the
/// holder, asking again as it releases, takes the lock back before any of
/// them (seen: 35 holds against 2,188). With them, a release names the
/// first waiter on every instance, and the holder's new acquisition queues
/// behind the three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_waiters_in_different_processes_take_the_lock_in_the_order_they_asked() {
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let url = redlock_url(&servers);
    let connect = || RedlockBackend::connect(&url);
    let holder = connect().await.unwrap();
    let (a, b, c) = (
        connect().await.unwrap(),
        connect().await.unwrap(),
        connect().await.unwrap(),
    );
    for round in 0..5 {
        let key = format!("k{round}");
        let held = holder.lock(key.as_str()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let first = waiter(&c, &key, "c", &order, HOLD);
        queued(&servers, &key, 1).await;
        let second = waiter(&a, &key, "a", &order, HOLD);
        queued(&servers, &key, 2).await;
        let third = waiter(&b, &key, "b", &order, HOLD);
        queued(&servers, &key, 3).await;
        held.release().await.unwrap();
        let again = waiter(&holder, &key, "holder", &order, HOLD);
        for w in [first, second, third, again] {
            w.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(order, ["c", "a", "b", "holder"], "round {round}");
    }
    for backend in [&holder, &a, &b, &c] {
        backend.flush().await;
    }
    nothing_left(&servers).await;
}

/// A waiter that gives up leaves the queue on every instance; a release
/// then names the one behind it everywhere, which takes the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_a_waiter_that_gives_up_leaves_every_queue() {
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let url = redlock_url(&servers);
    let connect = || RedlockBackend::connect(&url);
    let (holder, quitter, patient) = (
        connect().await.unwrap(),
        connect().await.unwrap(),
        connect().await.unwrap(),
    );
    let held = holder.lock("k").await.unwrap();
    let gave_up = {
        let quitter = quitter.clone();
        tokio::spawn(async move { quitter.lock("k").wait(Duration::from_millis(400)).await })
    };
    queued(&servers, "k", 1).await;
    let next = {
        let patient = patient.clone();
        tokio::spawn(async move { patient.lock("k").wait(Duration::from_secs(10)).await })
    };
    queued(&servers, "k", 2).await;
    assert!(matches!(
        gave_up.await.unwrap(),
        Err(LockError::Timeout { .. })
    ));
    quitter.flush().await;
    queued(&servers, "k", 1).await;
    held.release().await.unwrap();
    next.await.unwrap().unwrap().release().await.unwrap();
    for backend in [&holder, &quitter, &patient] {
        backend.flush().await;
    }
    nothing_left(&servers).await;
}

/// A waiter granted by a minority (the other instances held by someone
/// else) undoes its grant there and goes back in that instance's queue at
/// its place, so the undo names it first there, as the others would.
/// Without it back, that instance's queue would lack it and name the next
/// waiter (here nobody), who would split rounds with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_a_split_round_puts_the_waiter_back_at_its_place() {
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let waiter = RedlockBackend::connect(&redlock_url(&servers))
        .await
        .unwrap();
    let (lock, queue) = ("lock:{k}", "lock:{k}:queue");
    let mut held = Vec::new();
    for s in &servers[..2] {
        let mut conn = raw(&s.url()).await;
        let () = conn
            .set_options(lock, "someone-else", set_px(60_000))
            .await
            .unwrap();
        held.push(conn);
    }
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.lock("k").wait(Duration::from_secs(10)).await })
    };
    queued(&servers[..2], "k", 1).await;
    // The waiter, queued on the held instances at one score.
    let mut places: Vec<Vec<(String, u64)>> = Vec::new();
    for conn in &mut held {
        places.push(conn.zrange_withscores(queue, 0, -1).await.unwrap());
    }
    assert_eq!(places[0].len(), 1, "{places:?}");
    assert_eq!(places[0], places[1], "one place on every instance");
    let token = &places[0][0].0;
    // On the free instance, between its rounds: the waiter named, the lock
    // kept as its turn (a named waiter leaves the queue for its turn).
    let mut free = raw(&servers[2].url()).await;
    let turn = format!("~{token}");
    let mut value: Option<String> = None;
    for _ in 0..300 {
        value = free.get(lock).await.unwrap();
        if value.as_ref() == Some(&turn) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(value, Some(turn), "named on the free instance");
    for conn in &mut held {
        let () = conn.del(lock).await.unwrap();
    }
    waiting.await.unwrap().unwrap().release().await.unwrap();
    waiter.flush().await;
    nothing_left(&servers).await;
}

fn set_px(ms: u64) -> redis::SetOptions {
    redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(ms))
}
