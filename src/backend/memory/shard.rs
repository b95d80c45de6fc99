//! One shard of the memory backend: its keys, their holders and waiters,
//! and how a grant and a release change them, under the shard's lock.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::Arc;
use std::task::Waker;

use crate::backend::{Acquired, BackendFuture, LeaseHandle};
use crate::error::LockError;
use crate::key::LockKey;
use crate::loom::sync::Mutex;
use crate::lost::{HasLostState, LostSignal, LostState};
use crate::mode::LockMode;
use crate::sync::lock;
use crate::token::FencingToken;

/// One lock-protected slice of the keys. Each is its own allocation, and a
/// hold keeps its shard alive rather than the whole backend: the reference
/// count then sits beside the mutex the hold touches anyway, instead of on one
/// line that every request on every core would bounce.
pub(super) struct Shard {
    pub(super) state: Mutex<ShardState>,
}

pub(super) struct ShardState {
    pub(super) keys: HashMap<MapKey, KeyState, BuildHasherDefault<PassHasher>>,
    pub(super) grants: Grants,
}

/// How many released holds a shard keeps for reuse.
const SPARE_HOLDS: usize = 4;

/// What a shard makes grants with.
pub(super) struct Grants {
    /// Tokens per shard: a key always lives in one shard, so its tokens
    /// strictly increase, and cores do not contend on one counter.
    pub(super) next_token: u64,
    /// Holds their releases gave back, reused by later grants once nobody
    /// points at them any more: most locks then cost no allocation of their
    /// own (a malloc and a free were a tenth of an uncontended lock).
    pub(super) spare: Vec<Arc<Hold>>,
    /// Set when the backend is dropped: a spare hold points at its shard,
    /// so keeping one then would keep the shard alive for ever.
    pub(super) closed: bool,
}

impl Grants {
    /// A hold for a new grant on `key`: the newest spare if nobody else
    /// points at it any more (its guard and every `HeldLock` describing it
    /// are gone), else a new one.
    fn hold(&mut self, shard: &Arc<Shard>, key: MapKey, permits: u32) -> Arc<Hold> {
        let token = self.next_token;
        self.next_token += 1;
        if let Some(hold) = self.spare.last_mut().and_then(Arc::get_mut) {
            hold.key = key;
            hold.token = token;
            hold.permits = permits;
            // Its release took the wakers out, so this drops none under the
            // shard's lock (unless a `Lost` future of a copy since dropped
            // registered one after the release: a Tokio waker, harmless).
            hold.lost.reset();
            return self.spare.pop().expect("the last spare was just reused");
        }
        // Still pointed at: kept, not dropped here (its last reference could
        // then be dropped under the lock), and moved to the back of the
        // line, so that one held for long does not stop the others' reuse.
        if self.spare.len() > 1 {
            self.spare.rotate_right(1);
        }
        Arc::new(Hold {
            shard: shard.clone(),
            key,
            token,
            permits,
            lost: LostState::new(),
        })
    }

    /// Keeps a released hold for reuse, if there is room.
    fn keep(&mut self, hold: Arc<Hold>) {
        if !self.closed && self.spare.len() < SPARE_HOLDS {
            self.spare.push(hold);
        }
    }
}

