//! Cancellation at every await point, for any backend: an operation (an
//! awaited release, a waiting or fail-fast acquire, `lock_all`, `flush`, a
//! request whose handler re-enters its lock) is
//! polled `k` times and dropped, for every `k` from 0 (dropped unpolled)
//! until it completes, while a second request of the same backend wants the
//! same key and another backend (another process, as far as the server
//! knows) checks who holds it. After each cut: no other holder's lock was
//! freed, nothing is left held, the next acquire works, and fencing tokens
//! still rise.
//!
//! Between polls the test sleeps a millisecond, so that what a poll put on
//! the wire is answered before the next poll: the cuts fall before a
//! request is sent, after it is sent and before its answer is read, and
//! after.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tower_lock::{Backend, BackendExt, LockError};

const WAIT: Duration = Duration::from_secs(10);
/// More polls than any operation takes here: reaching it fails the test.
const MOST_POLLS: usize = 100;

/// Polls `fut` up to `k` times, a millisecond apart; its output if it
/// finished within them.
async fn poll_times<F: Future + Unpin>(fut: &mut F, k: usize) -> Option<F::Output> {
    for i in 0..k {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if let Poll::Ready(out) = Pin::new(&mut *fut).poll(&mut Context::from_waker(Waker::noop()))
        {
            return Some(out);
        }
    }
    None
}

/// Locks `key` on `backend`, checks its token is above `last`, and moves
/// `last` up to it.
async fn lock_above<B: Backend>(
    backend: &B,
    key: &str,
    last: &mut u64,
    what: &str,
) -> tower_lock::LockGuard {
    let guard = backend
        .lock(key)
        .wait(WAIT)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let token = guard.token().get();
    assert!(token > *last, "{what}: token {token} not above {last}");
    *last = token;
    guard
}

/// `other` cannot take `key` now: someone holds it.
async fn held_against<B: Backend>(other: &B, key: &str, what: &str) {
    match other.lock(key).fail_fast().await {
        Err(LockError::Busy) => {}
        Err(e) => panic!("{what}: another backend got {e}"),
        Ok(_) => panic!("{what}: another backend took a key that is held"),
    }
}

/// An awaited release, dropped after `k` polls; the same backend has locked
/// the key again before the drop. Returns the polls the release takes.
pub async fn release_dropped_after_each_poll<B: Backend>(a: &B, other: &B, key: &str) -> usize {
    let mut last = 0;
    for k in 0..=MOST_POLLS {
        let held = lock_above(a, key, &mut last, "lock").await;
        let mut release = Box::pin(held.release());
        if let Some(result) = poll_times(&mut release, k).await {
            result.unwrap_or_else(|e| panic!("release after {k} polls: {e}"));
            let freed = lock_above(other, key, &mut last, "after a finished release").await;
            freed.release().await.unwrap();
            return k;
        }
        // The next holder, in the same backend, asks while the cut release
        // may still be on its way (or, cut unpolled, still holds the key).
        let what = format!("relock after a release cut at poll {k}");
        let mut relock = Box::pin(a.lock(key).wait(WAIT).into_future());
        let early = poll_times(&mut relock, 1).await;
        drop(release);
        let again = match early {
            Some(result) => result,
            None => relock.await,
        }
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(again.token().get() > last, "{what}: token not above {last}");
        last = again.token().get();
        a.flush().await;
        held_against(
            other,
            key,
            &format!("release cut at poll {k}, next holder on the same backend"),
        )
        .await;
        again.release().await.unwrap();
        let after = lock_above(
            other,
            key,
            &mut last,
            &format!("release cut at poll {k}, then released"),
        )
        .await;
        after.release().await.unwrap();
    }
    panic!("the release did not finish within {MOST_POLLS} polls")
}

