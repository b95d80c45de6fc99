//! [`Capabilities`]: what a backend offers the core and [`Cohort`](super::Cohort).

#[cfg(doc)]
use super::{Cohort, LeaseHandle, LockRequest};
use crate::mode::LockMode;
#[cfg(doc)]
use crate::Backend;

/// What a [`Backend`] can do, for the core and for [`Cohort`]. See the
/// [module documentation](super#how-remote-backends-and-cohorting-plug-in)
/// for why each is asked.
///
/// # Examples
///
/// ```
/// use tower_lock::backend::Capabilities;
/// use tower_lock::{Backend, LockMode, MemoryBackend};
///
/// let redlock_like = Capabilities::new().exclusive_only().max_tokens(64).ordered_release(true);
/// assert!(!redlock_like.supports(LockMode::Read));
/// assert_eq!(redlock_like.max_tokens, 64);
/// assert!(MemoryBackend::new().capabilities().supports(LockMode::Semaphore { permits: 3 }));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Read and write locks.
    pub read_write: bool,
    /// Semaphores.
    pub semaphore: bool,
    /// The most fencing tokens one grant can reserve
    /// ([`LockRequest::tokens`]); 1 when it cannot reserve a block.
    pub max_tokens: u32,
    /// A release whose future was polled once (or handed to
    /// [`LeaseHandle::release_on_drop`], which returns once it is sent) is
    /// applied by the server before anything this backend sends later.
    pub ordered_release: bool,
    /// The server serves waiters from every process in arrival order
    /// (ZooKeeper's sequential nodes). Redis keeps a queue for exclusive
    /// locks only, not on a Cluster, which waiters join only once they
    /// find the lock held: not FIFO.
    pub fifo: bool,
    /// An acquisition that finds the lock held waits for it in the server,
    /// whatever connection each request goes on: one sent before an earlier
    /// release is applied is granted once it is (MariaDB's `GET_LOCK`,
    /// without another round trip; etcd's queue of contender keys, through
    /// the watch it then sets up). (One that does not wait, or waits less
    /// than the release takes, may find the lock busy instead.)
    pub waits_in_server: bool,
}

impl Capabilities {
    /// Every mode, one token per grant, releases not ordered, no server queue,
    /// no waiting in the server.
    pub const fn new() -> Self {
        Capabilities {
            read_write: true,
            semaphore: true,
            max_tokens: 1,
            ordered_release: false,
            fifo: false,
            waits_in_server: false,
        }
    }

    /// Exclusive locks only.
    pub const fn exclusive_only(mut self) -> Self {
        self.read_write = false;
        self.semaphore = false;
        self
    }

    /// Without the semaphore mode.
    pub const fn no_semaphore(mut self) -> Self {
        self.semaphore = false;
        self
    }

    /// Sets [`max_tokens`](Self::max_tokens) (at least 1).
    pub const fn max_tokens(mut self, tokens: u32) -> Self {
        self.max_tokens = if tokens == 0 { 1 } else { tokens };
        self
    }

    /// Sets [`ordered_release`](Self::ordered_release).
    pub const fn ordered_release(mut self, ordered: bool) -> Self {
        self.ordered_release = ordered;
        self
    }

    /// Sets [`fifo`](Self::fifo).
    pub const fn fifo(mut self, fifo: bool) -> Self {
        self.fifo = fifo;
        self
    }

    /// Sets [`waits_in_server`](Self::waits_in_server).
    pub const fn waits_in_server(mut self, waits: bool) -> Self {
        self.waits_in_server = waits;
        self
    }

    /// Whether `mode` is offered.
    pub const fn supports(&self, mode: LockMode) -> bool {
        match mode {
            LockMode::Exclusive => true,
            LockMode::Read | LockMode::Write => self.read_write,
            LockMode::Semaphore { .. } => self.semaphore,
        }
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Self::new()
    }
}
