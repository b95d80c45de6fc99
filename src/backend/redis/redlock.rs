//! Redlock over several independent Redis servers (feature `redis`).
//!
//! The algorithm of the Redis documentation: take the lock on every instance
//! at once, with the same random token and the scripts and key layout of the
//! [single-instance backend](super::RedisBackend); it is held if a majority
//! (N/2 + 1) granted it and time is left, that is if
//! `validity = lease − elapsed − drift` is positive, drift being 1% of the lease
//! plus 2 ms. Otherwise the attempt is undone on every instance (also those that
//! did not answer) and tried again after a random pause of up to 50 ms, until
//! the caller's wait runs out. Renewal every third of the lease also needs a
//! majority; anything less fires the lost signal. Only exclusive locks.
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
//! again (M. Kleppmann, "How to do distributed locking"). Waiting is by jittered
//! retries, not release messages, and is not first-come-first-served across
//! processes (it is within one).
//!
//! # Cancel safety
//!
//! The core drops an acquisition's future when its wait runs out or its
//! request goes away. Dropped while it waits in this process's queue or
//! between two rounds, it leaves nothing behind. Dropped while a round is in
//! flight (the acquire scripts on every instance, or the undo of a failed
//! round), the round is undone in the background on every instance, retried
//! until its lease would have ended, as a dropped lock's release is; await
//! [`Backend::flush`](crate::Backend::flush) to see it done. A lock once
//! granted is released as above when dropped.

use std::fmt;
use std::future::{poll_fn, Future};
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::layout::{redis_error, Attempt, Floor, Layout, Queue, Tokens};
use super::options::check_tls_support;
use crate::backend::engine::lease::{
    check_lease, drift, release_in_background, Lease, Protocol, Released,
};
use crate::backend::engine::renewal::Renewals;
use crate::backend::engine::{InFlight, Store};
use crate::backend::{
    Acquired, BreakScope, Broken, Capabilities, CohortOptions, Holder, Inspection, LockRequest,
    RemoteBackend,
};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::Deadline;
use crate::mode::Wait;
use crate::token::FencingToken;

/// The longest pause between two attempts.
const MAX_RETRY_DELAY: Duration = Duration::from_millis(50);
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
}

