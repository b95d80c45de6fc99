//! The memory backend on one key: a grant, a release that hands the key to
//! a queued waiter, and a wait cancelled at any point, all under the
//! shard's lock and the waiters' wakers.

use std::sync::Arc;

use super::{exclusive, model, poll_once};
use crate::loom::sync::atomic::{AtomicU32, Ordering};
use crate::mode::Wait;
use crate::{Backend, MemoryBackend};

/// One holder, a waiter that waits until granted, and a wait polled once
/// and dropped, all on one key: never two holders at once, the waiter is
/// always woken and granted with a higher token, and once everyone has
/// gone the backend holds no entry for the key (no holder, no waiter).
pub fn acquire_release_and_a_cancelled_wait_leave_one_holder_and_no_entry() {
    model(|| {
        let backend = MemoryBackend::new();
        let inside = Arc::new(AtomicU32::new(0));
        let first =
            loom::future::block_on(backend.acquire(exclusive(Wait::FailFast))).expect("a free key");
        inside.fetch_add(1, Ordering::SeqCst);
        let first_token = first.token();

        let waiter = loom::thread::spawn({
            let (backend, inside) = (backend.clone(), inside.clone());
            move || {
                let held = loom::future::block_on(backend.acquire(exclusive(Wait::Forever)))
                    .expect("granted once the holder goes");
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                let token = held.token();
                inside.fetch_sub(1, Ordering::SeqCst);
                drop(held);
                token
            }
        });
        let cancelled = loom::thread::spawn({
            let (backend, inside) = (backend.clone(), inside.clone());
            move || {
                let mut wait = backend.acquire(exclusive(Wait::Forever));
                if let std::task::Poll::Ready(held) = poll_once(&mut wait) {
                    let held = held.expect("a grant");
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders at once"
                    );
                    inside.fetch_sub(1, Ordering::SeqCst);
                    drop(held);
                }
                drop(wait);
            }
        });

        inside.fetch_sub(1, Ordering::SeqCst);
        drop(first);
        let token = waiter.join().unwrap();
        cancelled.join().unwrap();
        assert!(token > first_token, "tokens went backwards");
        assert_eq!(backend.active_keys(), 0, "an entry was left behind");
    });
}
