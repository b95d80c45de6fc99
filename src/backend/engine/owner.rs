//! Owner tokens: who holds a remote lock, unique across processes.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

/// Random owner tokens: a per-backend random prefix and a counter.
pub(crate) struct Tokens {
    seed: u64,
    next: AtomicU64,
}

impl Tokens {
    pub(crate) fn new() -> Self {
        // `RandomState` is seeded from the OS's randomness.
        let seed = std::collections::hash_map::RandomState::new()
            .hash_one((std::process::id(), std::time::SystemTime::now()));
        Tokens {
            seed,
            next: AtomicU64::new(0),
        }
    }

    /// The part every token of this backend begins with: 16 characters,
    /// which the Redis queue's scripts cut a token's owner from.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn prefix(&self) -> String {
        format!("{:016x}", self.seed)
    }

    pub(crate) fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{n:016x}", self.seed)
    }
}