impl RedlockBackend {
    /// Connects to `redlock://host1:port1,host2:port2,...` (at least three
    /// instances, best an odd number). Instances that are down are connected
    /// to when they come up; the lock works while a majority answers.
    ///
    /// Each instance may be given as `[user][:password@]host:port`, as in a
    /// `redis://` URL (see [`RedisBackend::connect`](super::RedisBackend::connect)).
    ///
    /// `redlocks://h1:p1,h2:p2,h3:p3` connects to every instance over TLS,
    /// as `rediss://` does (feature `redis-tls`; without it the URL is a
    /// [`LockError::Config`] that says so): each server's certificate must be
    /// valid for its host and chain to a CA of the system's trust store
    /// (OpenSSL's: `/etc/ssl/certs`, or what the `SSL_CERT_FILE` /
    /// `SSL_CERT_DIR` environment variables name, the way to trust a private
    /// CA here). `redlocks://h1:p1,h2:p2,h3:p3#insecure` checks neither
    /// certificates nor host names (for tests). All instances use TLS or
    /// none.
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for a malformed URL or fewer than three
    /// instances. An instance that cannot be reached, or whose TLS handshake
    /// fails, makes acquisitions fail once no majority answers.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_lock::backend::redis::redlock::RedlockBackend;
    /// use tower_lock::LockError;
    ///
    /// // Refused before anything is connected to: Redlock needs three servers or more.
    /// let two = RedlockBackend::connect("redlock://127.0.0.1:6379,127.0.0.1:6380").await;
    /// assert!(matches!(two, Err(LockError::Config(_))));
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let (scheme, list) = url.split_once("://").unwrap_or(("", url));
        let tls = match scheme {
            "redlock" => false,
            "redlocks" => {
                check_tls_support("redlocks")?;
                true
            }
            _ => {
                return Err(LockError::Config(format!(
                    "{url:?} is not a redlock:// (or, over TLS, redlocks://) URL"
                )))
            }
        };
        let (list, fragment) = match list.split_once('#') {
            Some((list, fragment)) => (list, Some(fragment)),
            None => (list, None),
        };
        let node_url: fn(&str) -> String = match (tls, fragment) {
            (false, None) => |addr: &str| format!("redis://{addr}/"),
            (true, None) => |addr: &str| format!("rediss://{addr}/"),
            (true, Some("insecure")) => |addr: &str| format!("rediss://{addr}/#insecure"),
            _ => {
                return Err(LockError::Config(format!(
                    "a Redlock URL takes no fragment but #insecure, with redlocks://: {url:?}"
                )))
            }
        };
        let addrs: Vec<&str> = list.trim_end_matches('/').split(',').collect();
        if addrs.len() < 3 || addrs.iter().any(|a| a.is_empty()) {
            return Err(LockError::Config(format!(
                "Redlock needs at least three instances, as redlock://h1:p1,h2:p2,h3:p3; got {url:?}"
            )));
        }
        let mut nodes = Vec::with_capacity(addrs.len());
        for given in addrs {
            // For messages: the instance without its user and password.
            let addr = given.rsplit_once('@').map_or(given, |(_, host)| host);
            let client = redis::Client::open(node_url(given))
                .map_err(|e| LockError::Config(format!("invalid Redis address {addr:?}: {e}")))?;
            // Short timeouts: a dead instance must not hold up the majority.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(200)))
                .set_response_timeout(Some(Duration::from_millis(200)))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(200));
            let conn = ConnectionManager::new_lazy_with_config(client, config)
                .map_err(|e| redis_error(&format!("connecting to {addr}"), e))?;
            nodes.push(Node {
                addr: addr.to_owned(),
                conn,
            });
        }
        let store = RedlockStore {
            nodes,
            prefix: "lock:".into(),
            tokens: Tokens::new(),
            jitter: Default::default(),
            releases: Arc::default(),
            renewals: Renewals::new(None),
        };
        Ok(RemoteBackend::new(store, CohortOptions::default()))
    }

    /// The same backend with another [`Cohort`](crate::backend::Cohort) bound, or
    /// [`CohortOptions::off`] to send every acquisition to the instances.
    /// On by default, as for the [single-instance backend](super#passing-a-lock-on).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
    /// use tower_lock::backend::CohortOptions;
    /// use tower_lock::backend::redis::redlock::RedlockBackend;
    ///
    /// let redlock = RedlockBackend::connect("redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379")
    ///     .await?
    ///     .with_cohort(CohortOptions::off());
    /// # Ok(()) }
    /// ```
    pub fn with_cohort(self, options: CohortOptions) -> Self {
        self.recohorted(options)
    }
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes = &self.store().nodes;
        let addrs: Vec<&str> = nodes.iter().map(|n| n.addr.as_str()).collect();
        f.debug_struct("RedlockBackend")
            .field("instances", &addrs)
            .field("cohort", &self.cohort_options())
            .finish_non_exhaustive()
    }
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
}

