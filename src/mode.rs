//! How a lock is held ([`LockMode`]) and how long an acquisition may wait
//! ([`Wait`]).

use std::fmt;
use std::time::Duration;

/// How a key is locked.
///
/// Use one family of modes per key: [`Exclusive`](LockMode::Exclusive) for a
/// plain mutex, [`Read`](LockMode::Read)/[`Write`](LockMode::Write) for a
/// read/write lock, [`Semaphore`](LockMode::Semaphore) with one permit count.
/// Remote backends store the families in different layouts (as Curator does),
/// so a mutex and a read/write lock on the same key do not exclude each other
/// there; the memory backend treats `Exclusive` and `Write` alike.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::{BackendExt, LockMode, MemoryBackend};
///
/// let backend = MemoryBackend::new();
///
/// // Readers share a key; a writer waits for them.
/// let first = backend.lock("catalog").mode(LockMode::Read).await?;
/// let second = backend.lock("catalog").read().await?;
/// assert!(backend.lock("catalog").mode(LockMode::Write).fail_fast().await.is_err());
/// drop((first, second));
///
/// // Two holders at most.
/// let exports = LockMode::Semaphore { permits: 2 };
/// let a = backend.lock("exports").mode(exports).await?;
/// let b = backend.lock("exports").mode(exports).await?;
/// assert!(backend.lock("exports").mode(exports).fail_fast().await.is_err());
/// assert_eq!(exports.to_string(), "semaphore(2)");
/// assert_eq!(exports.as_str(), "semaphore");
/// # drop((a, b)); Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LockMode {
    /// One holder at a time (a mutex). The default.
    #[default]
    Exclusive,
    /// Shared with other readers; excludes writers.
    Read,
    /// Excludes readers and other writers.
    Write,
    /// Up to `permits` holders at once. `permits` must be at least 1.
    Semaphore {
        /// How many holders may share the key.
        permits: u32,
    },
}

impl LockMode {
    /// A short name for traces and errors: `exclusive`, `read`, `write`,
    /// `semaphore`.
    pub fn as_str(&self) -> &'static str {
        match self {
            LockMode::Exclusive => "exclusive",
            LockMode::Read => "read",
            LockMode::Write => "write",
            LockMode::Semaphore { .. } => "semaphore",
        }
    }
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockMode::Semaphore { permits } => write!(f, "semaphore({permits})"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// How long an acquisition may wait for a busy key.
///
/// Wherever a wait is set (on [`LockLayer`](crate::LockLayer),
/// [`Locker`](crate::Locker) or one acquisition), a [`Duration`] will do for
/// [`Wait::Timeout`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::{BackendExt, LockError, MemoryBackend, Wait};
///
/// assert_eq!(Wait::default(), Wait::Timeout(Duration::from_secs(10)));
/// assert_eq!(Wait::from(Duration::from_millis(50)), Wait::Timeout(Duration::from_millis(50)));
///
/// let backend = MemoryBackend::new();
/// let held = backend.lock("sku-1").await?;
/// let busy = backend.lock("sku-1").wait(Wait::FailFast).await;
/// assert!(matches!(busy, Err(LockError::Busy)));
/// let late = backend.lock("sku-1").wait(Duration::from_millis(20)).await;
/// assert!(matches!(late, Err(LockError::Timeout { .. })));
/// # drop(held); Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Give up at once with [`LockError::Busy`](crate::LockError::Busy) if the
    /// key is held.
    FailFast,
    /// Wait up to this long, then give up with
    /// [`LockError::Timeout`](crate::LockError::Timeout).
    Timeout(Duration),
    /// Wait as long as it takes. Use with care: a request can then hang as
    /// long as the holder runs.
    Forever,
}

impl Wait {
    /// The default wait: 10 seconds.
    pub const DEFAULT: Wait = Wait::Timeout(Duration::from_secs(10));
}

impl Default for Wait {
    fn default() -> Self {
        Wait::DEFAULT
    }
}

impl From<Duration> for Wait {
    fn from(d: Duration) -> Self {
        Wait::Timeout(d)
    }
}
