//! The signal that a held lock has been lost.
//!
//! A remote lock lives on a lease (a TTL, a session). When the backend cannot
//! renew it, or finds it taken over, it fires the lock's [`LostTrigger`]; the
//! holder sees that through its [`LostSignal`]: [`is_lost`](LostSignal::is_lost)
//! to check, [`lost`](LostSignal::lost) to await.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use crate::loom::sync::atomic::{AtomicBool, Ordering};
use crate::loom::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// The state behind a [`LostSignal`]: whether the lock is lost, why, and who
/// waits to hear it.
///
/// Most backends use a [`LostTrigger`]. A backend that already allocates per
/// lock can embed a `LostState` in that allocation and implement
/// [`HasLostState`], saving an allocation per acquisition.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use tower_lock::LostSignal;
/// use tower_lock::backend::{HasLostState, LostState};
///
/// /// A backend's state for one lock, the lost state inside it.
/// struct Hold {
///     lost: LostState,
///     // ... the backend's own fields
/// }
///
/// impl HasLostState for Hold {
///     fn lost_state(&self) -> &LostState {
///         &self.lost
///     }
/// }
///
/// let hold = Arc::new(Hold { lost: LostState::new() });
/// let signal = LostSignal::new(hold.clone()); // handed to the holder
/// hold.lost.fire("session expired");
/// assert!(hold.lost.is_fired());
/// assert_eq!(signal.reason(), Some("session expired"));
/// ```
pub struct LostState {
    lost: AtomicBool,
    // `Box<str>`, not `String`: a few bytes less in every lock's state.
    reason: OnceLock<Box<str>>,
    wakers: Mutex<Vec<Waker>>,
    /// Whether a waker was ever pushed: most locks are never awaited, and
    /// their release then need not take the lock above to find none.
    awaited: AtomicBool,
}

impl LostState {
    /// A state that has not fired.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        LostState {
            lost: AtomicBool::new(false),
            reason: OnceLock::new(),
            wakers: Mutex::new(Vec::new()),
            awaited: AtomicBool::new(false),
        }
    }

    /// A state that has not fired (loom's types are not made in const).
    #[cfg(loom)]
    pub fn new() -> Self {
        LostState {
            lost: AtomicBool::new(false),
            reason: OnceLock::new(),
            wakers: Mutex::new(Vec::new()),
            awaited: AtomicBool::new(false),
        }
    }

    /// Makes a state nobody else points at as good as new, for its
    /// allocation's reuse. One that never fired and was never awaited is
    /// new already: two loads, where rebuilding it dropped its fields.
    pub(crate) fn reset(&mut self) {
        if self.lost.load(Ordering::Relaxed) || self.awaited.load(Ordering::Relaxed) {
            *self = LostState::new();
        }
    }

    /// Marks the lock lost and wakes everyone awaiting it. Only the first call
    /// counts; later reasons are ignored.
    pub fn fire(&self, reason: impl Into<String>) {
        for w in self.mark(reason) {
            w.wake();
        }
    }

    /// Marks the lock lost, as [`fire`](Self::fire) does, and returns the
    /// wakers to wake: for a backend that must mark it under a lock of its
    /// own (before it lets anyone else have the key) and wake outside it.
    pub(crate) fn mark(&self, reason: impl Into<String>) -> Vec<Waker> {
        let _ = self.reason.set(reason.into().into_boxed_str());
        self.lost.store(true, Ordering::Release);
        std::mem::take(&mut *self.wakers())
    }

    /// Takes the wakers of the tasks awaiting the loss, to be dropped: for a
    /// lock released, which can no longer be lost.
    pub(crate) fn take_wakers(&self) -> Vec<Waker> {
        if !self.awaited.load(Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.wakers())
    }

    /// The wakers' list; a poisoned lock must not lose a wake-up.
    fn wakers(&self) -> MutexGuard<'_, Vec<Waker>> {
        crate::sync::lock(&self.wakers)
    }

    /// Whether [`fire`](Self::fire) was called.
    pub fn is_fired(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

impl Default for LostState {
    fn default() -> Self {
        Self::new()
    }
}

/// An allocation that holds a [`LostState`], so that a [`LostSignal`] can
/// point into it.
///
/// # Examples
///
/// A hold known alive until a deadline (a real backend moves it on with
/// each renewal) reports itself expired once the deadline has passed, even
/// if the task that would fire the signal has not run:
///
/// ```
/// use std::sync::Arc;
/// use std::time::{Duration, Instant};
/// use tower_lock::LostSignal;
/// use tower_lock::backend::{HasLostState, LostState};
///
/// struct Hold {
///     lost: LostState,
///     valid_until: Instant,
/// }
///
/// impl HasLostState for Hold {
///     fn lost_state(&self) -> &LostState {
///         &self.lost
///     }
///
///     fn expired(&self) -> Option<String> {
///         (Instant::now() >= self.valid_until).then(|| "the lease ran out".to_owned())
///     }
/// }
///
/// let hold = |valid_for| Arc::new(Hold { lost: LostState::new(), valid_until: Instant::now() + valid_for });
/// let live = LostSignal::new(hold(Duration::from_secs(10)));
/// assert!(!live.is_lost());
/// let stale = LostSignal::new(hold(Duration::ZERO));
/// assert!(stale.is_lost());
/// assert_eq!(stale.reason(), Some("the lease ran out"));
/// ```
pub trait HasLostState: Send + Sync + 'static {
    /// The embedded state.
    fn lost_state(&self) -> &LostState;

    /// Why the lock is no longer known held, when its lease or session is
    /// past the moment it was known alive until but the task that fires the
    /// signal has not run yet (the process was paused, say). Checked each
    /// time the signal is looked at, so a holder that runs again after a
    /// pause is told before it does anything else. Default: never.
    fn expired(&self) -> Option<String> {
        None
    }
}