impl RedlockStore {
    fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// Runs `op` on every instance with the key prefix; the answers of
    /// those that answered, if a majority did. `doing` names it in errors.
    async fn on_a_majority<T, F, Fut>(&self, doing: &str, op: F) -> Result<Vec<T>, LockError>
    where
        F: Fn(ConnectionManager, String) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let mut answered = Vec::with_capacity(self.nodes.len());
        let mut failed = None;
        for answer in self.on_all(|conn| op(conn, self.prefix.clone())).await {
            match answer {
                Ok(answer) => answered.push(answer),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        if answered.len() >= self.quorum() {
            return Ok(answered);
        }
        let (n, of) = (answered.len(), self.nodes.len());
        // The first failure is the source.
        let source = failed.map(|e| Box::new(e) as _);
        let message = format!("{doing}: only {n} of {of} instances answered");
        Err(LockError::backend("redlock", message, source))
    }

    /// The holders seen on at least `least` instances, once each, with the
    /// least time left among them and on how many instances they are.
    fn tally(&self, answered: Vec<Vec<Holder>>, least: usize) -> Vec<Holder> {
        let mut seen: Vec<(Holder, usize)> = Vec::new();
        for holder in answered.into_iter().flatten() {
            match seen
                .iter_mut()
                .find(|(h, _)| h.identity == holder.identity && h.mode == holder.mode)
            {
                Some((h, n)) => {
                    *n += 1;
                    h.lease_left = h.lease_left.min(holder.lease_left);
                }
                None => seen.push((holder, 1)),
            }
        }
        let n = self.nodes.len();
        seen.into_iter()
            .filter(|(_, on)| *on >= least)
            .map(|(h, on)| {
                let who = h.identity.clone().unwrap_or_default();
                h.identity(format!("{who} on {on} of {n} instances"))
            })
            .collect()
    }

    /// Runs `op` on every instance at once; the results in instance order.
    /// The futures are polled together in place: a task per instance would
    /// cost more than the work.
    async fn on_all<T, E, F, Fut>(&self, op: F) -> Vec<Result<T, E>>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut pending: Vec<Pin<Box<Fut>>> = self
            .nodes
            .iter()
            .map(|node| Box::pin(op(node.conn.clone())))
            .collect();
        let mut results: Vec<Option<Result<T, E>>> = (0..pending.len()).map(|_| None).collect();
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

    async fn attempt(
        &self,
        layout: &Arc<Layout>,
        token: &Arc<str>,
        lease: Duration,
        tokens: u32,
    ) -> Round {
        let results = self
            .on_all(|mut conn| {
                let (layout, token) = (layout.clone(), token.clone());
                async move {
                    layout
                        .try_acquire(
                            &mut conn,
                            &token,
                            lease,
                            tokens,
                            Floor::Fixed(0),
                            Queue::Never,
                        )
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
        };
        for (node, r) in self.nodes.iter().zip(results) {
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
                Ok(Attempt::Busy(_)) => round.busy += 1,
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
        let layout =
            Arc::new(Layout::new(&self.prefix, &request.key, request.mode).without_queue());
        let token: Arc<str> = self.tokens.next().into();
        let lease = request.lease;
        let drift = drift(lease);
        let quorum = self.quorum();
        let mut tries = 0;
        let (fence, reserved, started) = loop {
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
            let round = self.attempt(&layout, &token, lease, tokens).await;
            let elapsed = started.elapsed();
            if round.granted >= quorum && elapsed + drift < lease {
                std::mem::forget(in_flight);
                break (round.fence, round.reserved, started);
            }
            // Undo everywhere, also where no answer came: it may have landed.
            self.release_all(&layout, &token, None).await;
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
            if request.wait == Wait::FailFast {
                return Err(LockError::Busy);
            }
            tries += 1;
            tokio::time::sleep(self.retry_delay(&token, tries)).await;
        };
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

    /// Each instance's holders; a holder shows when a majority has its
    /// owner, with the least time left among them (the one that bounds the
    /// lock). No token, no waiters, as on one server.
    async fn inspect(self: Arc<Self>, key: LockKey) -> Result<Inspection, LockError> {
        let answered = self
            .on_a_majority("inspecting a lock", |mut conn, prefix| {
                let key = key.clone();
                async move { super::inspect::holders(&mut conn, &prefix, &key).await }
            })
            .await?;
        let holders = self.tally(answered, self.quorum());
        Ok(Inspection {
            key,
            holders,
            waiters: None,
        })
    }

    /// The keys a majority of the instances has a lock key for.
    async fn list(self: Arc<Self>, prefix: String) -> Result<Vec<LockKey>, LockError> {
        let answered = self
            .on_a_majority("listing locks", |mut conn, lock_prefix| {
                let prefix = prefix.clone();
                async move { super::inspect::held_keys(&mut conn, &lock_prefix, &prefix).await }
            })
            .await?;
        let mut all: Vec<LockKey> = answered.into_iter().flatten().collect();
        all.sort_unstable();
        let mut keys = Vec::new();
        for group in all.chunk_by(|a, b| a == b) {
            if group.len() >= self.quorum() {
                keys.push(group[0].clone());
            }
        }
        Ok(keys)
    }

    /// Breaks the lock on every instance; a majority must answer. The
    /// floor is the highest of their raised counters: above the tokens
    /// handed out before as far as Redlock's tokens rise at all (see
    /// [Fencing tokens](self#fencing-tokens)).
    async fn break_lock(
        self: Arc<Self>,
        key: LockKey,
        _scope: BreakScope,
    ) -> Result<Broken, LockError> {
        // Two rounds. Every counter is raised first, freeing nothing, and
        // the highest is the floor; only then is the lock freed, every
        // counter raised to at least the floor. Freed in one round, a
        // waiter could take a majority from the instances broken first,
        // with tokens under the counter of one broken last.
        let floor = self
            .on_a_majority("breaking a lock", |mut conn, prefix| {
                let key = key.clone();
                async move { super::inspect::raise_fence(&mut conn, &prefix, &key).await }
            })
            .await?
            .into_iter()
            .max()
            .unwrap_or(0);
        let answered = self
            .on_a_majority("breaking a lock", |mut conn, prefix| {
                let key = key.clone();
                async move {
                    let (publish, queued) = ("PUBLISH", false);
                    super::inspect::break_on(&mut conn, &prefix, &key, "0", publish, queued, floor)
                        .await
                }
            })
            .await?;
        let holders = self.tally(answered.into_iter().map(|(h, _)| h).collect(), 1);
        Ok(Broken {
            key,
            holders,
            floor: FencingToken::new(floor),
        })
    }

    // Every instance's connection keeps its commands in order.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .exclusive_only()
            .max_tokens(MAX_TOKENS)
            .ordered_release(true)
    }
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
