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
/// Cheap to clone. The [`LockLayer`](crate::LockLayer) puts one in the request
/// extensions; with the `axum` feature a handler takes it as an extractor.
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
    /// Shared with the nested guards of a re-entered lock; `None` once
    /// released. The last guard to let go releases the lock.
    share: Option<Arc<Share>>,
    /// Read only when the span or metrics record it: a clock read per lock
    /// is a measurable share of the uncontended path.
    acquired_at: Option<Instant>,
    span: tracing::Span,
}

/// What the guards of one acquisition share: the description, the backend's
/// handle, and which backend instance took it (for re-entrancy).
pub(crate) struct Share {
    pub(crate) held: HeldLock,
    pub(crate) handle: Arc<dyn LeaseHandle>,
    pub(crate) backend_id: usize,
}

impl LockGuard {
    pub(crate) fn new(
        held: HeldLock,
        handle: Arc<dyn LeaseHandle>,
        backend_id: usize,
        span: tracing::Span,
    ) -> Self {
        let timed = !span.is_disabled() || cfg!(feature = "metrics");
        LockGuard {
            share: Some(Arc::new(Share {
                held,
                handle,
                backend_id,
            })),
            acquired_at: timed.then(Instant::now),
            span,
        }
    }

    /// A second guard on a lock this task already holds (re-entry): same
    /// key and token; the lock is released when the last guard lets go.
    pub(crate) fn nested(share: Arc<Share>) -> Self {
        LockGuard {
            share: Some(share),
            acquired_at: None,
            span: tracing::Span::none(),
        }
    }

    pub(crate) fn share(&self) -> &Arc<Share> {
        self.share.as_ref().expect("share present until released")
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
        &self.share().held
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
        let share = self.share.take().expect("share present until released");
        // A re-entered lock stays held until its last guard lets go.
        let Some(share) = Arc::into_inner(share) else {
            return Ok(());
        };
        let result = share.handle.release().await;
        self.record_release(&share.held, &result);
        result
    }

    fn record_release(&self, held: &HeldLock, result: &Result<(), LockError>) {
        let hold = self.acquired_at.map(|at| at.elapsed());
        if let Some(hold) = hold {
            self.span.record("hold_us", hold.as_micros() as u64);
        }
        crate::metrics::released(held, hold);
        match result {
            Ok(()) => tracing::debug!(parent: &self.span, "lock released"),
            Err(e) => tracing::warn!(parent: &self.span, error = %e, "lock release failed"),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(share) = self.share.take() else {
            return;
        };
        if let Some(share) = Arc::into_inner(share) {
            self.record_release(&share.held, &Ok(()));
            share.handle.release_on_drop();
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.share.as_ref().map(|s| &s.held.key))
            .field("mode", &self.share.as_ref().map(|s| s.held.mode))
            .field("token", &self.share.as_ref().map(|s| s.held.token))
            .finish_non_exhaustive()
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
                if g.held().lost.poll_lost(cx).is_ready() {
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
