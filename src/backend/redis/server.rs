//! One Redis server, spoken to directly: the acquire loop, renewal and
//! release of one lock. [`RemoteBackend`](crate::backend::RemoteBackend)
//! puts the engine in front.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::connection::Connection;
use super::layout::{granted_lease, redis_error, uncertain, Attempt, Floor, Layout, Queue, Tokens};
use super::pubsub::{HandOffWait, Watch, Watches};
use super::replicas::{Acked, Replicas};
use super::scripts::{EPOCH_STRIDE, MAX_FLOOR, NEXT_TTL};
use crate::backend::engine::lease::{
    check_lease, known_until, release_in_background, Lease, Protocol, Released,
};
use crate::backend::engine::renewal::Renewals;
use crate::backend::engine::{InFlight, Store};
use crate::backend::{
    Acquired, BackendFuture, BreakScope, Broken, Capabilities, Inspection, LockRequest,
};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::Deadline;
use crate::mode::Wait;
use crate::token::FencingToken;

/// The longest a waiter sleeps without a release message before it looks
/// again: covers holders that never publish (redis-py) and lost messages.
const MAX_RECHECK: Duration = Duration::from_secs(1);
/// The most fencing tokens one acquisition reserves.
const MAX_TOKENS: u32 = 1 << 16;

/// One Redis server, or the master Sentinel names, or a Cluster: the
/// store behind [`RedisBackend`](super::RedisBackend). Its acquire path is
/// here; the engine ([`RemoteBackend`](crate::backend::RemoteBackend)) does
/// the rest.
pub struct RedisStore {
    pub(super) conn: Arc<Connection>,
    /// Writes count only once this many replicas have them.
    pub(super) replicas: Option<Replicas>,
    /// How long an acquire waits for the master to be confirmed.
    pub(super) response_timeout: Duration,
    pub(super) prefix: String,
    pub(super) quarantine: Option<Duration>,
    /// Whether a release may grant the lock to a waiter directly (see
    /// `Layout::direct_grants`).
    pub(super) direct_grants: bool,
    pub(super) watches: Arc<Watches>,
    pub(super) tokens: Tokens,
    pub(super) releases: Arc<InFlight>,
    /// Leases whose first renewal is not due yet.
    pub(super) renewals: Arc<Renewals>,
}

// One connection: a release sent lands before the next acquire.
impl Store for RedisStore {
    const NAME: &'static str = "redis";

