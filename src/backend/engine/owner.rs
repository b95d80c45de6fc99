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

    /// The seed and a count, in hex (written without formatting: one for
    /// every lock).
    pub(crate) fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut token = [0u8; 32];
        for (i, half) in [self.seed, n].into_iter().enumerate() {
            for (j, digit) in token[i * 16..(i + 1) * 16].iter_mut().enumerate() {
                *digit = b"0123456789abcdef"[((half >> ((15 - j) * 4)) & 0xf) as usize];
            }
        }
        String::from_utf8(token.to_vec()).expect("hex digits")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_token_is_the_seed_and_the_count_in_hex() {
        let tokens = super::Tokens::new();
        tokens.next();
        let token = tokens.next();
        assert_eq!(token, format!("{}{:016x}", tokens.prefix(), 1));
    }
}
