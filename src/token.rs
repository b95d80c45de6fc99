//! Fencing tokens.

use std::fmt;

/// A number that strictly increases with every acquisition of one key.
///
/// Pass it to the storage the lock protects and have the storage refuse a
/// write carrying a token lower than one it has already seen. That turns the
/// one failure no lease-based lock can prevent, a holder paused past its lease
/// while another process takes the key, into a rejected write instead of lost
/// data (M. Kleppmann, "How to do distributed locking", 2016).
///
/// Tokens from different keys are not comparable. Each backend documents where
/// its tokens come from and how long they stay monotonic.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let first = backend.lock("invoice-7").await.unwrap();
/// let t1 = first.token();
/// drop(first);
/// let second = backend.lock("invoice-7").await.unwrap();
/// assert!(second.token() > t1);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a backend's raw token.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The token as a number, for storage.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}
