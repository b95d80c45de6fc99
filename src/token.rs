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
///
/// The storage side: accept a write only from the latest holder (the same
/// holder may write several times), in SQL `... WHERE fence <= $token`:
///
/// ```
/// use tower_lock::FencingToken;
///
/// #[derive(Default)]
/// struct Fenced {
///     fence: Option<FencingToken>,
///     value: String,
/// }
///
/// impl Fenced {
///     fn write(&mut self, token: FencingToken, value: &str) -> Result<(), String> {
///         if let Some(fence) = self.fence.filter(|fence| token < *fence) {
///             return Err(format!("stale token {token}: the store has seen {fence}"));
///         }
///         self.fence = Some(token);
///         self.value = value.to_owned();
///         Ok(())
///     }
/// }
///
/// let mut store = Fenced::default();
/// store.write(FencingToken::new(8), "from the new holder").unwrap();
/// // A holder paused past its lease wakes up and writes: refused.
/// assert!(store.write(FencingToken::new(7), "from the old holder").is_err());
/// assert_eq!(store.value, "from the new holder");
/// assert_eq!(FencingToken::new(8).get(), 8);
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
