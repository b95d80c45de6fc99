//! The memory backend's semantics: every remote backend must match these.

use std::future::{Future, IntoFuture};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tower_lock::{BackendExt, LockError, LockMode, Locker, MemoryBackend};

/// Polls a future once, so that an acquisition joins the queue.
fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::pin::Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_under_100_tasks() {
    let backend = MemoryBackend::new();
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let entries = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let (backend, inside, overlaps, entries) = (
            backend.clone(),
            inside.clone(),
            overlaps.clone(),
            entries.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let guard = backend
                    .lock("hot")
                    .wait(Duration::from_secs(60))
                    .await
                    .unwrap();
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                entries.fetch_add(1, Ordering::SeqCst);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                drop(guard);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert_eq!(entries.load(Ordering::SeqCst), 2000);
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order() {
    let backend = MemoryBackend::new();
    let holder = backend.lock("k").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..10 {
        let (backend, order) = (backend.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let g = backend.lock("k").await.unwrap();
            order.lock().unwrap().push((i, g.token()));
            tokio::task::yield_now().await;
        }));
        // On the current-thread runtime this runs task i until it queues.
        tokio::task::yield_now().await;
    }
    drop(holder);
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap();
    let ids: Vec<_> = order.iter().map(|(i, _)| *i).collect();
    assert_eq!(ids, (0..10).collect::<Vec<_>>());
    assert!(
        order.windows(2).all(|w| w[0].1 < w[1].1),
        "tokens must increase: {order:?}"
    );
}

#[tokio::test]
async fn fencing_tokens_strictly_increase_per_key() {
    let backend = MemoryBackend::new();
    let mut last = None;
    for _ in 0..1000 {
        let g = backend.lock("fenced").await.unwrap();
        let _other = backend.lock("other").await.unwrap();
        if let Some(prev) = last {
            assert!(g.token() > prev);
        }
        last = Some(g.token());
    }
}

