//! The in-process backend: the embedded default, no server.

mod shard;

#[cfg(not(loom))]
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::{Acquired, BackendFuture, Inspection, LockRequest};

use crate::error::LockError;
use crate::key::LockKey;
use crate::loom::sync::Mutex;
use crate::mode::{LockMode, Wait};
use crate::sync::lock;
use crate::token::FencingToken;
use crate::Backend;
use shard::{wake_all, Grants, Holder, MapKey, Shard, ShardState, Slot, Waiter};

const SHARDS: usize = 64;

/// Seeded at random per process; fixed under loom, whose models must make
/// the same choices each time they are replayed.
#[cfg(not(loom))]
type KeyHasher = RandomState;
#[cfg(loom)]
type KeyHasher = foldhash::fast::FixedState;

/// Locks held in this process's memory.
///
/// The embedded default: no server, nothing to configure. Use it for a single
/// replica, for tests, and as the model every remote backend matches.
///
/// # Guarantees
///
/// - Waiters are served strictly in arrival order per key (FIFO), so writers
///   are not starved by a stream of readers: a reader that arrives after a
///   waiting writer waits behind it.
/// - Fencing tokens strictly increase per key for the life of the backend.
/// - Cancel safe: a waiter that is dropped leaves the queue at once and does not
///   hold up the waiters behind it; a grant that raced with the drop is released.
/// - No entry is kept for a key once its last holder and waiter are gone
///   ([`active_keys`](Self::active_keys) counts them). The state of a few
///   released locks (at most 256 in all, each with its key's text until it
///   is reused) is kept for later ones, so that an uncontended lock
///   allocates nothing but its key.
///
/// It does not protect anything across processes, and it has no lease: a lock
/// is held until its guard is dropped or [`break_lock`](Self::break_lock) is
/// called. `mem::forget` on a guard leaks the lock.
///
/// `Exclusive` and `Write` are the same lock here; a semaphore's bound is the
/// smallest permit count among its current holders and the newcomer.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let guard = backend.lock("order-17").await.unwrap();
/// assert!(backend.lock("order-17").fail_fast().await.is_err());
/// drop(guard);
/// assert_eq!(backend.active_keys(), 0);
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// foldhash, keyed per process: the key of every request is hashed once,
    /// and SipHash was the largest single cost of an uncontended lock (about
    /// 330 instructions of 600). Keys come from requests, so the hasher is
    /// seeded at random; a flood of colliding keys would also have to hold
    /// them all at once to grow a shard.
    hasher: KeyHasher,
    shards: Box<[Arc<Shard>]>,
}

