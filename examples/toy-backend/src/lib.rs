//! A lock store written outside tower-lock: exclusive locks on Tokio
//! mutexes, one per key, in one process. It is the worked example of the
//! backend author's guide (`tower_lock::backend`'s module docs), small
//! enough to read whole, and it passes the same conformance suite as
//! every backend in the crate (`server-tests/tests/toy.rs`).
//!
//! What it shows, against the contract:
//!
//! - **Exclusion and order.** A key's Tokio mutex queues its waiters in
//!   the order they asked, and a waiting future that is dropped leaves the
//!   queue at once: cancellation needs no code of its own.
//! - **Fencing tokens.** Every grant takes the next number of one counter,
//!   so a key's tokens rise.
//! - **Release.** The [`LeaseHandle`] gives the mutex back before its
//!   future is polled, so a release whose future is dropped still
//!   releases; a grant dropped unreleased (the core drops one that raced a
//!   cancellation) gives it back as it drops.
//! - **Nothing left behind.** A key's entry is forgotten once no one holds
//!   or waits for it, so a map of a million keys seen once stays empty.
//! - **Re-entrancy.** Clones share one map, and say so through
//!   [`Backend::instance_id`]: a request re-locking its key through a
//!   clone re-enters instead of waiting for itself.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
//! use tower_lock::{BackendExt, LockError};
//! use toy_backend::ToyBackend;
//!
//! let toy = ToyBackend::new();
//! let first = toy.lock("order-1").await?;
//! assert!(matches!(toy.lock("order-1").fail_fast().await, Err(LockError::Busy)));
//! let earlier = first.token();
//! first.release().await?;
//! assert!(toy.lock("order-1").await?.token() > earlier);
//! assert_eq!(toy.keys(), 0);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;
use tower_lock::backend::{Acquired, BackendFuture, Capabilities, LeaseHandle, LockRequest};
use tower_lock::{Backend, FencingToken, LockError, LockMode, Wait};

/// Exclusive locks held in this process. Clones share their locks.
#[derive(Clone, Default)]
pub struct ToyBackend {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    /// Each key someone holds or waits for, and how many do.
    keys: Mutex<HashMap<String, Entry>>,
    /// The last token handed out, for every key.
    tokens: AtomicU64,
}

struct Entry {
    mutex: Arc<tokio::sync::Mutex<()>>,
    users: usize,
}

impl ToyBackend {
    /// A backend with no lock taken.
    pub fn new() -> Self {
        Self::default()
    }

    /// The keys someone holds or waits for.
    pub fn keys(&self) -> usize {
        self.shared.keys.lock().unwrap().len()
    }
}

impl Shared {
    /// `key`'s mutex, counting one more user of it.
    fn enter(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut keys = self.keys.lock().unwrap();
        let entry = keys.entry(key.to_owned()).or_insert_with(|| Entry {
            mutex: Arc::default(),
            users: 0,
        });
        entry.users += 1;
        entry.mutex.clone()
    }

    /// One user of `key` fewer: the last one forgets it.
    fn leave(&self, key: &str) {
        let mut keys = self.keys.lock().unwrap();
        if let Some(entry) = keys.get_mut(key) {
            entry.users -= 1;
            if entry.users == 0 {
                keys.remove(key);
            }
        }
    }
}

/// A user of a key until dropped: a waiter, then a holder.
struct Use {
    shared: Arc<Shared>,
    key: String,
}

impl Drop for Use {
    fn drop(&mut self) {
        self.shared.leave(&self.key);
    }
}

/// A granted lock: releasing it gives the mutex back; dropping it also
/// forgets the key if no one else uses it.
struct Held {
    // Declared first, so dropped first: the mutex is given back before the
    // key can be forgotten (and a newcomer make a mutex of its own).
    guard: Mutex<Option<OwnedMutexGuard<()>>>,
    _user: Use,
}

impl LeaseHandle for Held {
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        // Given back here, not in the future: dropping that loses nothing.
        self.guard.lock().unwrap().take();
        BackendFuture::ready(Ok(()))
    }
}

/// The grant of `user`'s key: the next token, and the hold.
fn grant(user: Use, guard: OwnedMutexGuard<()>) -> Acquired {
    let token = user.shared.tokens.fetch_add(1, Ordering::Relaxed) + 1;
    let held = Held {
        guard: Mutex::new(Some(guard)),
        _user: user,
    };
    Acquired::new(FencingToken::new(token), Arc::new(held))
}

impl Backend for ToyBackend {
    fn name(&self) -> &'static str {
        "toy"
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        // The core refuses the modes `capabilities` leaves out; this stays
        // as a guard for callers of `acquire` itself.
        if request.mode != LockMode::Exclusive {
            let why = format!("the toy backend has no {} locks", request.mode);
            return BackendFuture::ready(Err(LockError::InvalidMode(why)));
        }
        let key = request.key.as_str().to_owned();
        let shared = self.shared.clone();
        let mutex = shared.enter(&key);
        let user = Use { shared, key };
        if request.wait == Wait::FailFast {
            // Decided at once: no future to box.
            let result = match mutex.try_lock_owned() {
                Ok(guard) => Ok(grant(user, guard)),
                Err(_) => Err(LockError::Busy), // `user` leaves as it drops
            };
            return BackendFuture::ready(result);
        }
        // Dropped while waiting (the core's wait ran out, the request went
        // away): the mutex forgets the waiter, and `user` leaves the key.
        BackendFuture::new(async move {
            let guard = mutex.lock_owned().await;
            Ok(grant(user, guard))
        })
    }

    fn instance_id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().exclusive_only()
    }
}
