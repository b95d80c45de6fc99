//! What a holder has: [`LockGuard`] (releases on drop), [`HeldLock`] (a
//! cloneable description for handlers) and [`LockSet`] (several keys).

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::LeaseHandle;
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::{Lost, LostSignal};
use crate::mode::LockMode;
use crate::token::FencingToken;

/// A description of a held lock: key, mode, fencing token, how long the
/// acquisition waited, and the lost signal.
///
/// Cheap to clone. Under a [`LockLayer`](crate::LockLayer), the inner service
/// gets the request's with [`HeldLock::current`]; with the `axum` feature a
/// handler takes it as an extractor.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::{BackendExt, HeldLock, MemoryBackend};
///
/// fn audit(held: &HeldLock) -> String {
///     format!("{} held in {} mode, token {}", held.key(), held.mode(), held.token())
/// }
///
/// let guard = MemoryBackend::new().lock("sku-1").await?;
/// assert_eq!(audit(guard.held()), "sku-1 held in exclusive mode, token 1");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct HeldLock {
    pub(crate) key: LockKey,
    pub(crate) mode: LockMode,
    pub(crate) token: FencingToken,
    pub(crate) waited: Duration,
    pub(crate) backend: &'static str,
    pub(crate) lost: LostSignal,
}

impl HeldLock {
    /// The locked key (namespace included).
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The mode it is held in.
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// The fencing token of this acquisition: pass it to storage.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// How long the acquisition waited for the key.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The backend's name, e.g. `memory`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Whether the lock has been lost (lease not renewed, session expired,
    /// broken by an operator).
    pub fn is_lost(&self) -> bool {
        self.lost.is_lost()
    }

    /// Completes when the lock is lost. Race long work against it, or check
    /// [`is_lost`](Self::is_lost) before a side effect.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub fn lost(&self) -> Lost {
        self.lost.lost()
    }

    /// The underlying signal, to keep after this description is dropped.
    pub fn lost_signal(&self) -> &LostSignal {
        &self.lost
    }
}

/// A held lock, released when dropped.
///
/// Dropping releases at once on the memory backend; on remote ones it sends
/// the release and leaves its answer to the Tokio runtime (see
/// [`Backend::flush`](crate::Backend::flush)). [`release`](Self::release)
/// waits for the answer and reports errors.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let guard = backend.lock("sku-1").await?;
/// println!("holding {} with token {}", guard.key(), guard.token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[must_use = "if unused the lock is released at once"]
pub struct LockGuard {
    held: HeldLock,
    lease: Lease,
    /// The span and the time of the grant, kept only when a subscriber or
    /// the metrics record the hold: a clock read per lock is a measurable
    /// share of the uncontended path, and without them the guard is small
    /// enough to move without a call to `memcpy`.
    traced: Option<Box<Traced>>,
}

/// What a traced guard records when it lets go.
struct Traced {
    acquired_at: Instant,
    span: tracing::Span,
}

/// The parent of a guard's events when no subscriber wanted its span.
static NO_SPAN: tracing::Span = tracing::Span::none();

/// How a guard holds its lock.
enum Lease {
    /// This guard alone: the common case, with no shared state to allocate.
    Own(Arc<dyn LeaseHandle>),
    /// Shared with nested guards: a lock a handler took inside a request,
    /// which a later acquisition of the request may re-enter. The last
    /// guard to let go releases it.
    Shared(Arc<SharedLease>),
    /// A nested guard on the layer's own lock, which the layer releases
    /// when the response is ready.
    Borrowed,
    Released,
}

/// A lock shared by the guards of one request (see [`Lease::Shared`]).
pub(crate) struct SharedLease {
    pub(crate) held: HeldLock,
    pub(crate) backend_id: usize,
    /// Taken by the last guard to let go; `None` once it has.
    handle: Option<Arc<dyn LeaseHandle>>,
}

impl Drop for SharedLease {
    /// The last guard found another reference alive (the request's lock
    /// list looking it up, on the request's thread, while the guard was
    /// dropped on another): that reference, the last, releases the lock.
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            crate::metrics::held(self.held.backend, -1.0);
            crate::admin::released(self.held.backend, &self.held.key, self.held.token);
            handle.release_on_drop();
        }
    }
}