/// An acquire with a wait on a key `other` holds, released after the first
/// poll; dropped after `k` polls. Returns the polls the acquire takes.
pub async fn waiting_acquire_dropped_after_each_poll<B: Backend>(
    a: &B,
    other: &B,
    key: &str,
) -> usize {
    let mut last = 0;
    for k in 0..=MOST_POLLS {
        let holder = lock_above(other, key, &mut last, "holder").await;
        let mut acquire = Box::pin(a.lock(key).wait(WAIT).into_future());
        let mut got = poll_times(&mut acquire, k.min(1)).await;
        assert!(
            got.is_none(),
            "an acquire finished while another backend held the key"
        );
        holder.release().await.unwrap();
        if k > 1 {
            got = poll_times(&mut acquire, k - 1).await;
        }
        if let Some(result) = got {
            let guard = result.unwrap_or_else(|e| panic!("acquire after {k} polls: {e}"));
            assert!(guard.token().get() > last, "a waiting acquire's token");
            held_against(other, key, "a finished waiting acquire").await;
            guard.release().await.unwrap();
            return k;
        }
        drop(acquire);
        a.flush().await;
        // Nothing the cut acquire got is left held, and the backend locks
        // the key again.
        let free = lock_above(other, key, &mut last, &format!("acquire cut at poll {k}")).await;
        free.release().await.unwrap();
        let again = lock_above(
            a,
            key,
            &mut last,
            &format!("the same backend after an acquire cut at poll {k}"),
        )
        .await;
        again.release().await.unwrap();
    }
    panic!("the acquire did not finish within {MOST_POLLS} polls")
}

/// A fail-fast acquire of a free key, dropped after `k` polls. Returns the
/// polls it takes.
pub async fn fail_fast_acquire_dropped_after_each_poll<B: Backend>(
    a: &B,
    other: &B,
    key: &str,
) -> usize {
    let mut last = 0;
    for k in 0..=MOST_POLLS {
        let mut acquire = Box::pin(a.lock(key).fail_fast().into_future());
        if let Some(result) = poll_times(&mut acquire, k).await {
            let guard = result.unwrap_or_else(|e| panic!("fail-fast acquire after {k} polls: {e}"));
            assert!(guard.token().get() > last);
            held_against(other, key, "a finished fail-fast acquire").await;
            guard.release().await.unwrap();
            return k;
        }
        drop(acquire);
        a.flush().await;
        let free = lock_above(
            other,
            key,
            &mut last,
            &format!("fail-fast acquire cut at poll {k}"),
        )
        .await;
        free.release().await.unwrap();
    }
    panic!("the fail-fast acquire did not finish within {MOST_POLLS} polls")
}

/// `lock_all` of three keys, one of which `other` holds and lets go after
/// the first poll, dropped after `k` polls. Returns the polls it takes.
pub async fn lock_all_dropped_after_each_poll<B: Backend>(a: &B, other: &B, key: &str) -> usize {
    let keys: Vec<String> = (0..3).map(|i| format!("{key}-{i}")).collect();
    for k in 0..=MOST_POLLS {
        let holder = other.lock(keys[1].as_str()).wait(WAIT).await.unwrap();
        let mut all = Box::pin(
            a.lock_all(keys.iter().map(String::as_str))
                .wait(WAIT)
                .into_future(),
        );
        let mut got = poll_times(&mut all, k.min(1)).await;
        assert!(got.is_none(), "lock_all finished while a key was held");
        holder.release().await.unwrap();
        if k > 1 {
            got = poll_times(&mut all, k - 1).await;
        }
        if let Some(result) = got {
            let set = result.unwrap_or_else(|e| panic!("lock_all after {k} polls: {e}"));
            for each in &keys {
                held_against(other, each, "a finished lock_all").await;
            }
            set.release().await.unwrap();
            return k;
        }
        drop(all);
        a.flush().await;
        for each in &keys {
            let free = other
                .lock(each.as_str())
                .wait(WAIT)
                .await
                .unwrap_or_else(|e| panic!("{each} after a lock_all cut at poll {k}: {e}"));
            free.release().await.unwrap();
        }
    }
    panic!("lock_all did not finish within {MOST_POLLS} polls")
}

/// `flush`, dropped after `k` polls while a dropped guard's release is in
/// flight: the release still ends, and a later `flush` waits for nothing
/// left. Returns the polls it takes.
pub async fn flush_dropped_after_each_poll<B: Backend>(a: &B, other: &B, key: &str) -> usize {
    for k in 0..=MOST_POLLS {
        drop(a.lock(key).wait(WAIT).await.unwrap());
        let mut flush = a.flush();
        if poll_times(&mut flush, k).await.is_some() {
            let free = other.lock(key).fail_fast().await.unwrap_or_else(|e| {
                panic!("the key after a flush that finished in {k} polls: {e}")
            });
            free.release().await.unwrap();
            return k;
        }
        drop(flush);
        a.flush().await;
        let free = other.lock(key).fail_fast().await.unwrap_or_else(|e| {
            panic!("the key after a flush cut at poll {k} and a whole one: {e}")
        });
        free.release().await.unwrap();
    }
    panic!("flush did not finish within {MOST_POLLS} polls")
}

