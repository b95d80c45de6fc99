//! Re-entrancy: the locks the request being served already holds.
//!
//! The [`LockLayer`](crate::LockLayer)'s response future runs the inner
//! service's future inside a task-local scope that lists the request's locks:
//! the layer's own, then every lock the handler takes while it runs. An
//! acquisition that finds its key there, through the same backend, does not
//! ask the backend (it would wait for itself): it gets a nested guard on the
//! same lock, or at once an error if the modes cannot share.

use std::cell::RefCell;
use std::future::Future;
use std::sync::{Arc, Weak};

use tokio::task::futures::TaskLocalFuture;

use crate::error::LockError;
use crate::guard::{HeldLock, LockGuard, SharedLease};
use crate::key::LockKey;
use crate::mode::LockMode;

tokio::task_local! {
    static REQUEST: RefCell<RequestLocks>;
}

/// The locks one request holds: the layer's, described (the layer releases
/// it when the response is ready, so nested guards only borrow it), and
/// those its handler took, weakly, so that one released early is not kept
/// alive here.
#[derive(Default)]
pub(crate) struct RequestLocks {
    // The `Vec` only allocates when a handler takes locks.
    layer: Option<(usize, HeldLock)>,
    taken: Vec<Weak<SharedLease>>,
}

/// `future`, run with the layer's lock `held` (through the backend
/// `backend_id`) as the request's first lock.
pub(crate) fn scope<F: Future>(
    layer: Option<(usize, HeldLock)>,
    future: F,
) -> TaskLocalFuture<RefCell<RequestLocks>, F> {
    let locks = RequestLocks {
        layer,
        taken: Vec::new(),
    };
    REQUEST.scope(RefCell::new(locks), future)
}

/// What to do with an acquisition of `key` in `mode` on the backend
/// `backend_id`: `None` to ask the backend (the request does not hold the
/// key, or no request is being served); a nested guard, or an error when
/// the request holds the key in a mode that cannot share.
pub(crate) fn reenter(
    backend_id: usize,
    key: &LockKey,
    mode: LockMode,
) -> Option<Result<LockGuard, LockError>> {
    REQUEST
        .try_with(|locks| {
            let locks = locks.borrow();
            let held_by_layer = locks
                .layer
                .as_ref()
                .filter(|(id, held)| *id == backend_id && held.key == *key);
            if let Some((_, held)) = held_by_layer {
                return Some(nest(held, mode, || LockGuard::borrowed(held.clone())));
            }
            let shared = locks
                .taken
                .iter()
                .filter_map(Weak::upgrade)
                .find(|s| s.backend_id == backend_id && s.held.key == *key)?;
            Some(nest(&shared.held, mode, || {
                LockGuard::nested(shared.clone())
            }))
        })
        .ok()
        .flatten()
}

/// A nested guard if `held` can be re-entered in `wanted` mode.
fn nest(
    held: &HeldLock,
    wanted: LockMode,
    guard: impl FnOnce() -> LockGuard,
) -> Result<LockGuard, LockError> {
    if covers(held.mode, wanted) {
        Ok(guard())
    } else {
        Err(LockError::Reentry {
            key: held.key.clone(),
            held: held.mode,
            wanted,
        })
    }
}

/// Records a lock the request's handler took through the backend
/// `backend_id`, so that a later acquisition of the same key in the same
/// request re-enters it. Outside a request it costs one thread-local look.
pub(crate) fn record(guard: &mut LockGuard, backend_id: usize) {
    let _ = REQUEST.try_with(|locks| {
        let Some(shared) = guard.share(backend_id) else {
            return;
        };
        let mut locks = locks.borrow_mut();
        // Forget released locks, so a handler taking many in turn does not
        // grow the list.
        locks.taken.retain(|w| w.strong_count() > 0);
        locks.taken.push(Arc::downgrade(shared));
    });
}

/// Whether a holder in `held` mode may also take the key in `wanted` mode
/// without waiting for anyone: the same mode, or a read under a write.
fn covers(held: LockMode, wanted: LockMode) -> bool {
    held == wanted || (held == LockMode::Write && wanted == LockMode::Read)
}

#[cfg(test)]
mod tests {
    use super::covers;
    use crate::mode::LockMode::*;

    #[test]
    fn a_write_holder_may_read_but_a_reader_may_not_write() {
        assert!(covers(Exclusive, Exclusive));
        assert!(covers(Read, Read));
        assert!(covers(Write, Write));
        assert!(covers(Write, Read));
        assert!(!covers(Read, Write));
        assert!(!covers(Exclusive, Read));
        assert!(!covers(Semaphore { permits: 2 }, Semaphore { permits: 3 }));
        assert!(covers(Semaphore { permits: 2 }, Semaphore { permits: 2 }));
    }
}