impl LockGuard {
    pub(crate) fn new(held: HeldLock, handle: Arc<dyn LeaseHandle>, span: tracing::Span) -> Self {
        let timed = !span.is_disabled() || cfg!(feature = "metrics");
        crate::metrics::held(held.backend, 1.0);
        crate::admin::granted(held.backend, &held.key, held.mode, held.token);
        LockGuard {
            held,
            lease: Lease::Own(handle),
            traced: timed.then(|| {
                Box::new(Traced {
                    acquired_at: Instant::now(),
                    span,
                })
            }),
        }
    }

    /// A nested guard on a lock the request holds through `shared`.
    pub(crate) fn nested(shared: Arc<SharedLease>) -> Self {
        LockGuard {
            held: shared.held.clone(),
            lease: Lease::Shared(shared),
            traced: None,
        }
    }

    /// A nested guard on the layer's lock, described by `held`.
    pub(crate) fn borrowed(held: HeldLock) -> Self {
        LockGuard {
            held,
            lease: Lease::Borrowed,
            traced: None,
        }
    }

    /// Whether this is a nested guard on the layer's lock, which holds
    /// nothing of its own.
    pub(crate) fn is_borrowed(&self) -> bool {
        matches!(self.lease, Lease::Borrowed)
    }

    /// Makes this guard's lock shareable with nested guards, and returns the
    /// shared part for the request's list.
    pub(crate) fn share(&mut self, backend_id: usize) -> Option<&Arc<SharedLease>> {
        if let Lease::Own(handle) = &self.lease {
            self.lease = Lease::Shared(Arc::new(SharedLease {
                held: self.held.clone(),
                backend_id,
                handle: Some(handle.clone()),
            }));
        }
        match &self.lease {
            Lease::Shared(shared) => Some(shared),
            _ => None,
        }
    }

    /// The backend's handle, if this guard is the one to release the lock.
    /// The handle to release, if this guard is the one to release it; no
    /// longer counted as held from here, whether or not the release that
    /// follows completes.
    fn take_handle(&mut self) -> Option<Arc<dyn LeaseHandle>> {
        let handle = match std::mem::replace(&mut self.lease, Lease::Released) {
            Lease::Own(handle) => Some(handle),
            Lease::Shared(shared) => Arc::into_inner(shared).and_then(|mut s| s.handle.take()),
            Lease::Borrowed | Lease::Released => None,
        };
        if handle.is_some() {
            crate::metrics::held(self.held.backend(), -1.0);
            crate::admin::released(self.held.backend, &self.held.key, self.held.token);
        }
        handle
    }

    /// The locked key.
    pub fn key(&self) -> &LockKey {
        &self.held().key
    }

    /// The mode it is held in.
    pub fn mode(&self) -> LockMode {
        self.held().mode
    }

    /// The fencing token: strictly greater than any earlier acquisition's of
    /// the same key.
    pub fn token(&self) -> FencingToken {
        self.held().token
    }

    /// Whether the lock has been lost.
    pub fn is_lost(&self) -> bool {
        self.held().lost.is_lost()
    }