/// A guard dropped on a thread where no Tokio runtime runs: no panic, and
/// the key is released (on the runtime the backend was made on).
pub async fn guard_dropped_outside_a_runtime<B: Backend>(a: &B, other: &B, key: &str) {
    let guard = a.lock(key).wait(WAIT).await.unwrap();
    std::thread::spawn(move || drop(guard))
        .join()
        .expect("dropping a guard outside a runtime panicked");
    a.flush().await;
    let free = other
        .lock(key)
        .wait(WAIT)
        .await
        .unwrap_or_else(|e| panic!("a guard dropped outside a runtime left its key held: {e}"));
    free.release().await.unwrap();
}

/// A request served under a `LockLayer` on `key`, whose handler re-enters
/// that lock (a nested guard) and takes a lock of its own on `key-own`,
/// dropped after `k` polls: a client gone at any point. After each cut
/// both keys are free for `other`, tokens still rise, and the next request
/// is served. Returns the polls a request takes.
pub async fn reentrant_request_dropped_after_each_poll<B: Backend + Clone>(
    a: &B,
    other: &B,
    key: &str,
) -> usize {
    use axum::extract::{Extension, Path};
    use axum::routing::post;
    use tower::ServiceExt;
    use tower_lock::{LockLayer, Locker, PathParam};

    async fn nested(
        Extension(locker): Extension<Locker>,
        Path(key): Path<String>,
    ) -> Result<String, LockError> {
        let same = locker.lock(key.as_str()).await?;
        let own = locker.lock(format!("{key}-own").as_str()).await?;
        own.release().await?;
        same.release().await?;
        Ok(key)
    }
    let layer = LockLayer::new(a.clone(), PathParam("key")).wait(WAIT);
    let app = axum::Router::new()
        .route("/{key}", post(nested))
        .route_layer(layer.clone())
        .layer(Extension(layer.locker().clone()));
    let request = || {
        http::Request::post(format!("/{key}"))
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let own = format!("{key}-own");
    // Tokens rise per key.
    let mut last = [0, 0];
    for k in 0..=MOST_POLLS {
        let mut served = Box::pin(app.clone().oneshot(request()));
        if let Some(response) = poll_times(&mut served, k).await {
            assert_eq!(
                response.unwrap().status(),
                200,
                "a re-entrant request after {k} polls"
            );
            return k;
        }
        drop(served);
        a.flush().await;
        for (each, last) in [key, own.as_str()].into_iter().zip(&mut last) {
            let what = format!("{each} after a re-entrant request cut at poll {k}");
            lock_above(other, each, last, &what)
                .await
                .release()
                .await
                .unwrap();
        }
        let next = app.clone().oneshot(request()).await.unwrap();
        assert_eq!(next.status(), 200, "the request after a cut at poll {k}");
    }
    panic!("the re-entrant request did not finish within {MOST_POLLS} polls")
}

/// Every operation above on `key`-derived keys; prints the poll points
/// covered.
pub async fn every_cut<B: Backend + Clone>(name: &str, a: &B, other: &B, key: &str) {
    let release = release_dropped_after_each_poll(a, other, &format!("{key}-release")).await;
    let wait = waiting_acquire_dropped_after_each_poll(a, other, &format!("{key}-wait")).await;
    let fail_fast =
        fail_fast_acquire_dropped_after_each_poll(a, other, &format!("{key}-failfast")).await;
    let all = lock_all_dropped_after_each_poll(a, other, &format!("{key}-all")).await;
    let flush = flush_dropped_after_each_poll(a, other, &format!("{key}-flush")).await;
    let nested =
        reentrant_request_dropped_after_each_poll(a, other, &format!("{key}-nested")).await;
    guard_dropped_outside_a_runtime(a, other, &format!("{key}-thread")).await;
    println!(
        "cancellation {name}: release cut at 0..={release} polls, waiting acquire at 0..={wait}, \
         fail-fast acquire at 0..={fail_fast}, lock_all at 0..={all}, flush at 0..={flush}, \
         a re-entrant request at 0..={nested}; a guard dropped outside a runtime released"
    );
}
