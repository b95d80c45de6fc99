//! Redlock over several independent Redis servers (feature `redis`).
//!
//! The algorithm of the Redis documentation: take the lock on every instance
//! at once, with the same random token and the scripts and key layout of the
//! [single-instance backend](super::RedisBackend); it is held if a majority
//! (N/2 + 1) granted it and time is left, that is if
//! `validity = lease − elapsed − drift` is positive, drift being 1% of the lease
//! plus 2 ms. Otherwise the attempt is undone where it was granted and where
//! no answer came, once, and the waiter [waits](#waiting) to try again, until
//! the caller's wait runs out. Its next round has the same token, which an
//! undo sent again later could free; what a failed undo leaves is the
//! waiter's own, which its next round takes again, and an acquisition that
//! ends without the lock undoes it then in the background, sending again
//! until its last round's lease would have ended. Renewal every third of the
//! lease also needs a majority; anything less fires the lost signal. Only
//! exclusive locks.
//!
//! A release runs the release script on every instance, as with the
//! [single-instance backend](super#release): awaited by
//! [`LockGuard::release`](crate::LockGuard::release), in the background when
//! the guard is dropped, sent again where an instance did not answer, and
//! waited for by [`Backend::flush`](crate::Backend::flush).
//!
//! If too many instances fail to answer for a majority ever to form, the
//! acquisition fails at once with [`LockError::Backend`] saying how many
//! answered, rather than waiting out its timeout.
//!
//! # Waiting
//!
//! A waiter queues on every instance, as on the [single
//! server](super#waiting), at one score on all: its process's clock
//! in microseconds when it first asked. Every instance so orders the waiters
//! alike, and a release names the same first waiter on each, whose turn it
//! is there for 100 ms; the process that released queues behind the others
//! when it asks again. The waiter hears it on its process's channel on each
//! instance and tries once a majority has named it, which takes a round
//! trip after the release rather than a retry's pause. So processes take
//! turns, in the order their waiters first asked.
//!
//! That order is only as fair as the processes' clocks agree: a waiter
//! whose clock is behind comes before those that asked earlier. It never
//! bears on exclusion. An instance that lost a waiter's place (it did not
//! answer when the waiter joined) may name another, and a lock that ran out
//! unreleased names no one: waiters may then split a round. Each undoes
//! its part, which puts it back at its place in the queue where its grant
//! still stood, and the instance names the first waiter by score, as the
//! others do while every waiter's place lasts there; they try again after
//! a random pause of up to 50 ms, or sooner when a majority names them.
//!
//! Each instance's connection speaks RESP3, which carries the release
//! messages (Redis 6.2 or later, as for the single server), and its user
//! needs `SUBSCRIBE` and, under Redis 7 ACLs, the lock channels: without
//! them waiters hear nothing and look again only on their timers.
//!
//! # Fencing tokens
//!
//! Each instance keeps its own counter (started at its clock in microseconds),
//! which an acquisition raises by the block of tokens it reserves for the
//! holders this process passes the lock to (as with the
//! [single-instance backend](super#passing-a-lock-on)); a grant's first
//! token is the largest counter among the instances that granted it, less
//! the block.
//! Two majorities always share an instance, whose counter rose between them, but
//! the largest counter of the second may still be below that of the first when
//! the instances' counters (or clocks) are far apart. So tokens rise across
//! holders as long as the instances' clocks agree to within the time between
//! two acquisitions, and are not guaranteed otherwise. Where storage must never
//! accept a stale writer, use a single Redis or ZooKeeper, whose tokens are
//! strictly monotonic.
//!
//! # What it does not guarantee
//!
//! Redlock assumes bounded clock drift, network delay and process pauses; a
//! holder paused past its validity loses the lock without knowing until it runs
//! again (M. Kleppmann, "How to do distributed locking").
//!
//! # Cancel safety
//!
//! The core drops an acquisition's future when its wait runs out or its
//! request goes away. Dropped while it waits in this process's queue it leaves
//! nothing behind; dropped between two rounds, it leaves the lock's queue on
//! every instance in the background, after undoing what a failed undo may
//! have left granted (above). Dropped while a round is in
//! flight (the acquire scripts on every instance, or the undo of a failed
//! round), the round is undone in the background on every instance, retried
//! until its lease would have ended, as a dropped lock's release is; await
//! [`Backend::flush`](crate::Backend::flush) to see it done. A lock once
//! granted is released as above when dropped.