    /// Completes when the lock is lost; never on a backend that cannot lose
    /// it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub fn lost(&self) -> Lost {
        self.held().lost.lost()
    }

    /// The cloneable description of this lock.
    pub fn held(&self) -> &HeldLock {
        &self.held
    }

    /// Releases the lock and waits until the backend confirms (on Redis, a
    /// lock handed to this process's next waiter for the key needs no
    /// confirmation: it stays taken in Redis for that waiter).
    ///
    /// Dropping the guard releases it too, without waiting: the remote
    /// backends send the release and await its answer in the background, and
    /// anything the same backend sends later (the next acquire of this key,
    /// say) reaches the server after it. Before a process exits, call
    /// [`Backend::flush`](crate::Backend::flush) to wait for those answers.
    ///
    /// A guard from a [re-entered](crate::Locker#re-entrancy) lock shares it
    /// with the guard it re-entered: releasing one of them returns `Ok` at
    /// once, and the lock is released when the last of them is.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes does not leave the lock held:
    /// the guard is consumed when the future is made, and a release already
    /// sent is finished in the background, as when a guard is dropped (see
    /// [`Backend::flush`](crate::Backend::flush)). Only the answer, and so
    /// any error, is lost.
    ///
    /// # Errors
    ///
    /// A backend error. When the release may not have reached the server
    /// (a broken connection), it is sent again in the background; at worst
    /// the lock ends with its lease or session.
    pub async fn release(mut self) -> Result<(), LockError> {
        // A re-entered lock stays held until its last guard lets go.
        let Some(handle) = self.take_handle() else {
            return Ok(());
        };
        let result = handle.release().await;
        self.record_release(&result);
        result
    }

    fn record_release(&self, result: &Result<(), LockError>) {
        let hold = self.traced.as_ref().map(|t| t.acquired_at.elapsed());
        let span = self.traced.as_ref().map_or(&NO_SPAN, |t| &t.span);
        if let Some(hold) = hold {
            span.record("hold_us", hold.as_micros() as u64);
        }
        crate::metrics::released(self.held.backend(), || self.held.is_lost(), hold);
        match result {
            Ok(()) => tracing::debug!(parent: span, "lock released"),
            Err(e) => tracing::warn!(parent: span, error = %e, "lock release failed"),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(handle) = self.take_handle() {
            self.record_release(&Ok(()));
            handle.release_on_drop();
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.held.key)
            .field("mode", &self.held.mode)
            .field("token", &self.held.token)
            .field("lost", &self.held.lost.is_lost())
            .finish()
    }
}

/// Several locks taken together, all or nothing; released together.
///
/// Guards are in the canonical (sorted) key order they were taken in.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let set = backend.lock_all(["acct:2", "acct:1"]).await?;
/// assert_eq!(set.len(), 2);
/// assert_eq!(set.guards()[0].key().as_str(), "acct:1");
/// let token = set.get("acct:2").unwrap().token();
/// println!("moving money under token {token}");
/// set.release().await?;
/// # Ok(()) }
/// ```
#[must_use = "if unused the locks are released at once"]
#[derive(Debug)]
pub struct LockSet {
    pub(crate) guards: Vec<LockGuard>,
}

impl LockSet {
    /// The guards, in key order.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// The guard of `key`, if it is in the set.
    pub fn get(&self, key: &str) -> Option<&LockGuard> {
        self.guards
            .binary_search_by(|g| g.key().as_str().cmp(key))
            .ok()
            .map(|i| &self.guards[i])
    }

    /// How many locks are held.
    pub fn len(&self) -> usize {
        self.guards.len()
    }

    /// Whether the set is empty (it was asked for no key).
    pub fn is_empty(&self) -> bool {
        self.guards.is_empty()
    }

    /// Whether any of the locks has been lost.
    pub fn is_lost(&self) -> bool {
        self.guards.iter().any(LockGuard::is_lost)
    }

    /// Completes when any of the locks is lost.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lost(&self) {
        poll_fn(|cx| {
            for g in &self.guards {
                if g.held.lost.poll_lost(cx).is_ready() {
                    return Poll::Ready(());
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Releases every lock, in reverse order, and reports the first error.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes releases every lock it has
    /// not reached yet as dropping a [`LockGuard`] does, in the background;
    /// none is left held. Only the answers, and so any error, are lost.
    ///
    /// # Errors
    ///
    /// The first backend error; the other locks are released all the same.
    pub async fn release(mut self) -> Result<(), LockError> {
        let mut first_err = None;
        while let Some(g) = self.guards.pop() {
            if let Err(e) = g.release().await {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for LockSet {
    fn drop(&mut self) {
        // Reverse order, as release does.
        while let Some(g) = self.guards.pop() {
            drop(g);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{BackendExt, MemoryBackend};

    /// The request's lock list briefly holds a shared lock's last reference
    /// while its last guard is dropped (on another thread): the lock is
    /// released when that reference goes, not leaked.
    #[tokio::test]
    async fn a_shared_lock_outliving_its_guards_is_released_by_its_last_reference() {
        let backend = MemoryBackend::new();
        let mut guard = backend.lock("k").await.unwrap();
        let looked_up = guard.share(1).expect("an own lock can be shared").clone();
        drop(guard);
        assert_eq!(backend.active_keys(), 1, "released under a live reference");
        drop(looked_up);
        assert_eq!(backend.active_keys(), 0, "the lock leaked");
    }
}