impl HasLostState for LostState {
    fn lost_state(&self) -> &LostState {
        self
    }
}

/// The backend's side of a [`LostSignal`]: fires it once.
///
/// Backends make one per acquisition with [`LostTrigger::new`], keep the
/// trigger and hand [`LostTrigger::signal`] to the holder.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tower_lock::backend::LostTrigger;
///
/// let trigger = LostTrigger::new(); // kept by the backend's renewal task
/// let signal = trigger.signal(); // handed to the holder
/// let holder = tokio::spawn(async move {
///     signal.lost().await;
///     signal.reason().map(str::to_owned)
/// });
///
/// trigger.fire("renewing the lease failed");
/// trigger.fire("ignored: only the first reason counts");
/// assert!(trigger.is_fired());
/// assert_eq!(holder.await.unwrap().as_deref(), Some("renewing the lease failed"));
/// # }
/// ```
#[derive(Clone)]
pub struct LostTrigger(Arc<LostState>);

impl LostTrigger {
    /// A trigger that has not fired.
    pub fn new() -> Self {
        LostTrigger(Arc::new(LostState::new()))
    }

    /// The holder's side.
    pub fn signal(&self) -> LostSignal {
        LostSignal(Some(self.0.clone()))
    }

    /// Marks the lock lost and wakes everyone awaiting it. Only the first call
    /// counts; later reasons are ignored.
    pub fn fire(&self, reason: impl Into<String>) {
        self.0.fire(reason);
    }

    /// Whether [`fire`](Self::fire) was called.
    pub fn is_fired(&self) -> bool {
        self.0.is_fired()
    }
}

impl Default for LostTrigger {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LostTrigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LostTrigger")
            .field("fired", &self.is_fired())
            .finish()
    }
}

/// Tells a holder that its lock was lost: the lease could not be renewed,
/// the session expired, or an operator broke the lock.
///
/// Cheap to clone. A signal from [`LostSignal::never`] never fires.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let guard = backend.lock("sku-1").await?;
/// let signal = guard.held().lost_signal().clone();
/// assert!(!signal.is_lost());
///
/// backend.break_lock("sku-1"); // as a lease that ran out would
/// assert!(signal.is_lost());
/// assert_eq!(signal.reason(), Some("the lock was broken by an operator"));
///
/// // Long work races the signal, and stops once the lock is gone.
/// let outcome = tokio::select! {
///     _ = signal.lost() => "stopped: lock lost",
///     _ = tokio::time::sleep(Duration::from_secs(60)) => "done",
/// };
/// assert_eq!(outcome, "stopped: lock lost");
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct LostSignal(Option<Arc<dyn HasLostState>>);

impl LostSignal {
    /// A signal that never fires.
    pub const fn never() -> Self {
        LostSignal(None)
    }