use std::future::{poll_fn, Future};
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;

use self::wait::Waiter;
use super::connection::Connection;
use super::layout::{redis_error, Attempt, Floor, Layout, Queue, Tokens};
use super::pubsub::Watches;
use crate::backend::engine::lease::{
    check_lease, drift, release_in_background, Lease, Protocol, Released,
};
use crate::backend::engine::renewal::Renewals;
use crate::backend::engine::{InFlight, Store};
use crate::backend::{
    Acquired, BreakScope, Broken, Capabilities, Inspection, LockRequest, RemoteBackend,
};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::Deadline;
use crate::mode::Wait;
use crate::token::FencingToken;

mod admin;
mod connect;
mod wait;

/// The longest pause between two attempts after a split round.
const MAX_RETRY_DELAY: Duration = Duration::from_millis(50);
/// The longest a waiter goes without looking: well within its place's
/// `QUEUE_TTL`.
const MAX_RECHECK: Duration = Duration::from_secs(1);
/// The most fencing tokens one acquisition reserves.
const MAX_TOKENS: u32 = 1 << 16;

/// Exclusive locks over several independent Redis servers, by Redlock.
///
/// See the [module documentation](self) for the algorithm and what its
/// fencing tokens can promise.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::redis::redlock::RedlockBackend;
/// use tower_lock::BackendExt;
///
/// let redlock = RedlockBackend::connect("redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379").await?;
/// let guard = redlock.lock("invoice:17").await?;
/// guard.release().await?;
/// # Ok(()) }
/// ```
pub type RedlockBackend = RemoteBackend<RedlockStore>;

/// The Redlock algorithm over the instances: the store behind
/// [`RedlockBackend`]. Its acquire path is here; the engine
/// ([`RemoteBackend`]) does the rest.
pub struct RedlockStore {
    nodes: Vec<Node>,
    prefix: String,
    tokens: Tokens,
    jitter: std::collections::hash_map::RandomState,
    releases: Arc<InFlight>,
    /// Leases whose first renewal is not due yet.
    renewals: Arc<Renewals>,
}

struct Node {
    addr: String,
    conn: ConnectionManager,
    /// The same connection, for subscriptions: release messages arrive on
    /// it as RESP3 pushes, for `watches`.
    link: Arc<Connection>,
    watches: Arc<Watches>,
}

/// How one round over the instances went.
struct Round {
    granted: usize,
    busy: usize,
    failed: Vec<String>,
    fence: u64,
    /// How many tokens the block ending at `fence` holds: the block that
    /// starts highest among the instances'.
    reserved: u32,
    /// The longest time left (ms) of a hold or turn that made an instance
    /// busy.
    busy_for: i64,
    /// By instance, whether it answered busy: it granted nothing (and may
    /// have queued the waiter). The others granted, or may have.
    busy_on: Vec<bool>,
    /// By instance, whether it granted. The others may have queued the
    /// waiter.
    granted_on: Vec<bool>,
}