impl MemoryBackend {
    /// A backend with no locks held.
    pub fn new() -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                Arc::new(Shard {
                    state: Mutex::new(ShardState {
                        keys: HashMap::default(),
                        grants: Grants {
                            next_token: 1,
                            spare: Vec::new(),
                            closed: false,
                        },
                    }),
                })
            })
            .collect();
        MemoryBackend {
            inner: Arc::new(Inner {
                hasher: KeyHasher::default(),
                shards,
            }),
        }
    }

    /// How many keys have a holder or a waiter. Zero once everything is
    /// released: use it to check for leaks.
    pub fn active_keys(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| lock(&s.state).keys.len())
            .sum()
    }

    /// How many acquisitions of `key` are queued behind its holders.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
    /// use tower_lock::{BackendExt, MemoryBackend};
    ///
    /// let backend = MemoryBackend::new();
    /// let guard = backend.lock("sku-1").await?;
    /// let waiter = tokio::spawn({
    ///     let backend = backend.clone();
    ///     async move { backend.lock("sku-1").await.map(|next| next.token()) }
    /// });
    /// while backend.queued("sku-1") == 0 {
    ///     tokio::task::yield_now().await;
    /// }
    /// assert_eq!(backend.queued("sku-1"), 1);
    /// let first = guard.token();
    /// drop(guard);
    /// assert!(waiter.await.unwrap()? > first);
    /// assert_eq!(backend.queued("sku-1"), 0);
    /// # Ok(()) }
    /// ```
    pub fn queued(&self, key: &str) -> usize {
        LockKey::new(key).map_or(0, |key| self.queued_for(&key))
    }

    /// How many acquisitions of `key` are queued behind its holders.
    fn queued_for(&self, key: &LockKey) -> usize {
        let key = self.inner.map_key(key.clone());
        let shard = lock(&self.inner.shard(&key).state);
        shard.keys.get(&key).map_or(0, |s| s.queue.len())
    }

    /// The mode of the first acquisition of `key` queued behind its holders.
    pub(crate) fn next_in_line(&self, key: &LockKey) -> Option<LockMode> {
        let key = self.inner.map_key(key.clone());
        let shard = lock(&self.inner.shard(&key).state);
        shard.keys.get(&key)?.queue.front().map(|w| w.mode)
    }

    /// Whether `key` has neither a holder nor a waiter.
    pub(crate) fn is_idle(&self, key: &LockKey) -> bool {
        let key = self.inner.map_key(key.clone());
        let shard = lock(&self.inner.shard(&key).state);
        !shard.keys.contains_key(&key)
    }

    /// Revokes every current hold on `key`, as an operator would break a
    /// stuck lock, and returns how many holders lost it.
    ///
    /// The holders' [`LostSignal`](crate::LostSignal)s fire (so the [`LockLayer`](crate::LockLayer)
    /// aborts their requests by default), and the waiters next in line are
    /// granted with higher fencing tokens. A revoked holder's later release
    /// does nothing. This is the in-process model of a lease that expired.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
    /// use tower_lock::{BackendExt, MemoryBackend};
    ///
    /// let backend = MemoryBackend::new();
    /// let stuck = backend.lock("sku-1").await?;
    /// assert_eq!(backend.break_lock("sku-1"), 1);
    /// assert!(stuck.is_lost());
    ///
    /// let next = backend.lock("sku-1").fail_fast().await?; // free again
    /// assert!(next.token() > stuck.token());
    /// drop(stuck); // releases nothing: `next` still holds the key
    /// assert!(backend.lock("sku-1").fail_fast().await.is_err());
    /// # drop(next); Ok(()) }
    /// ```
    pub fn break_lock(&self, key: &str) -> usize {
        let Ok(key) = LockKey::new(key) else {
            return 0;
        };
        let key = self.inner.map_key(key);
        let shard_ref = self.inner.shard(&key);
        let mut wake = Vec::new();
        let broken: Vec<Holder> = {
            let mut shard = lock(&shard_ref.state);
            let shard = &mut *shard;
            let Some(state) = shard.keys.get_mut(&key) else {
                return 0;
            };
            let broken: Vec<Holder> = state.holders.take_all().collect();
            // Told before the key is anyone else's: marked under the lock,
            // before the next holder is granted (woken outside it, as every
            // wake-up is). A check of the signal then never finds a broken
            // holder unaware while another process has taken its key.
            for hold in &broken {
                wake.extend(hold.lost.mark("the lock was broken by an operator"));
            }
            state.grant_waiters(&mut shard.grants, shard_ref, &key, &mut wake);
            if state.is_idle() {
                shard.forget(&key);
            }
            broken
        };
        wake_all(wake);
        broken.len()
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("active_keys", &self.active_keys())
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Spare holds point at their shards: let them go, and keep no more.
        for shard in self.shards.iter() {
            let spare = {
                let mut state = lock(&shard.state);
                state.grants.closed = true;
                std::mem::take(&mut state.grants.spare)
            };
            drop(spare);
        }
    }
}

impl Inner {
    fn map_key(&self, key: LockKey) -> MapKey {
        MapKey {
            hash: self.hasher.hash_one(key.as_str()),
            key,
        }
    }

    fn shard(&self, key: &MapKey) -> &Arc<Shard> {
        // Middle bits pick the shard; the map uses the low bits for buckets and
        // the top ones for its control bytes.
        &self.shards[(key.hash >> 32) as usize % SHARDS]
    }
}

impl Backend for MemoryBackend {
    fn instance_id(&self) -> usize {
        // Clones share `inner`, and so their locks.
        Arc::as_ptr(&self.inner).cast::<()>() as usize
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    /// Every holder with its token and mode (no lease: a memory lock ends
    /// with its guard), and the waiters queued behind them.
    fn inspect(&self, key: LockKey) -> BackendFuture<Result<Inspection, LockError>> {
        let map_key = self.inner.map_key(key.clone());
        let shard = lock(&self.inner.shard(&map_key).state);
        let Some(state) = shard.keys.get(&map_key) else {
            return BackendFuture::ready(Ok(Inspection::free(key, Some(0))));
        };
        let holders = state
            .holders()
            .map(|(token, mode)| super::Holder::new(Some(FencingToken::new(token))).mode(mode))
            .collect();
        let waiters = Some(u32::try_from(state.queue.len()).unwrap_or(u32::MAX));
        drop(shard);
        BackendFuture::ready(Ok(Inspection {
            key,
            holders,
            waiters,
        }))
    }

    fn list(&self, prefix: &str) -> BackendFuture<Result<Vec<LockKey>, LockError>> {
        let mut keys: Vec<LockKey> = Vec::new();
        for shard in self.inner.shards.iter() {
            let shard = lock(&shard.state);
            keys.extend(
                shard
                    .keys
                    .iter()
                    .filter(|(k, state)| {
                        k.key.as_str().starts_with(prefix) && state.holders().next().is_some()
                    })
                    .map(|(k, _)| k.key.clone()),
            );
        }
        keys.sort_unstable();
        BackendFuture::ready(Ok(keys))
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        let key = self.inner.map_key(request.key);
        let shard_ref = self.inner.shard(&key);
        let mut shard = lock(&shard_ref.state);
        let shard = &mut *shard;
        // The request's key moves into the map when the key is new, and one
        // copy goes to the hold or the waiter (each copy is an atomic
        // increment, and its drop a decrement).
        let entry = shard.keys.entry(key);
        let key = entry.key().clone();
        let state = entry.or_default();
        if state.queue.is_empty() && state.admits(request.mode) {
            let hold = state.grant(request.mode, &mut shard.grants, shard_ref, key);
            return BackendFuture::ready(Ok(hold.acquired()));
        }
        if request.wait == Wait::FailFast {
            return BackendFuture::ready(Err(LockError::Busy));
        }
        let slot = Arc::new(Slot::default());
        state.queue.push_back(Waiter {
            mode: request.mode,
            slot: slot.clone(),
        });
        BackendFuture::new(WaitForGrant {
            shard: shard_ref.clone(),
            key: Some(key),
            slot,
        })
    }
}

/// A queued acquisition.
struct WaitForGrant {
    shard: Arc<Shard>,
    /// `None` once the grant was taken.
    key: Option<MapKey>,
    slot: Arc<Slot>,
}

impl Future for WaitForGrant {
    type Output = Result<Acquired, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let hold = {
            let mut slot = lock(&self.slot.state);
            match slot.granted.take() {
                Some(hold) => hold,
                None => {
                    match &slot.waker {
                        Some(w) if w.will_wake(cx.waker()) => {}
                        _ => slot.waker = Some(cx.waker().clone()),
                    }
                    return Poll::Pending;
                }
            }
        };
        self.key = None;
        Poll::Ready(Ok(hold.acquired()))
    }
}

