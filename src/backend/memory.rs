//! The in-process backend: the embedded default, no server.

use foldhash::fast::RandomState;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use super::{Acquired, Backend, BackendFuture, LeaseHandle, LockRequest};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::{HasLostState, LostSignal, LostState};
use crate::mode::{LockMode, Wait};
use crate::token::FencingToken;

const SHARDS: usize = 64;

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
///   ([`active_keys`](Self::active_keys) counts them).
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
    hasher: RandomState,
    shards: Box<[Arc<Shard>]>,
}

/// One lock-protected slice of the keys. Each is its own allocation, and a
/// hold keeps its shard alive rather than the whole backend: the reference
/// count then sits beside the mutex the hold touches anyway, instead of on one
/// line that every request on every core would bounce.
struct Shard {
    state: Mutex<ShardState>,
}

struct ShardState {
    keys: HashMap<MapKey, KeyState, BuildHasherDefault<PassHasher>>,
    /// Tokens per shard: a key always lives in one shard, so its tokens
    /// strictly increase, and cores do not contend on one counter.
    next_token: u64,
}

/// A key with its hash computed once, for the shard and the map alike.
#[derive(Clone)]
struct MapKey {
    hash: u64,
    key: LockKey,
}

impl PartialEq for MapKey {
    fn eq(&self, other: &Self) -> bool {
        // The holder's copy of the key shares the map's allocation: compare
        // pointers before bytes.
        self.hash == other.hash && (self.key.ptr_eq(&other.key) || self.key == other.key)
    }
}
impl Eq for MapKey {}

impl Hash for MapKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Passes a precomputed hash through.
#[derive(Default)]
struct PassHasher(u64);

impl Hasher for PassHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `MapKey`; fold anything else anyway.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Default)]
struct KeyState {
    /// What the current holders hold; meaningless while `holders` is empty.
    held: Held,
    holders: Holders,
    queue: Queue,
}

/// The waiters of a key, boxed: most keys never have one, and an inline
/// queue would make every entry the map moves in and out a third larger.
#[derive(Default)]
// The box is the point: 8 bytes in the entry where a `VecDeque` takes 32.
#[allow(clippy::box_collection)]
struct Queue(Option<Box<VecDeque<Waiter>>>);

impl Queue {
    fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|q| q.is_empty())
    }

    fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |q| q.len())
    }

    fn front(&self) -> Option<&Waiter> {
        self.0.as_ref()?.front()
    }

    fn pop_front(&mut self) -> Option<Waiter> {
        self.0.as_mut()?.pop_front()
    }

    fn push_back(&mut self, waiter: Waiter) {
        self.0.get_or_insert_default().push_back(waiter);
    }

    /// Takes the waiter whose slot is `slot` out of the queue; false if it
    /// is not there.
    fn remove(&mut self, slot: &Arc<Slot>) -> bool {
        let Some(queue) = self.0.as_mut() else {
            return false;
        };
        match queue.iter().position(|w| Arc::ptr_eq(&w.slot, slot)) {
            Some(i) => queue.remove(i).is_some(),
            None => false,
        }
    }
}

/// The holders of a key: the first inline, since most keys have one, and a
/// heap allocation per lock would be a measurable share of its cost.
#[derive(Default)]
struct Holders {
    first: Option<Holder>,
    more: Vec<Holder>,
}

impl Holders {
    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.more.len()
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn push(&mut self, holder: Holder) {
        match self.first {
            None => self.first = Some(holder),
            Some(_) => self.more.push(holder),
        }
    }