    async fn acquire(self: Arc<Self>, request: LockRequest) -> Result<Acquired, LockError> {
        check_lease(request.lease, "Redis")?;
        if let Some(q) = self.quarantine.filter(|q| request.lease > *q) {
            return Err(LockError::Config(format!(
                "a lease of {} ms is longer than this backend's restart quarantine of {} ms",
                request.lease.as_millis(),
                q.as_millis()
            )));
        }
        let layout = Layout::new(&self.prefix, &request.key, request.mode)
            .with_quarantine(&self.prefix, self.quarantine)
            .sharded(&self.prefix, self.conn.is_cluster())
            .direct_grants(self.direct_grants);
        let tokens = request.tokens.clamp(1, MAX_TOKENS);
        let token = self.tokens.next();
        let mut sent = Instant::now();
        let waits = request.wait != Wait::FailFast;
        // Named only for a wait, or to look for a subscription when there
        // are any: most acquisitions find their key free.
        let mut channel: Option<String> = None;
        // A subscription left from an earlier wait here hears releases from
        // now on: watching before the first attempt, a busy answer needs no
        // second attempt once subscribed.
        let early = match waits && self.watches.any() {
            true => {
                let c = channel.insert(layout.waiter_channel(&self.tokens.prefix()));
                match self.watches.subscribed(c) {
                    true => {
                        let grantee = grantee(&layout, &token);
                        Some(self.watches.watch(&self.conn, c, grantee).await)
                    }
                    false => None,
                }
            }
            false => None,
        };
        let mut armed = early.as_ref().map(Watch::arm);
        let queue = if waits { Queue::OnBusy } else { Queue::Never };
        let mut attempt = self
            .attempt(&layout, &token, request.lease, tokens, queue)
            .await?;
        if let (Attempt::Busy { .. }, false) = (&attempt, waits) {
            return Err(LockError::Busy);
        }
        // The lease the lock is held for from `sent`: a direct grant's is
        // shorter (see `granted_lease`).
        let mut held_for = request.lease;
        if let Attempt::Busy { .. } = attempt {
            let channel = channel.unwrap_or_else(|| layout.waiter_channel(&self.tokens.prefix()));
            // In the lock's queue now (an exclusive lock): leaves it if
            // dropped before its turn.
            let mut queued = Undo {
                inner: &self,
                layout: &layout,
                token: &token,
                lease: request.lease,
                in_flight: false,
                armed: layout.has_queue(),
            };
            let watch = match early {
                Some(watch) => watch,
                None => {
                    let grantee = grantee(&layout, &token);
                    self.watches.watch(&self.conn, &channel, grantee).await
                }
            };
            // What the last busy answer says no later grant is below: a
            // direct grant at or below it is taken as older than that answer
            // (one as new is refused too, and taken by the next attempt).
            let mut busy_at = 0;
            let granted = granted_lease(request.lease);
            'wait: loop {
                // Armed before the attempt, so a release published between
                // the attempt and the wait is not missed.
                let mut released = match armed.take() {
                    Some(released) => released,
                    None => {
                        let released = watch.arm();
                        watch.subscribe(&self.conn).await;
                        // A grant made before this attempt runs is its
                        // answer (the script grants again to its holder):
                        // one heard after it is judged against it alone.
                        watch.forget_grant();
                        sent = Instant::now();
                        attempt = self
                            .attempt(&layout, &token, request.lease, tokens, Queue::Queued)
                            .await?;
                        released
                    }
                };
                let Attempt::Busy { ttl, fence } = attempt else {
                    break;
                };
                busy_at = busy_at.max(fence);
                let mut recheck = u64::try_from(ttl)
                    .map(|ms| Duration::from_millis(ms + 1))
                    .unwrap_or(MAX_RECHECK)
                    .min(MAX_RECHECK);
                loop {
                    tokio::select! {
                        _ = released.released.as_mut() => {}
                        _ = tokio::time::sleep(recheck) => break,
                    }
                    // Granted after the last busy answer, so held from
                    // before the grant, from `sent`, the send time of
                    // that attempt, for the grant's lease (`granted_lease`);
                    // heard too late to be worth it, taken by an attempt
                    // (the script grants again to its holder).
                    let grant = watch.grant().filter(|g| {
                        g.last > busy_at
                            && known_until(sent, granted) > Instant::now() + granted / 3
                    });
                    if let Some(grant) = grant {
                        attempt = Attempt::Granted {
                            last: grant.last,
                            reserved: grant.reserved.clamp(1, tokens),
                        };
                        held_for = granted;
                        break 'wait;
                    }
                    // Else a release named the waiter ahead of this one:
                    // the lock is that waiter's until its turn is over.
                    if watch.for_us_or_rearm(&mut released) {
                        break;
                    }
                    recheck = NEXT_TTL + Duration::from_millis(1);
                }
            }
            queued.armed = false;
        }
        let Attempt::Granted { last, reserved } = attempt else {
            unreachable!("the loop ends on a grant");
        };
        // The script reserved the block of tokens up to `last`.
        let reserved = if layout.reserves_block() { reserved } else { 1 };
        let first = last + 1 - u64::from(reserved);
        let valid = Arc::new(Deadline::new(known_until(sent, held_for)));
        let releases = self.releases.clone();
        let renewals = self.renewals.clone();
        let lock = RedisLock {
            server: self,
            layout,
            token,
            heard_elsewhere: AtomicBool::new(false),
        };
        let lease = Lease::new(lock, request.lease, valid, releases);
        lease.keep_renewed_granted(&renewals, held_for);
        Ok(lease.acquired(FencingToken::new(first), reserved))
    }

    fn releases(&self) -> &Arc<InFlight> {
        &self.releases
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .max_tokens(MAX_TOKENS)
            .ordered_release(true)
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
}