impl RedlockStore {
    fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// Runs `op` on every instance at once; the results in instance order.
    /// The futures are polled together in place: a task per instance would
    /// cost more than the work.
    async fn on_all<T, E, F, Fut>(&self, op: F) -> Vec<Result<T, E>>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.on_some(|_| true, op).await
    }

    /// As [`on_all`](Self::on_all), on the instances `pick` picks (by
    /// their index).
    async fn on_some<T, E, F, Fut>(&self, pick: impl Fn(usize) -> bool, op: F) -> Vec<Result<T, E>>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let picked = self.nodes.iter().enumerate().filter(|(i, _)| pick(*i));
        join_all(picked.map(|(_, node)| op(node.conn.clone()))).await
    }

    async fn attempt(
        &self,
        layout: &Arc<Layout>,
        token: &Arc<str>,
        lease: Duration,
        tokens: u32,
        place: (Queue, u64),
    ) -> Round {
        let results = self
            .on_all(|mut conn| {
                let (layout, token) = (layout.clone(), token.clone());
                async move {
                    let floor = Floor::Fixed(0);
                    layout
                        .try_acquire(&mut conn, &token, lease, tokens, floor, place)
                        .await
                }
            })
            .await;
        let mut round = Round {
            granted: 0,
            busy: 0,
            failed: Vec::new(),
            fence: 0,
            reserved: tokens,
            busy_for: 0,
            busy_on: Vec::with_capacity(self.nodes.len()),
            granted_on: Vec::with_capacity(self.nodes.len()),
        };
        for (node, r) in self.nodes.iter().zip(results) {
            round.busy_on.push(matches!(r, Ok(Attempt::Busy { .. })));
            round
                .granted_on
                .push(matches!(r, Ok(Attempt::Granted { .. })));
            match r {
                Ok(Attempt::Granted { last, reserved }) => {
                    round.granted += 1;
                    // The block that starts highest: its first token is
                    // above every block an instance of the last grant's
                    // majority (which shares one with this one) handed out.
                    let start = last + 1 - u64::from(reserved);
                    if round.granted == 1 || start > round.fence + 1 - u64::from(round.reserved) {
                        round.fence = last;
                        round.reserved = reserved;
                    }
                }
                Ok(Attempt::Busy { ttl, .. }) => {
                    round.busy += 1;
                    round.busy_for = round.busy_for.max(ttl);
                }
                Err(e) => round.failed.push(format!("{}: {e}", node.addr)),
            }
        }
        round
    }

    /// Releases on every instance; how many answered. With a `deadline`, an
    /// instance that gave no answer is tried again until then.
    async fn release_all(
        &self,
        layout: &Arc<Layout>,
        token: &Arc<str>,
        deadline: Option<Instant>,
    ) -> usize {
        self.on_all(|conn| {
            let (layout, token) = (layout.clone(), token.clone());
            async move {
                layout
                    .release_until(|| conn.clone(), &token, deadline)
                    .await
                    .map(drop)
                    .map_err(|e| redis_error("releasing a lock", e))
            }
        })
        .await
        .iter()
        .filter(|r| r.is_ok())
        .count()
    }

    /// Undoes a round on the instances `pick` picks, once; a waiter goes
    /// back in their queues at its `score` (see [`Layout::undo`]). Whether
    /// every one answered.
    async fn undo_on(
        &self,
        pick: impl Fn(usize) -> bool,
        layout: &Arc<Layout>,
        token: &Arc<str>,
        score: Option<u64>,
    ) -> bool {
        self.on_some(pick, |mut conn| {
            let (layout, token) = (layout.clone(), token.clone());
            async move {
                match score {
                    Some(score) => layout.undo(&mut conn, &token, score).await,
                    None => layout.release(&mut conn, &token).await.map(drop),
                }
            }
        })
        .await
        .iter()
        .all(Result::is_ok)
    }

    fn retry_delay(&self, token: &str, attempt: u32) -> Duration {
        let r = self.jitter.hash_one((token, attempt));
        MAX_RETRY_DELAY.mul_f64((r % 1000) as f64 / 1000.0)
    }
}

impl Store for RedlockStore {
    const NAME: &'static str = "redlock";

