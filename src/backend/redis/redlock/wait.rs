//! How a Redlock waiter waits: at one place in the lock's queue on every
//! instance, woken by a release message from any of them.

use std::future::{poll_fn, Future};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::{join_all, RedlockStore};
use crate::backend::engine::lease::release_in_background;
use crate::backend::redis::layout::{Layout, Queue};
use crate::backend::redis::pubsub::{Armed, Watch};
use crate::backend::redis::scripts::NEXT_TTL;

/// How long a waiter named by some instances waits for the others'
/// messages: far less than its turn (`NEXT_TTL`).
const CALLED_BY_SOME: Duration = Duration::from_millis(10);

/// One acquisition's place in the lock's queues, and its subscriptions.
/// Dropped without the lock (it gave up, or failed), it undoes in the
/// background what its rounds may have left granted, sending again where
/// no answer comes until the last round's lease would have ended: safe
/// now that its token is used no more. Dropped while it may still have a
/// place (also when granted where some instance had queued it), it then
/// leaves those queues.
pub(super) struct Waiter<'a> {
    store: &'a Arc<RedlockStore>,
    layout: &'a Arc<Layout>,
    token: &'a Arc<str>,
    /// How the next attempt queues when it finds the lock busy.
    queue: Queue,
    /// Its score in every instance's queue: this process's clock in µs
    /// when it first asked. The same everywhere, so that every instance
    /// orders the waiters alike and a release names the same one on each.
    score: u64,
    /// One per instance, once the lock was found busy.
    watching: Vec<Watch>,
    /// Whether an attempt may have given it a place in a queue.
    queued: bool,
    /// Once granted, the instances it may still have a place on (by
    /// index); before, all of them.
    left_on: Option<Vec<bool>>,
    /// Until when a round short of a majority may still hold the lock
    /// somewhere (its undo failed or got no answer): the last such
    /// round's lease.
    may_hold_until: Option<std::time::Instant>,
    /// By instance, whether it did not answer the last round: not
    /// subscribed to again before the next one (which would wait out its
    /// timeout first).
    silent: Vec<bool>,
}

impl<'a> Waiter<'a> {
    /// A waiter for `token`, or with `waits` false an acquisition that
    /// fails fast and never queues.
    pub(super) fn new(
        store: &'a Arc<RedlockStore>,
        layout: &'a Arc<Layout>,
        token: &'a Arc<str>,
        waits: bool,
    ) -> Self {
        let (queue, score) = match waits {
            // A clock before 1970 still queues (0 would be the server's).
            true => (Queue::OnBusy, unix_micros().max(1)),
            false => (Queue::Never, 0),
        };
        Waiter {
            store,
            layout,
            token,
            queue,
            score,
            watching: Vec::new(),
            queued: false,
            left_on: None,
            may_hold_until: None,
            silent: Vec::new(),
        }
    }

    /// The score a waiter's undone grant goes back in the queue at; none
    /// for an acquisition that fails fast.
    pub(super) fn score(&self) -> Option<u64> {
        (self.score != 0).then_some(self.score)
    }

    /// A round short of a majority may hold the lock somewhere until
    /// `until`: undone then, if this acquisition ends without the lock.
    pub(super) fn may_hold_until(&mut self, until: std::time::Instant) {
        self.may_hold_until = self.may_hold_until.max(Some(until));
    }

    /// Which instances did not answer the last round: neither busy nor
    /// granting.
    pub(super) fn silent_on(&mut self, busy_on: &[bool], granted_on: &[bool]) {
        self.silent.clear();
        let silent = busy_on.iter().zip(granted_on).map(|(b, g)| !b && !g);
        self.silent.extend(silent);
    }

    /// How the attempt about to be sent queues, and at what score.
    pub(super) fn place(&mut self) -> (Queue, u64) {
        let place = (self.queue, self.score);
        if self.queue != Queue::Never {
            self.queued = true;
            self.queue = Queue::Queued;
        }
        place
    }

    /// Before an attempt: a wait for a message on every instance, armed
    /// now so that one published between the attempt's answer and the
    /// wait is not missed. Subscribes again where a server ended a
    /// subscription; and before a waiter's first attempt, where this
    /// backend's subscriptions linger from earlier waits (a flag check),
    /// so that a busy answer needs no second attempt.
    pub(super) async fn arm(&mut self) -> Vec<Armed> {
        if self.watching.is_empty()
            && self.queue == Queue::OnBusy
            && self.store.nodes.iter().all(|n| n.watches.any())
        {
            let channel = self.channel();
            if self
                .store
                .nodes
                .iter()
                .all(|n| n.watches.subscribed(&channel))
            {
                self.watching = self.store.watch_all(&channel).await;
            }
        }
        let armed = self.watching.iter().map(Watch::arm).collect();
        if !self.watching.is_empty() {
            // Together, and not where the last round got no answer.
            let silent = |i: usize| self.silent.get(i).copied().unwrap_or(false);
            let nodes = self.watching.iter().zip(&self.store.nodes).enumerate();
            let again = nodes.filter(|(i, _)| !silent(*i));
            join_all(again.map(|(_, (watch, node))| watch.subscribe(&node.link))).await;
        }
        armed
    }

