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
use crate::guard::{LockGuard, Share};
use crate::key::LockKey;
use crate::mode::LockMode;

tokio::task_local! {
    static REQUEST: RefCell<RequestLocks>;
}

/// The locks one request holds. Weak, so that a lock released early by the
/// handler is not kept alive here.
#[derive(Default)]
pub(crate) struct RequestLocks {
    // The layer's lock; the `Vec` only allocates when a handler takes more.
    first: Option<Weak<Share>>,
    more: Vec<Weak<Share>>,
}

/// `future`, run with `guard` (the layer's lock) as the request's first lock.
pub(crate) fn scope<F: Future>(
    guard: Option<&LockGuard>,
    future: F,
) -> TaskLocalFuture<RefCell<RequestLocks>, F> {
    let locks = RequestLocks {
        first: guard.map(|g| Arc::downgrade(g.share())),
        more: Vec::new(),
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
            let share = locks
                .first
                .iter()
                .chain(&locks.more)
                .filter_map(Weak::upgrade)
                .find(|s| s.backend_id == backend_id && s.held.key == *key)?;
            let held = share.held.mode;
            Some(if covers(held, mode) {
                Ok(LockGuard::nested(share))
            } else {
                Err(LockError::Reentry {
                    key: key.clone(),
                    held,
                    wanted: mode,
                })
            })
        })
        .ok()
        .flatten()
}

/// Records a lock the request's handler took, so that a later acquisition
/// of the same key in the same request re-enters it.
pub(crate) fn record(guard: &LockGuard) {
    let _ = REQUEST.try_with(|locks| {
        let mut locks = locks.borrow_mut();
        // Forget released locks, so a handler taking many in turn does not
        // grow the list.
        locks.more.retain(|w| w.strong_count() > 0);
        locks.more.push(Arc::downgrade(guard.share()));
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