    async fn acquire(self: Arc<Self>, request: LockRequest) -> Result<Acquired, LockError> {
        check_lease(request.lease, "Redlock")?;
        let tokens = request.tokens.clamp(1, MAX_TOKENS);
        let layout = Arc::new(Layout::new(&self.prefix, &request.key, request.mode));
        let token: Arc<str> = self.tokens.next().into();
        let lease = request.lease;
        let drift = drift(lease);
        let quorum = self.quorum();
        let waits = request.wait != Wait::FailFast;
        // A waiter's place in the lock's queue on every instance (see
        // Waiting in the module's documentation), and what it hears.
        let mut waiter = Waiter::new(&self, &layout, &token, waits);
        let mut tries = 0;
        let (fence, reserved, started) = loop {
            let mut armed = waiter.arm().await;
            let started = tokio::time::Instant::now();
            // Dropped from here until the round is kept or undone (the wait
            // ran out, the request went away), the round is undone in the
            // background: instances that granted it must not keep the key.
            let in_flight = RoundInFlight {
                inner: &self,
                layout: &layout,
                token: &token,
                lease,
            };
            let round = self
                .attempt(&layout, &token, lease, tokens, waiter.place())
                .await;
            let elapsed = started.elapsed();
            if round.granted >= quorum && elapsed + drift < lease {
                std::mem::forget(in_flight);
                // Where it was not granted it may be queued: it leaves
                // there, in the background.
                waiter.granted(round.granted_on);
                break (round.fence, round.reserved, started);
            }
            // Undone where it was granted, and where no answer came: it
            // may have landed, behind the attempt on the same connection.
            // Sent once: the next round uses the same token, and an undo
            // sent again later could free that round's grant. Where it
            // fails, what landed is this acquisition's own: the next round
            // takes it again (a script grants again to its holder), and an
            // acquisition that ends without the lock undoes every round
            // then, sending again until the last one's lease would end.
            if round.busy < self.nodes.len() {
                let busy = &round.busy_on;
                let undone = self
                    .undo_on(|i| !busy[i], &layout, &token, waiter.score())
                    .await;
                if !undone || !round.failed.is_empty() {
                    waiter.may_hold_until((started + lease).into_std());
                }
            }
            waiter.silent_on(&round.busy_on, &round.granted_on);
            std::mem::forget(in_flight);
            if self.nodes.len() - round.failed.len() < quorum {
                return Err(LockError::backend(
                    "redlock",
                    format!(
                        "only {} of {} instances answered, a majority needs {quorum} ({})",
                        self.nodes.len() - round.failed.len(),
                        self.nodes.len(),
                        round.failed.join("; ")
                    ),
                    None,
                ));
            }
            if !waits {
                return Err(LockError::Busy);
            }
            tries += 1;
            // Some instances granted it and others did not: waiters split
            // them (instances that named different waiters, or a lock that
            // ran out and named nobody). The undo put this waiter back in
            // those queues at its place, so every instance now names the
            // same first waiter; a jittered pause, as Redlock's, spreads
            // the next round meanwhile.
            // Held by others on a majority, though, the lock is theirs
            // until its release names a waiter (or their hold runs out).
            let held_elsewhere = round.busy >= quorum;
            let recheck = match held_elsewhere || round.granted == 0 {
                true => busy_for(&round),
                false => self.retry_delay(&token, tries),
            };
            waiter.wait(&mut armed, recheck, held_elsewhere).await;
        };
        drop(waiter);
        let valid = Arc::new(Deadline::new((started + lease - drift).into_std()));
        let releases = self.releases.clone();
        let renewals = self.renewals.clone();
        let lock = RedlockLock {
            inner: self,
            layout,
            token,
        };
        let lease = Lease::new(lock, lease, valid, releases);
        lease.keep_renewed(&renewals);
        // The block that starts highest (fewer tokens than asked if its
        // instance's counter neared its clock).
        Ok(lease.acquired(FencingToken::new(fence + 1 - u64::from(reserved)), reserved))
    }

    fn releases(&self) -> &Arc<InFlight> {
        &self.releases
    }

    async fn inspect(self: Arc<Self>, key: LockKey) -> Result<Inspection, LockError> {
        self.inspect_key(key).await
    }

    async fn list(self: Arc<Self>, prefix: String) -> Result<Vec<LockKey>, LockError> {
        self.list_keys(prefix).await
    }

    async fn break_lock(
        self: Arc<Self>,
        key: LockKey,
        _scope: BreakScope,
    ) -> Result<Broken, LockError> {
        self.break_key(key).await
    }