    /// The signal of the state inside `source`.
    pub fn new(source: Arc<dyn HasLostState>) -> Self {
        LostSignal(Some(source))
    }

    /// The state, with the signal fired first if the source has expired.
    fn state(&self) -> Option<&LostState> {
        let source = self.0.as_deref()?;
        let state = source.lost_state();
        if !state.is_fired() {
            if let Some(reason) = source.expired() {
                state.fire(reason);
            }
        }
        Some(state)
    }

    /// Whether the lock has been lost.
    pub fn is_lost(&self) -> bool {
        self.state().is_some_and(LostState::is_fired)
    }

    /// Why the lock was lost, once it has been.
    pub fn reason(&self) -> Option<&str> {
        self.state()
            .filter(|s| s.is_fired())
            .and_then(|s| s.reason.get().map(|r| &**r))
    }

    /// Completes when the lock is lost; never, for a lock that cannot be.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future loses nothing.
    pub fn lost(&self) -> Lost {
        Lost(self.clone())
    }

    /// Polls for loss, registering `cx`'s waker to be woken when it happens.
    pub fn poll_lost(&self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(shared) = self.state() else {
            return Poll::Pending;
        };
        if shared.lost.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        let mut wakers = shared.wakers();
        // Checked again under the lock: `fire` sets the flag before it takes
        // the wakers, so a waker pushed now is either taken or not needed.
        if shared.lost.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
            shared.awaited.store(true, Ordering::Release);
        }
        Poll::Pending
    }

    /// Whether this signal can ever fire (false for [`LostSignal::never`]).
    pub fn can_fire(&self) -> bool {
        self.0.is_some()
    }
}

impl fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LostSignal")
            .field("lost", &self.is_lost())
            .field("reason", &self.reason())
            .finish()
    }
}

/// Future returned by [`LostSignal::lost`]: completes when the lock is lost.
///
/// # Cancel safety
///
/// Cancel safe: dropping it loses nothing, and a new one can be made at
/// any time.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use tower_lock::{Lost, LostSignal};
/// use tower_lock::backend::LostTrigger;
///
/// let trigger = LostTrigger::new();
/// let lost: Lost = trigger.signal().lost();
/// trigger.fire("session expired");
/// lost.await;
///
/// // A signal that cannot fire never completes.
/// let never = LostSignal::never().lost();
/// assert!(tokio::time::timeout(Duration::from_millis(10), never).await.is_err());
/// # }
/// ```
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct Lost(LostSignal);

impl Future for Lost {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.poll_lost(cx)
    }
}

cfg_remote! {
    /// The moment until which a lease or session is known alive, shared between
    /// the task that renews it and the holds that check it.
    pub(crate) struct Deadline {
        base: std::time::Instant,
        /// Nanoseconds after `base`.
        after: std::sync::atomic::AtomicU64,
    }
}

cfg_remote! {
    impl Deadline {
        pub(crate) fn new(at: std::time::Instant) -> Self {
            Deadline {
                base: at,
                after: std::sync::atomic::AtomicU64::new(0),
            }
        }

        pub(crate) fn get(&self) -> std::time::Instant {
            self.base + std::time::Duration::from_nanos(self.after.load(Ordering::Acquire))
        }

        /// Moves the deadline to `at`, never back.
        pub(crate) fn extend(&self, at: std::time::Instant) {
            let after = at.saturating_duration_since(self.base).as_nanos() as u64;
            self.after.fetch_max(after, Ordering::AcqRel);
        }

        pub(crate) fn passed(&self) -> bool {
            std::time::Instant::now() >= self.get()
        }

        /// How long until the deadline (zero once it has passed).
        pub(crate) fn left(&self) -> std::time::Duration {
            self.get()
                .saturating_duration_since(std::time::Instant::now())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fires_once_and_wakes() {
        let trigger = LostTrigger::new();
        let signal = trigger.signal();
        assert!(!signal.is_lost());
        let waiter = tokio::spawn({
            let s = signal.clone();
            async move { s.lost().await }
        });
        tokio::task::yield_now().await;
        trigger.fire("lease expired");
        trigger.fire("ignored");
        waiter.await.unwrap();
        assert!(signal.is_lost());
        assert_eq!(signal.reason(), Some("lease expired"));
    }

    #[test]
    fn never_never_fires() {
        let s = LostSignal::never();
        assert!(!s.is_lost());
        assert!(!s.can_fire());
    }
}