impl Drop for WaitForGrant {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        let shard_ref = &self.shard;
        let mut wake = Vec::new();
        {
            let mut shard = lock(&shard_ref.state);
            let shard = &mut *shard;
            // Granted between the last poll and now: give the lock back.
            let granted = lock(&self.slot.state).granted.take();
            if let Some(hold) = granted {
                shard.release(shard_ref, &key, hold.token, &mut wake);
            } else if let Some(state) = shard.keys.get_mut(&key) {
                if state.queue.remove(&self.slot) {
                    // Leaving may unblock the waiters behind (readers behind
                    // a departed writer).
                    state.grant_waiters(&mut shard.grants, shard_ref, &key, &mut wake);
                    if state.is_idle() {
                        shard.forget(&key);
                    }
                }
            }
        }
        wake_all(wake);
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::sync::{Arc, Weak};
    use std::task::{Context, Waker};

    use super::{lock, Shard};

    use crate::key::LockKey;
    use crate::BackendExt;
    use crate::MemoryBackend;

    /// How many released holds the shard of `key` keeps.
    fn spares(backend: &MemoryBackend, key: &str) -> usize {
        let key = backend.inner.map_key(LockKey::new(key).unwrap());
        lock(&backend.inner.shard(&key).state).grants.spare.len()
    }

    #[tokio::test]
    async fn a_released_hold_is_reused_afresh_and_one_still_pointed_at_is_kept() {
        let backend = MemoryBackend::new();
        let first = backend.lock("k").await.unwrap();
        // A task awaits the loss, then the lock is released.
        assert!(pin!(first.lost())
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending());
        drop(first);
        assert_eq!(spares(&backend, "k"), 1, "the release kept its hold");
        {
            let key = backend.inner.map_key(LockKey::new("k").unwrap());
            let state = lock(&backend.inner.shard(&key).state);
            let spare = &state.grants.spare[0];
            assert!(
                spare.lost.take_wakers().is_empty(),
                "the release kept a waker"
            );
            // As if it had been lost: the next grant must not inherit it.
            spare.lost.fire("test");
        }
        let second = backend.lock("k").await.unwrap();
        assert_eq!(spares(&backend, "k"), 0, "the grant did not reuse the hold");
        assert!(!second.is_lost(), "the reused hold kept its lost state");
        // Still described after its release: kept, not reused, not dropped.
        let described = second.held().clone();
        drop(second);
        let third = backend.lock("k").await.unwrap();
        assert_eq!(spares(&backend, "k"), 1);
        assert_eq!(backend.break_lock("k"), 1);
        assert!(third.is_lost() && !described.is_lost());
    }

    #[tokio::test]
    async fn a_dropped_backend_frees_its_shards_and_the_holds_it_kept() {
        let backend = MemoryBackend::new();
        // Released holds are kept for reuse, each pointing at its shard.
        for i in 0..1000 {
            drop(backend.lock(format!("k{i}").as_str()).await.unwrap());
        }
        let outliving = backend.lock("late").await.unwrap();
        let shards: Vec<Weak<Shard>> = backend.inner.shards.iter().map(Arc::downgrade).collect();
        drop(backend);
        // Released after its backend: nothing may keep it now.
        drop(outliving);
        assert!(
            shards.iter().all(|s| s.upgrade().is_none()),
            "a shard outlived its backend"
        );
    }
}