/// A key with its hash computed once, for the shard and the map alike.
#[derive(Clone)]
pub(super) struct MapKey {
    pub(super) hash: u64,
    pub(super) key: LockKey,
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
pub(super) struct PassHasher(u64);

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
pub(super) struct KeyState {
    /// What the current holders hold; meaningless while `holders` is empty.
    held: Held,
    pub(super) holders: Holders,
    pub(super) queue: Queue,
}

/// The waiters of a key, boxed: most keys never have one, and an inline
/// queue would make every entry the map moves in and out a third larger.
#[derive(Default)]
// The box is the point: 8 bytes in the entry where a `VecDeque` takes 32.
#[allow(clippy::box_collection)]
pub(super) struct Queue(Option<Box<VecDeque<Waiter>>>);

impl Queue {
    pub(super) fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|q| q.is_empty())
    }

    pub(super) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |q| q.len())
    }

    pub(super) fn front(&self) -> Option<&Waiter> {
        self.0.as_ref()?.front()
    }

    fn pop_front(&mut self) -> Option<Waiter> {
        self.0.as_mut()?.pop_front()
    }

    pub(super) fn push_back(&mut self, waiter: Waiter) {
        self.0.get_or_insert_default().push_back(waiter);
    }

    /// Takes the waiter whose slot is `slot` out of the queue; false if it
    /// is not there.
    pub(super) fn remove(&mut self, slot: &Arc<Slot>) -> bool {
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
pub(super) struct Holders {
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

    /// Removes the holder with `token`; `None` if it is not one (revoked).
    fn remove(&mut self, token: u64) -> Option<Holder> {
        if self.first.as_ref().is_some_and(|h| h.token == token) {
            return std::mem::replace(&mut self.first, self.more.pop());
        }
        let i = self.more.iter().position(|h| h.token == token)?;
        Some(self.more.swap_remove(i))
    }

    fn iter(&self) -> impl Iterator<Item = &Holder> {
        self.first.iter().chain(&self.more)
    }

    pub(super) fn take_all(&mut self) -> impl Iterator<Item = Holder> {
        let first = self.first.take();
        first.into_iter().chain(std::mem::take(&mut self.more))
    }
}

#[derive(Default, Clone, Copy)]
enum Held {
    #[default]
    Exclusive,
    /// A write lock: exclusive, named apart for inspection.
    Write,
    Shared,
    /// A semaphore; its bound is the smallest permit count among the
    /// current holders.
    Permits,
}

/// One granted lock: the holder list's entry, the guard's lease handle and
/// the state of its lost signal, in a single allocation.
pub(super) struct Hold {
    shard: Arc<Shard>,
    key: MapKey,
    pub(super) token: u64,
    /// The permit count it was granted with (semaphores), else 0.
    permits: u32,
    pub(super) lost: LostState,
}

pub(super) type Holder = Arc<Hold>;

impl HasLostState for Hold {
    fn lost_state(&self) -> &LostState {
        &self.lost
    }
}

impl Hold {
    pub(super) fn acquired(self: Arc<Self>) -> Acquired {
        let token = FencingToken::new(self.token);
        let lost = LostSignal::new(self.clone());
        Acquired::new(token, self).with_lost(lost)
    }

    fn release_now(&self) {
        let mut wake = Vec::new();
        lock(&self.shard.state).release(&self.shard, &self.key, self.token, &mut wake);
        wake_all(wake);
        // A released lock is never lost: nobody needs waking for it, and
        // the shard may keep this hold for reuse, wakers and all. Dropped
        // here, with no lock held.
        drop(self.lost.take_wakers());
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

pub(super) struct Waiter {
    pub(super) mode: LockMode,
    pub(super) slot: Arc<Slot>,
}

/// Where a queued waiter learns it was granted. Written only under the
/// shard's lock; read by the waiting future.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) state: Mutex<SlotState>,
}

#[derive(Default)]
pub(super) struct SlotState {
    pub(super) waker: Option<Waker>,
    pub(super) granted: Option<Arc<Hold>>,
}

/// Wakes granted waiters. Called with no lock held: a woken task goes
/// straight for the shard lock, and an executor may even poll it inline.
pub(super) fn wake_all(wakers: Vec<Waker>) {
    for w in wakers {
        w.wake();
    }
}

impl KeyState {
    /// Its holders' tokens and modes.
    pub(super) fn holders(&self) -> impl Iterator<Item = (u64, LockMode)> + '_ {
        self.holders.iter().map(|h| {
            let mode = match self.held {
                Held::Exclusive => LockMode::Exclusive,
                Held::Write => LockMode::Write,
                Held::Shared => LockMode::Read,
                Held::Permits => LockMode::Semaphore { permits: h.permits },
            };
            (h.token, mode)
        })
    }

    pub(super) fn admits(&self, mode: LockMode) -> bool {
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

    pub(super) fn grant(
        &mut self,
        mode: LockMode,
        grants: &mut Grants,
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
            LockMode::Write => Held::Write,
            _ => Held::Exclusive,
        };
        let hold = grants.hold(shard, key, permits);
        self.holders.push(hold.clone());
        hold
    }

    /// Grants queued waiters from the head while they fit (FIFO), and
    /// collects their wakers, to be woken once the shard is unlocked.
    pub(super) fn grant_waiters(
        &mut self,
        grants: &mut Grants,
        shard: &Arc<Shard>,
        key: &MapKey,
        wake: &mut Vec<Waker>,
    ) {
        while let Some(head) = self.queue.front() {
            if !self.admits(head.mode) {
                break;
            }
            let waiter = self.queue.pop_front().expect("front exists");
            let grant = self.grant(waiter.mode, grants, shard, key.clone());
            let mut slot = lock(&waiter.slot.state);
            slot.granted = Some(grant);
            wake.extend(slot.waker.take());
        }
    }

    pub(super) fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.queue.is_empty()
    }
}

impl ShardState {
    /// Drops the entry of a key found idle, and gives memory back after a
    /// burst of distinct keys has come and gone.
    pub(super) fn forget(&mut self, key: &MapKey) {
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

    pub(super) fn release(
        &mut self,
        shard: &Arc<Shard>,
        key: &MapKey,
        token: u64,
        wake: &mut Vec<Waker>,
    ) {
        // Taken out and put back if still in use: the common release, of a
        // key nobody else wants, then looks the key up once, not twice.
        let Some((key, mut state)) = self.keys.remove_entry(key) else {
            return;
        };
        // A holder whose lock was broken is no longer listed: nothing to do.
        if let Some(hold) = state.holders.remove(token) {
            state.grant_waiters(&mut self.grants, shard, &key, wake);
            // After the waiters: its guard still points at it for now.
            self.grants.keep(hold);
        }
        if state.is_idle() {
            self.shrink();
        } else {
            self.keys.insert(key, state);
        }
    }
}