#[tokio::test]
async fn readers_share_writers_exclude_and_are_not_starved() {
    let backend = MemoryBackend::new();
    let r1 = backend.lock("doc").read().await.unwrap();
    let r2 = backend.lock("doc").read().fail_fast().await.unwrap();

    let mut writer = pin!(backend.lock("doc").write().into_future());
    assert!(writer
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_pending());

    // A reader arriving after a waiting writer waits behind it.
    assert!(matches!(
        backend.lock("doc").read().fail_fast().await,
        Err(LockError::Busy)
    ));
    let mut late_reader = Box::pin(backend.lock("doc").read().into_future());
    assert!(poll_once(&mut late_reader).is_pending());

    drop(r1);
    assert!(
        writer
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending(),
        "one reader still holds"
    );
    drop(r2);
    let w = match writer
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(Ok(w)) => w,
        other => panic!("writer not granted after readers left: {other:?}"),
    };
    assert!(poll_once(&mut late_reader).is_pending(), "writer holds");
    assert!(backend.lock("doc").write().fail_fast().await.is_err());
    drop(w);
    let r3 = match poll_once(&mut late_reader) {
        Poll::Ready(Ok(r)) => r,
        other => panic!("reader not granted after the writer: {other:?}"),
    };
    drop(r3);
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_admits_exactly_its_permits() {
    let backend = MemoryBackend::new();
    let inside = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (backend, inside, max) = (backend.clone(), inside.clone(), max.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let g = backend.lock("pool").semaphore(3).await.unwrap();
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_micros(200)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                drop(g);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(max.load(Ordering::SeqCst), 3);

    assert!(matches!(
        backend.lock("pool").semaphore(0).await,
        Err(LockError::InvalidMode(_))
    ));
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn semaphore_bound_follows_the_current_holders() {
    let backend = MemoryBackend::new();
    let a = backend.lock("s").semaphore(5).await.unwrap();
    let b = backend.lock("s").semaphore(2).await.unwrap();
    // Two holders, and one of them allows only two.
    assert!(backend.lock("s").semaphore(5).fail_fast().await.is_err());
    drop(b);
    // The small count left with its holder.
    let c = backend.lock("s").semaphore(5).fail_fast().await.unwrap();
    let d = backend.lock("s").semaphore(5).fail_fast().await.unwrap();
    drop((a, c, d));
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test(start_paused = true)]
async fn lock_all_waits_once_for_all_keys() {
    let backend = MemoryBackend::new();
    let _b = backend.lock("b").await.unwrap();
    let a = backend.lock("a").await.unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(40)).await;
        drop(a);
    });
    // `a` frees after 40 ms of the 100 ms budget; `b` never does. The whole
    // acquisition gives up at 100 ms, not 40 + 100.
    let started = tokio::time::Instant::now();
    match backend
        .lock_all(["a", "b"])
        .wait(Duration::from_millis(100))
        .await
    {
        Err(LockError::Timeout { waited }) => {
            assert_eq!(started.elapsed(), Duration::from_millis(100));
            assert_eq!(waited, Duration::from_millis(100));
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // `a` was given back.
    assert!(backend.lock("a").fail_fast().await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn timeouts_follow_the_tokio_clock() {
    let backend = MemoryBackend::new();
    let _held = backend.lock("k").await.unwrap();
    let started = tokio::time::Instant::now();
    let err = backend
        .lock("k")
        .wait(Duration::from_secs(3600))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Timeout { waited } if waited == Duration::from_secs(3600)));
    assert_eq!(started.elapsed(), Duration::from_secs(3600));
}

#[tokio::test]
async fn a_grant_revoked_before_it_is_seen_is_an_error() {
    let backend = MemoryBackend::new();
    let holder = backend.lock("k").await.unwrap();
    let mut waiter = Box::pin(backend.lock("k").into_future());
    assert!(poll_once(&mut waiter).is_pending());
    drop(holder); // grants the waiter...
    assert_eq!(backend.break_lock("k"), 1); // ...and revokes it unseen
    match poll_once(&mut waiter) {
        Poll::Ready(Err(LockError::Lost(_))) => {}
        other => panic!("expected a lost lock, got {other:?}"),
    }
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_key_in_crossing_orders_never_deadlocks() {
    let backend = MemoryBackend::new();
    let locker = Locker::new(backend.clone()).namespace("acct");
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (locker, inside) = (locker.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..200 {
                let keys = if i % 2 == 0 { ["a", "b"] } else { ["b", "a"] };
                let set = locker
                    .lock_all(keys)
                    .wait(Duration::from_secs(60))
                    .await
                    .unwrap();
                assert_eq!(set.len(), 2);
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                set.release().await.unwrap();
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    // A deadlock would hang here; the bound only turns it into a failure.
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("crossing lock_all deadlocked");
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn lock_all_is_all_or_nothing() {
    let backend = MemoryBackend::new();
    let held = backend.lock("c").await.unwrap();
    let err = backend
        .lock_all(["a", "b", "c", "d"])
        .fail_fast()
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Busy));
    // a and b were taken and given back.
    assert!(backend.lock("a").fail_fast().await.is_ok());
    assert!(backend.lock("b").fail_fast().await.is_ok());
    drop(held);

    let set = backend.lock_all(["b", "a", "b"]).await.unwrap();
    let keys: Vec<_> = set.guards().iter().map(|g| g.key().as_str()).collect();
    assert_eq!(keys, ["a", "b"], "sorted and de-duplicated");
    assert!(set.get("a").is_some());
    drop(set);
    assert!(matches!(
        backend.lock_all(["ok", "bad/key"]).await,
        Err(LockError::InvalidKey(_))
    ));
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn dropped_waiter_leaves_no_trace_and_does_not_block_the_queue() {
    let backend = MemoryBackend::new();
    let holder = backend.lock("k").await.unwrap();
    let mut first = Box::pin(backend.lock("k").into_future());
    let mut second = Box::pin(backend.lock("k").into_future());
    assert!(poll_once(&mut first).is_pending());
    assert!(poll_once(&mut second).is_pending());
    assert_eq!(backend.queued("k"), 2);
    drop(first);
    assert_eq!(backend.queued("k"), 1);
    drop(holder);
    let g = match poll_once(&mut second) {
        Poll::Ready(Ok(g)) => g,
        other => panic!("second waiter not granted: {other:?}"),
    };
    drop(g);
    assert_eq!(backend.active_keys(), 0);

    // Readers queued behind a writer that gives up are let in.
    let r = backend.lock("rw").read().await.unwrap();
    let mut writer = Box::pin(backend.lock("rw").write().into_future());
    assert!(poll_once(&mut writer).is_pending());
    let mut reader = Box::pin(backend.lock("rw").read().into_future());
    assert!(poll_once(&mut reader).is_pending());
    drop(writer);
    let r2 = match poll_once(&mut reader) {
        Poll::Ready(Ok(g)) => g,
        other => panic!("reader behind a departed writer not granted: {other:?}"),
    };
    drop(r);
    drop(r2);
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn waiter_granted_then_dropped_before_polling_releases() {
    let backend = MemoryBackend::new();
    let holder = backend.lock("k").await.unwrap();
    let mut waiter = Box::pin(backend.lock("k").into_future());
    assert!(poll_once(&mut waiter).is_pending());
    drop(holder); // grants the waiter, which never looks
    drop(waiter);
    assert_eq!(backend.active_keys(), 0);
    assert!(backend.lock("k").fail_fast().await.is_ok());
}

#[tokio::test]
async fn timeout_and_fail_fast() {
    let backend = MemoryBackend::new();
    let _holder = backend.lock("k").await.unwrap();
    match backend.lock("k").wait(Duration::from_millis(30)).await {
        Err(LockError::Timeout { waited }) => assert!(waited >= Duration::from_millis(30)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(matches!(
        backend.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    assert_eq!(backend.active_keys(), 1, "only the holder remains");
}

#[tokio::test]
async fn no_entry_left_after_a_million_distinct_keys() {
    let backend = MemoryBackend::new();
    let mut key = String::with_capacity(32);
    for i in 0..1_000_000u32 {
        use std::fmt::Write;
        key.clear();
        write!(key, "order-{i}").unwrap();
        let g = backend.lock(key.as_str()).fail_fast().await.unwrap();
        drop(g);
    }
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn broken_lock_fires_lost_and_admits_the_next_holder() {
    let backend = MemoryBackend::new();
    let first = backend.lock("k").await.unwrap();
    let mut next = Box::pin(backend.lock("k").into_future());
    assert!(poll_once(&mut next).is_pending());

    assert_eq!(backend.break_lock("k"), 1);
    tokio::time::timeout(Duration::from_secs(10), first.lost())
        .await
        .expect("the lost signal did not fire");
    let second = match poll_once(&mut next) {
        Poll::Ready(Ok(g)) => g,
        other => panic!("next waiter not granted: {other:?}"),
    };
    assert!(second.token() > first.token());
    // The revoked holder's release must not release the new holder.
    first.release().await.unwrap();
    assert!(matches!(
        backend.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    assert!(!second.is_lost());
    drop(second);
    assert_eq!(backend.active_keys(), 0);
    assert_eq!(backend.break_lock("k"), 0);
}

#[tokio::test]
async fn mixed_modes_on_one_key_exclude() {
    let backend = MemoryBackend::new();
    let _r = backend.lock("k").mode(LockMode::Read).await.unwrap();
    assert!(
        backend.lock("k").fail_fast().await.is_err(),
        "exclusive vs read"
    );
    assert!(backend.lock("k").semaphore(5).fail_fast().await.is_err());
}

#[tokio::test]
async fn a_released_lock_still_described_somewhere_is_not_reused() {
    // The backend reuses the state of released locks; one that a `HeldLock`
    // still describes must stay that lock's, not become the next grant's.
    let backend = MemoryBackend::new();
    let first = backend.lock("k").await.unwrap();
    let described = first.held().clone();
    drop(first);
    let second = backend.lock("k").await.unwrap();
    assert!(second.token() > described.token());
    assert_eq!(backend.break_lock("k"), 1);
    assert!(second.is_lost());
    assert!(
        !described.is_lost(),
        "a released lock's description saw a later grant's loss"
    );
    drop((second, described));
    assert_eq!(backend.active_keys(), 0);
}
