//! Re-entrancy: the locks the request being served already holds.
//!
//! The [`LockLayer`](crate::LockLayer) calls and polls the inner service
//! inside a thread-local scope that lists the request's locks:
//! the layer's own, then every lock the handler takes while it runs. An
//! acquisition that finds its key there, through the same backend, does not
//! ask the backend (it would wait for itself): it gets a nested guard on the
//! same lock, or at once an error if the modes cannot share. A layer inside
//! another copies the outer layers' locks into its scope. The scope is set
//! only while the inner service is called or polled: the inner future is
//! dropped outside it.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use crate::error::LockError;
use crate::guard::{HeldLock, LockGuard, SharedLease};
use crate::key::LockKey;
use crate::lost::LostSignal;
use crate::mode::LockMode;

// A reference to the request's locks, set while its service runs: only a
// pointer is swapped in and out at each poll, where a value-holding task
// local would copy the whole list in and out.
scoped_tls::scoped_thread_local!(static REQUEST: RequestLocks);

/// The locks one request holds: the layer's own guard, which it releases
/// when the response is ready (so nested guards only borrow it), those of
/// the layers around it, and those its handler took, weakly, so that one
/// released early is not kept alive here. It lives in the layer's response
/// future.
pub(crate) struct RequestLocks {
    /// The layer's guard and the [`Backend::instance_id`](crate::Backend::instance_id)
    /// of its backend.
    layer: Option<(usize, LockGuard)>,
    /// The locks of the layers this one runs inside, innermost last: the
    /// scope of an inner layer hides the outer one's. Empty (no allocation)
    /// unless layers are nested.
    outer: Vec<(usize, HeldLock)>,
    // The `Vec` only allocates when a handler takes locks.
    taken: RefCell<Vec<Weak<SharedLease>>>,
}

impl RequestLocks {
    /// The locks of a request that holds the layer's `guard` (none when it
    /// passed through unlocked), taken through the backend `backend_id`,
    /// inside the scope of any layer around this one.
    pub(crate) fn new(layer: Option<(usize, LockGuard)>) -> Self {
        let outer = in_request(|around| {
            let mut outer = around.outer.clone();
            outer.extend(around.layer.as_ref().map(|(id, g)| (*id, g.held().clone())));
            outer
        });
        RequestLocks {
            layer,
            outer: outer.unwrap_or_default(),
            taken: RefCell::default(),
        }
    }

    /// Every layer's lock in this scope, innermost first.
    fn layer_locks(&self) -> impl Iterator<Item = (usize, &HeldLock)> {
        let own = self.layer.as_ref().map(|(id, g)| (*id, g.held()));
        own.into_iter()
            .chain(self.outer.iter().rev().map(|(id, held)| (*id, held)))
    }

    /// Runs `f` (a call or a poll of the inner service) as this request.
    pub(crate) fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        REQUEST.set(self, f)
    }

    /// The lost signal of the layer's lock.
    pub(crate) fn layer_lost(&self) -> Option<&LostSignal> {
        self.layer.as_ref().map(|(_, g)| g.held().lost_signal())
    }

    /// Takes the layer's guard out, to release it or hand it to the body.
    pub(crate) fn take_layer(&mut self) -> Option<LockGuard> {
        self.layer.take().map(|(_, g)| g)
    }
}

/// `f` on the locks of the request being served; `None` outside one.
fn in_request<R>(f: impl FnOnce(&RequestLocks) -> R) -> Option<R> {
    REQUEST.is_set().then(|| REQUEST.with(f))
}

// `HeldLock::current` lives here, beside the request's locks it reads:
// the guards know nothing of requests.
impl HeldLock {
    /// The lock the [`LockLayer`](crate::LockLayer) holds for the request
    /// being served (with nested layers, the innermost that holds one):
    /// `Some` while its inner service is called and its response future
    /// polled, `None` elsewhere (outside a layer, on a request the layer
    /// passed through unlocked, in a task the handler spawned: take it
    /// before spawning).
    ///
    /// The layer puts it in the request extensions only when asked to
    /// ([`LockLayer::held_lock_extension`](crate::LockLayer::held_lock_extension)):
    /// that costs every request an allocation, and the layer already keeps it.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tower_lock::{HeldLock, LockBody, LockLayer, MemoryBackend, QueryParam};
    ///
    /// let service = ServiceBuilder::new()
    ///     .layer(LockLayer::new(MemoryBackend::new(), QueryParam("account")))
    ///     .service_fn(|_req: Request<()>| async {
    ///         let held = HeldLock::current().expect("under the layer");
    ///         let body = LockBody::wrap(Full::new(Bytes::from(held.key().to_string())));
    ///         Ok::<_, std::convert::Infallible>(Response::new(body))
    ///     });
    /// let res = service.oneshot(Request::post("/?account=7").body(()).unwrap()).await.unwrap();
    /// assert_eq!(res.status(), 200);
    /// assert!(HeldLock::current().is_none(), "not while serving a request");
    /// # }
    /// ```
    pub fn current() -> Option<HeldLock> {
        layer_lock()
    }
}

/// The lock the innermost layer that holds one holds for the request being
/// served, if any.
pub(crate) fn layer_lock() -> Option<HeldLock> {
    in_request(|locks| locks.layer_locks().next().map(|(_, held)| held.clone())).flatten()
}

/// Whether the request being served holds `held` as a layer's lock on the
/// backend `backend_id`: where a nested guard on it is still backed.
pub(crate) fn holds_layer_lock(backend_id: usize, held: &HeldLock) -> bool {
    in_request(|locks| {
        locks
            .layer_locks()
            .any(|(id, h)| id == backend_id && h.key == held.key && h.token == held.token)
    })
    .unwrap_or(false)
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
    in_request(|locks| {
        let held_by_layer = locks
            .layer_locks()
            .find(|(id, held)| *id == backend_id && held.key == *key);
        if let Some((_, held)) = held_by_layer {
            return Some(nest(held, mode, || LockGuard::borrowed(held.clone())));
        }
        let shared = locks
            .taken
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .find(|s| s.backend_id == backend_id && s.held.key == *key)?;
        Some(nest(&shared.held, mode, || {
            LockGuard::nested(shared.clone())
        }))
    })
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
    in_request(|locks| {
        let Some(shared) = guard.share(backend_id) else {
            return;
        };
        let mut taken = locks.taken.borrow_mut();
        // Forget released locks, so a handler taking many in turn does not
        // grow the list.
        taken.retain(|w| w.strong_count() > 0);
        taken.push(Arc::downgrade(shared));
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