impl RedisStore {
    /// One acquire script. Dropped while it is in flight (the caller gave
    /// up), or failed without an answer, it may still have granted the lock:
    /// then the lock is released in the background.
    async fn attempt(
        self: &Arc<Self>,
        layout: &Layout,
        token: &str,
        lease: Duration,
        tokens: u32,
        queue: Queue,
    ) -> Result<Attempt, LockError> {
        let (mut conn, breaks, epoch) = self.conn.for_locking(self.response_timeout).await?;
        let floor = match self.conn.is_cluster() {
            true => Floor::ClusterEpoch,
            false => Floor::Fixed(sentinel_floor(epoch)?),
        };
        let mut in_flight = Undo {
            inner: self,
            layout,
            token,
            lease,
            in_flight: true,
            armed: true,
        };
        let result = match self.replicas {
            None => {
                layout
                    .try_acquire(&mut conn, token, lease, tokens, floor, (queue, 0))
                    .await
            }
            Some(replicas) => {
                let mut acked = Acked::new(&mut conn, replicas);
                match layout
                    .try_acquire(&mut acked, token, lease, tokens, floor, (queue, 0))
                    .await
                {
                    // Not on enough replicas: released when `in_flight` drops.
                    Ok(granted @ Attempt::Granted { .. }) => {
                        acked.check("the lock").map(|()| granted)
                    }
                    other => other,
                }
            }
        };
        // Reconnected meanwhile, maybe to a server that is no longer the
        // master: not trusted (released when `in_flight` drops).
        let result = result.and_then(|attempt| match attempt {
            Attempt::Granted { .. } if self.conn.broke_since(breaks) => Err(LockError::backend(
                "redis",
                "the connection to the master broke while the lock was taken",
                None,
            )),
            attempt => Ok(attempt),
        });
        if result.is_err() {
            self.conn.suspect();
        }
        in_flight.armed = result.is_err();
        result
    }
}

/// What a dropped acquisition leaves behind, undone in the background: an
/// acquire script in flight (`in_flight`) may have granted the lock,
/// released by compare-and-delete on the attempt's token (harmless if it
/// granted nothing), or queued it; a waiter has a place in the exclusive
/// lock's queue, which it leaves, handing its turn on if a release had
/// given it one: named it, or granted it the lock directly (released by
/// its token, as a lock is). A place left there would run out by itself
/// (`QUEUE_TTL`), and hold the lock back up to `NEXT_TTL` if named, up to
/// the grant's lease (`granted_lease`) if granted.
struct Undo<'a> {
    inner: &'a Arc<RedisStore>,
    layout: &'a Layout,
    token: &'a str,
    /// The acquisition's lease: what it may hold is released (sent again
    /// while unanswered) until that would have ended.
    lease: Duration,
    in_flight: bool,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (inner, layout, token) = (
            self.inner.clone(),
            self.layout.clone(),
            self.token.to_owned(),
        );
        let now = Instant::now();
        let release = self.in_flight.then(|| now + self.lease);
        // A direct grant is released by leaving: sent again as a release.
        let leave = layout.grants().then(|| now + granted_lease(self.lease));
        let releases = inner.releases.clone();
        release_in_background(
            async move {
                let released = match release {
                    Some(deadline) => layout
                        .release_until(|| inner.conn.get(), &token, Some(deadline))
                        .await
                        .map(drop)
                        .map_err(|e| redis_error("releasing an abandoned attempt", e)),
                    None => Ok(()),
                };
                let left = layout
                    .leave_queue_until(|| inner.conn.get(), &token, leave)
                    .await
                    .map_err(|e| redis_error("leaving a lock's queue", e));
                released.and(left)
            },
            &releases,
            "redis",
        );
    }
}

/// How long a hand-off to waiters elsewhere waits for their release before
/// this process's next waiter asks anyway (a waiter that heard the release
/// but did not come: gone, or given up).
const HAND_OFF_GRACE: Duration = Duration::from_millis(5);

/// A lock held in Redis: its keys and owner token.
pub(super) struct RedisLock {
    server: Arc<RedisStore>,
    layout: Layout,
    token: String,
    /// Set by an answered release that subscribers elsewhere heard.
    heard_elsewhere: AtomicBool,
}

impl Protocol for RedisLock {
    const BACKEND: &'static str = "redis";
    const EXPIRED: &'static str = "the lease ran out before it was renewed";

    fn describe(&self) -> &str {
        self.layout.name()
    }