    /// After a round that was not granted: waits until messages from a
    /// majority of the instances have called this waiter (a release named
    /// it there, or messages may have been missed), or `recheck` has
    /// passed. A release runs on each instance apart: woken by the first
    /// message, an attempt would find the others still held, and undo a
    /// split round. The first time, it subscribes instead and returns at
    /// once: a release before the subscription went unheard.
    ///
    /// With `held_elsewhere` (others hold a majority), a message naming
    /// this waiter on fewer than a majority (its own undo, where it was
    /// first) does not cut the wait short.
    pub(super) async fn wait(
        &mut self,
        armed: &mut [Armed],
        recheck: Duration,
        held_elsewhere: bool,
    ) {
        if self.watching.is_empty() {
            self.watching = self.store.watch_all(&self.channel()).await;
            return;
        }
        let quorum = self.store.quorum();
        let mut called = vec![false; armed.len()];
        let mut until = Instant::now() + recheck;
        loop {
            tokio::select! {
                _ = any_released(armed, &called) => {}
                _ = tokio::time::sleep_until(until) => return,
            }
            for (i, watch) in self.watching.iter().enumerate() {
                if !called[i] && watch.for_us_or_rearm(&mut armed[i]) {
                    called[i] = true;
                }
            }
            let now = Instant::now();
            until = match called.iter().filter(|c| **c).count() {
                n if n >= quorum => return,
                // Named on some only so far: the others' messages follow
                // (or their instances are down, or named another waiter).
                n if n > 0 && !held_elsewhere => until.min(now + CALLED_BY_SOME),
                n if n > 0 => until,
                // A release named a waiter of another process: the lock
                // is that waiter's until its turn is over.
                _ => now + NEXT_TTL + Duration::from_millis(1),
            };
        }
    }

    /// Granted by a majority, on the instances `granted_on` says (by
    /// index): the others, busy or silent, may have queued it.
    pub(super) fn granted(&mut self, granted_on: Vec<bool>) {
        self.queued &= granted_on.contains(&false);
        self.left_on = Some(granted_on.into_iter().map(|g| !g).collect());
        // What earlier rounds left granted is this lock's: released with it.
        self.may_hold_until = None;
    }

    /// The channel a release naming one of this backend's waiters is
    /// published on.
    fn channel(&self) -> String {
        self.layout.waiter_channel(&self.store.tokens.prefix())
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if !self.queued && self.may_hold_until.is_none() {
            return;
        }
        let store = self.store.clone();
        let (layout, token) = (self.layout.clone(), self.token.clone());
        let (on, undo_until, queued) = (self.left_on.take(), self.may_hold_until, self.queued);
        let releases = store.releases.clone();
        let leave = async move {
            // On each instance in turn, what may be held (sent again until
            // `until`), then the place. An instance that does not answer
            // keeps the place until it runs out (`QUEUE_TTL`); named
            // meanwhile, it holds the lock back there for a turn
            // (`NEXT_TTL`), and a majority elsewhere still grants.
            let pick = |i: usize| undo_until.is_some() || on.as_ref().is_none_or(|on| on[i]);
            store
                .on_some(pick, |mut conn| {
                    let (layout, token) = (layout.clone(), token.clone());
                    async move {
                        if let Some(until) = undo_until {
                            let again = || conn.clone();
                            let _ = layout.release_until(again, &token, Some(until)).await;
                        }
                        match queued {
                            true => layout.leave_queue(&mut conn, &token).await,
                            false => Ok(()),
                        }
                    }
                })
                .await;
            Ok(())
        };
        release_in_background(leave, &releases, "redlock");
    }
}

impl RedlockStore {
    /// Subscribes to `channel` on every instance at once.
    async fn watch_all(&self, channel: &str) -> Vec<Watch> {
        join_all(
            self.nodes
                .iter()
                .map(|node| node.watches.watch(&node.link, channel, None)),
        )
        .await
    }
}

/// Ends when any of the waits not yet `called` ends.
fn any_released<'a>(armed: &'a mut [Armed], called: &'a [bool]) -> impl Future<Output = ()> + 'a {
    poll_fn(move |cx| {
        for (armed, called) in armed.iter_mut().zip(called) {
            if !called && armed.released.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    })
}

/// This process's clock in µs since 1970 (0 before).
fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}