    /// Removes the holder with `token`; false if it is not one (revoked).
    fn remove(&mut self, token: u64) -> bool {
        if self.first.as_ref().is_some_and(|h| h.token == token) {
            self.first = self.more.pop();
            return true;
        }
        match self.more.iter().position(|h| h.token == token) {
            Some(i) => {
                self.more.swap_remove(i);
                true
            }
            None => false,
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Holder> {
        self.first.iter().chain(&self.more)
    }

    fn take_all(&mut self) -> impl Iterator<Item = Holder> {
        let first = self.first.take();
        first.into_iter().chain(std::mem::take(&mut self.more))
    }
}

#[derive(Default, Clone, Copy)]
enum Held {
    #[default]
    Exclusive,
    Shared,
    /// A semaphore; its bound is the smallest permit count among the
    /// current holders.
    Permits,
}

/// One granted lock: the holder list's entry, the guard's lease handle and
/// the state of its lost signal, in a single allocation.
struct Hold {
    shard: Arc<Shard>,
    key: MapKey,
    token: u64,
    /// The permit count it was granted with (semaphores), else 0.
    permits: u32,
    lost: LostState,
}

type Holder = Arc<Hold>;

impl HasLostState for Hold {
    fn lost_state(&self) -> &LostState {
        &self.lost
    }
}

impl Hold {
    fn acquired(self: Arc<Self>) -> Acquired {
        let token = FencingToken::new(self.token);
        let lost = LostSignal::new(self.clone());
        Acquired::new(token, self).with_lost(lost)
    }

    fn release_now(&self) {
        let mut wake = Vec::new();
        lock(&self.shard.state).release(&self.shard, &self.key, self.token, &mut wake);
        wake_all(wake);
    }
}

impl LeaseHandle for Hold {
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        self.release_now();
        BackendFuture::ready(Ok(()))
    }

    fn release_on_drop(self: Arc<Self>) {
        self.release_now();
    }
}

struct Waiter {
    mode: LockMode,
    slot: Arc<Slot>,
}

/// Where a queued waiter learns it was granted. Written only under the
/// shard's lock; read by the waiting future.
#[derive(Default)]
struct Slot {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    waker: Option<Waker>,
    granted: Option<Arc<Hold>>,
}

/// Wakes granted waiters. Called with no lock held: a woken task goes
/// straight for the shard lock, and an executor may even poll it inline.
fn wake_all(wakers: Vec<Waker>) {
    for w in wakers {
        w.wake();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while these locks are held, but a poisoned lock must not
    // turn one panic into a stuck key.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KeyState {
    fn admits(&self, mode: LockMode) -> bool {
        if self.holders.is_empty() {
            return true;
        }
        match (self.held, mode) {
            (Held::Shared, LockMode::Read) => true,
            (Held::Permits, LockMode::Semaphore { permits }) => {
                // Recomputed from the current holders (at most `permits` of
                // them), so a small count leaves with its holder.
                let limit = self
                    .holders
                    .iter()
                    .map(|h| h.permits)
                    .fold(permits, u32::min);
                (self.holders.len() as u64) < u64::from(limit)
            }
            _ => false,
        }
    }

    fn grant(
        &mut self,
        mode: LockMode,
        next_token: &mut u64,
        shard: &Arc<Shard>,
        key: MapKey,
    ) -> Arc<Hold> {
        let permits = match mode {
            LockMode::Semaphore { permits } => permits,
            _ => 0,
        };
        self.held = match mode {
            LockMode::Read => Held::Shared,
            LockMode::Semaphore { .. } => Held::Permits,
            _ => Held::Exclusive,
        };
        let token = *next_token;
        *next_token += 1;
        let hold = Arc::new(Hold {
            shard: shard.clone(),
            key,
            token,
            permits,
            lost: LostState::new(),
        });
        self.holders.push(hold.clone());
        hold
    }

    /// Grants queued waiters from the head while they fit (FIFO), and
    /// collects their wakers, to be woken once the shard is unlocked.
    fn grant_waiters(
        &mut self,
        next_token: &mut u64,
        shard: &Arc<Shard>,
        key: &MapKey,
        wake: &mut Vec<Waker>,
    ) {
        while let Some(head) = self.queue.front() {
            if !self.admits(head.mode) {
                break;
            }
            let waiter = self.queue.pop_front().expect("front exists");
            let grant = self.grant(waiter.mode, next_token, shard, key.clone());
            let mut slot = lock(&waiter.slot.state);
            slot.granted = Some(grant);
            wake.extend(slot.waker.take());
        }
    }

    fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.queue.is_empty()
    }
}

impl ShardState {
    /// Drops the entry of a key found idle, and gives memory back after a
    /// burst of distinct keys has come and gone.
    fn forget(&mut self, key: &MapKey) {
        self.keys.remove(key);
        self.shrink();
    }

    /// Gives memory back after a burst of distinct keys has come and gone.
    fn shrink(&mut self) {
        let cap = self.keys.capacity();
        if cap > 64 && self.keys.len() * 8 < cap {
            self.keys.shrink_to(self.keys.len() * 2);
        }
    }

    fn release(&mut self, shard: &Arc<Shard>, key: &MapKey, token: u64, wake: &mut Vec<Waker>) {
        // Taken out and put back if still in use: the common release, of a
        // key nobody else wants, then looks the key up once, not twice.
        let Some((key, mut state)) = self.keys.remove_entry(key) else {
            return;
        };
        // A holder whose lock was broken is no longer listed: nothing to do.
        if state.holders.remove(token) {
            state.grant_waiters(&mut self.next_token, shard, &key, wake);
        }
        if state.is_idle() {
            self.shrink();
        } else {
            self.keys.insert(key, state);
        }
    }
}

impl MemoryBackend {
    /// A backend with no locks held.
    pub fn new() -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                Arc::new(Shard {
                    state: Mutex::new(ShardState {
                        keys: HashMap::default(),
                        next_token: 1,
                    }),
                })
            })
            .collect();
        MemoryBackend {
            inner: Arc::new(Inner {
                hasher: RandomState::default(),
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
    /// The holders' [`LostSignal`]s fire (so the [`LockLayer`](crate::LockLayer)
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
            let broken = state.holders.take_all().collect();
            state.grant_waiters(&mut shard.next_token, shard_ref, &key, &mut wake);
            if state.is_idle() {
                shard.forget(&key);
            }
            broken
        };
        // Outside the lock, like every wake-up: firing wakes the holders.
        for hold in &broken {
            hold.lost.fire("the lock was broken by an operator");
        }
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
            let hold = state.grant(request.mode, &mut shard.next_token, shard_ref, key);
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
                    state.grant_waiters(&mut shard.next_token, shard_ref, &key, &mut wake);
                    if state.is_idle() {
                        shard.forget(&key);
                    }
                }
            }
        }
        wake_all(wake);
    }
}
