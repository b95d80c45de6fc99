//! One acquisition asked of a [`Backend`], and the default lease.

use std::time::Duration;

#[cfg(doc)]
use super::{Acquired, Backend, Capabilities, Cohort, LeaseHandle};
use crate::key::LockKey;
use crate::mode::{LockMode, Wait};

/// One acquisition asked of a [`Backend`].
///
/// The core builds it from [`BackendExt::lock`](crate::BackendExt::lock) and
/// the layer's settings; backend tests build it by hand.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_lock::backend::LockRequest;
/// use tower_lock::{Backend, LockError, LockKey, LockMode, MemoryBackend, Wait};
///
/// let backend = MemoryBackend::new();
/// let request = LockRequest::new(LockKey::new("sku-1")?, LockMode::Exclusive)
///     .with_wait(Wait::FailFast)
///     .with_lease(Duration::from_secs(30));
/// let held = backend.acquire(request.clone()).await?;
/// assert!(matches!(backend.acquire(request).await, Err(LockError::Busy)));
/// drop(held); // releases
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LockRequest {
    /// The key, validated.
    pub key: LockKey,
    /// The mode, validated (a semaphore has at least one permit).
    pub mode: LockMode,
    /// The wait policy: how long, from this call, the core lets it wait.
    pub wait: Wait,
    /// How long a remote lock lives without renewal. Backends renew it while
    /// held; the memory backend has no use for it.
    pub lease: Duration,
    /// How many consecutive fencing tokens to reserve (at least 1, at most
    /// the backend's [`Capabilities::max_tokens`]): [`Cohort`] hands one
    /// grant to that many local holders in turn, each with its own token. A
    /// backend may reserve fewer, and says how many in
    /// [`Acquired::with_tokens`].
    pub tokens: u32,
    /// A hint from [`Cohort`], on a server without a queue: this
    /// process's acquisition of the key found it held or waited for here
    /// first (by another local holder, or a hand-off; not only for the
    /// answer to a release that asked for no hand-off), so others want it.
    /// A store may then hand off its release
    /// ([`LeaseHandle::may_hand_off`]) as it would a contended one's.
    pub contended: bool,
}

impl LockRequest {
    /// A request for `key` in `mode` with the default wait and lease, for
    /// backend tests.
    pub fn new(key: LockKey, mode: LockMode) -> Self {
        LockRequest {
            key,
            mode,
            wait: Wait::DEFAULT,
            lease: DEFAULT_LEASE,
            tokens: 1,
            contended: false,
        }
    }

    /// Sets the wait policy.
    pub fn with_wait(mut self, wait: Wait) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the lease.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets how many fencing tokens to reserve (at least 1).
    pub fn with_tokens(mut self, tokens: u32) -> Self {
        self.tokens = tokens.max(1);
        self
    }

    /// Sets [`contended`](Self::contended).
    pub fn with_contended(mut self, contended: bool) -> Self {
        self.contended = contended;
        self
    }
}

/// The default lease of a remote lock: 10 seconds, renewed every third of it
/// while held.
///
/// The lease bounds how long a crashed holder keeps its key from everyone
/// else (the torture harness measures it as `kill_recovery_ms`: about one
/// lease), so it is no longer than the default wait: a request that arrives
/// as a replica crashes still gets the key within its wait. Longer leases
/// only help holders that stall (a pause, an unanswered renewal) for more
/// than two thirds of one; they then lose the lock and are told.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::DEFAULT_LEASE;
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// assert_eq!(DEFAULT_LEASE, Duration::from_secs(10));
/// // A job that may stall longer asks for a longer lease:
/// let backend = MemoryBackend::new();
/// let guard = backend.lock("nightly-export").lease(Duration::from_secs(60)).await?;
/// # drop(guard); Ok(()) }
/// ```
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);
