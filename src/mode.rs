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