    // Every instance's connection keeps its commands in order.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .exclusive_only()
            .max_tokens(MAX_TOKENS)
            .ordered_release(true)
    }
}

/// How long a round's busy answers say the lock stays held: until the
/// longest of them runs out, and at most `MAX_RECHECK`.
fn busy_for(round: &Round) -> Duration {
    Duration::from_millis(round.busy_for.max(0) as u64 + 1).min(MAX_RECHECK)
}

/// Runs `futures` together, polled in place; their outputs in order.
async fn join_all<Fut: Future>(futures: impl IntoIterator<Item = Fut>) -> Vec<Fut::Output> {
    let mut pending: Vec<Pin<Box<Fut>>> = futures.into_iter().map(Box::pin).collect();
    let mut results: Vec<Option<Fut::Output>> = (0..pending.len()).map(|_| None).collect();
    poll_fn(|cx| {
        let mut waiting = false;
        for (fut, slot) in pending.iter_mut().zip(results.iter_mut()) {
            if slot.is_none() {
                match fut.as_mut().poll(cx) {
                    Poll::Ready(r) => *slot = Some(r),
                    Poll::Pending => waiting = true,
                }
            }
        }
        if waiting {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    results
        .into_iter()
        .map(|r| r.expect("every future finished"))
        .collect()
}

/// A lock held by a majority: its keys and owner token.
struct RedlockLock {
    inner: Arc<RedlockStore>,
    layout: Arc<Layout>,
    token: Arc<str>,
}

impl RedlockLock {
    fn released_on(&self, released: usize) -> Result<(), LockError> {
        if released >= self.inner.quorum() {
            return Ok(());
        }
        Err(LockError::backend(
            "redlock",
            format!(
                "released on {released} of {} instances; the rest expire with the lease",
                self.inner.nodes.len()
            ),
            None,
        ))
    }
}

impl Protocol for RedlockLock {
    const BACKEND: &'static str = "redlock";
    const EXPIRED: &'static str = "the lease ran out before a majority renewed it";

    fn describe(&self) -> &str {
        self.layout.name()
    }

    /// Renews on every instance; fewer than a majority means the lock is
    /// lost.
    async fn renew(&self, lease: Duration) -> Result<(), String> {
        let (layout, token) = (&self.layout, &self.token);
        let results = self
            .inner
            .on_all(|mut conn| {
                let (layout, token) = (layout.clone(), token.clone());
                async move { layout.extend(&mut conn, &token, lease).await }
            })
            .await;
        let ok = results.iter().filter(|r| matches!(r, Ok(true))).count();
        let quorum = self.inner.quorum();
        if ok >= quorum {
            return Ok(());
        }
        Err(format!(
            "only {ok} of {} instances renewed the lease, a majority needs {quorum}",
            results.len()
        ))
    }

    async fn release(&self) -> Released {
        let released = self
            .inner
            .release_all(&self.layout, &self.token, None)
            .await;
        Released {
            result: self.released_on(released),
            // Some did not answer: go on trying in the background.
            again: released < self.inner.nodes.len(),
        }
    }

    async fn release_until(&self, deadline: Instant) -> Result<(), LockError> {
        let released = self
            .inner
            .release_all(&self.layout, &self.token, Some(deadline))
            .await;
        self.released_on(released)
    }
}

/// An acquisition round in flight: dropped (the acquisition was cancelled)
/// before it is kept or undone, it undoes the round on every instance in
/// the background, retrying until the round's lease would have ended, and
/// [`Backend::flush`](crate::Backend::flush) waits for that.
struct RoundInFlight<'a> {
    inner: &'a Arc<RedlockStore>,
    layout: &'a Arc<Layout>,
    token: &'a Arc<str>,
    lease: Duration,
}

impl Drop for RoundInFlight<'_> {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        let (layout, token) = (self.layout.clone(), self.token.clone());
        let deadline = Instant::now() + self.lease;
        let releases = inner.releases.clone();
        let undo = async move {
            inner.release_all(&layout, &token, Some(deadline)).await;
            Ok(())
        };
        release_in_background(undo, &releases, "redlock");
    }
}