    async fn renew(&self, lease: Duration) -> Result<(), String> {
        let mut conn = self.server.conn.get();
        let extended = match self.server.replicas {
            None => self.layout.extend(&mut conn, &self.token, lease).await,
            Some(replicas) => {
                let mut acked = Acked::new(&mut conn, replicas);
                match self.layout.extend(&mut acked, &self.token, lease).await {
                    Ok(true) => acked.check("the renewal").map(|()| true),
                    other => other,
                }
            }
        };
        match extended {
            Ok(true) => Ok(()),
            Ok(false) => Err("the lock expired or another owner took it".to_owned()),
            Err(e) => {
                self.server.conn.suspect();
                Err(format!("renewing the lease failed: {e}"))
            }
        }
    }

    fn renew_now(&self) -> Option<Arc<Notify>> {
        Some(self.server.watches.reconnected.clone())
    }

    async fn release(&self) -> Released {
        match self
            .layout
            .release_until(|| self.server.conn.get(), &self.token, None)
            .await
        {
            Ok(heard) => {
                // This connection's own subscription, if it has one, is
                // not a waiter elsewhere (looked up only when someone
                // heard: most releases are heard by no one).
                // With a queue, the release named the next waiter and
                // nobody overtakes it: nothing to hand off.
                let elsewhere = heard > 0
                    && !self.layout.has_queue()
                    && heard > u64::from(self.server.watches.subscribed(&self.layout.channel()));
                self.heard_elsewhere.store(elsewhere, Ordering::Relaxed);
                Released {
                    result: Ok(()),
                    again: false,
                }
            }
            Err(e) => Released {
                // It may not have run: go on trying in the background.
                again: uncertain(&e),
                result: Err(redis_error("releasing a lock", e)),
            },
        }
    }

    fn hand_off(&self) -> Option<BackendFuture<()>> {
        if !self.heard_elsewhere.swap(false, Ordering::Relaxed) {
            return None;
        }
        let (server, channel) = (self.server.clone(), self.layout.channel());
        // Armed now if subscribed, before the other process can have
        // released; this backend's own releases do not count.
        let armed = match server.watches.hand_off_wait(&channel) {
            HandOffWait::Off => return None,
            HandOffWait::Armed(released) => Some(released),
            HandOffWait::Unsubscribed => None,
        };
        Some(BackendFuture::new(async move {
            let (released, watch) = match armed {
                Some(released) => (released, None),
                // Subscribed first (a round trip, off the release's path);
                // a release heard meanwhile is missed, so the grace ending
                // this wait says nothing of the listeners.
                None => {
                    let watch = server.watches.watch(&server.conn, &channel, None).await;
                    match server.watches.hand_off_wait(&channel) {
                        HandOffWait::Armed(released) => (released, Some(watch)),
                        _ => return,
                    }
                }
            };
            let subscribed_before = watch.is_none();
            tokio::select! {
                _ = released => {}
                _ = tokio::time::sleep(HAND_OFF_GRACE) => {
                    if subscribed_before {
                        server.watches.unanswered(&channel);
                    }
                }
            }
            // Subscribed for this wait: the subscription may linger now.
            drop(watch);
        }))
    }

    async fn release_until(&self, deadline: Instant) -> Result<(), LockError> {
        self.layout
            .release_until(|| self.server.conn.get(), &self.token, Some(deadline))
            .await
            .map(drop)
            .map_err(|e| redis_error("releasing a lock", e))
    }
}

/// The token a wait on `layout`'s channel hears direct grants to: the
/// acquisition's, where a release may grant it the lock directly.
fn grantee<'a>(layout: &Layout, token: &'a str) -> Option<&'a str> {
    layout.grants().then_some(token)
}

/// The fencing floor for a master the Sentinels named under `epoch` (0
/// without Sentinel): see `EPOCH_STRIDE`.
pub(super) fn sentinel_floor(epoch: u64) -> Result<u64, LockError> {
    epoch
        .checked_mul(EPOCH_STRIDE)
        .filter(|f| *f <= MAX_FLOOR)
        .ok_or_else(|| {
            LockError::backend(
                "redis",
                format!(
                    "the Sentinels' config epoch {epoch} is above {}, the highest this \
                     backend's fencing tokens can carry",
                    MAX_FLOOR / EPOCH_STRIDE
                ),
                None,
            )
        })
}
