//! Redis, one instance (feature `redis`).
//!
//! # Layout
//!
//! For a key `K` and the prefix `lock:` (the default), every Redis key shares
//! the hash tag `{K}`, so that each script touches one Cluster slot:
//!
//! | mode | Redis keys |
//! |---|---|
//! | exclusive | `lock:{K}`, a string holding the owner's random token |
//! | read/write | `lock:{K}:w`, the writer's token; `lock:{K}:r`, a sorted set of reader tokens scored by their expiry (ms) |
//! | semaphore | `lock:{K}:s`, a sorted set of holder tokens scored by their expiry (ms) |
//! | all | `lock:{K}:fence`, the fencing counter; releases publish on the channel `lock:{K}:rel` |
//!
//! The exclusive lock is redis-py's `Lock` on the same name: `SET name token
//! NX PX lease` to take it, compare-and-delete to release, compare-and-`PEXPIRE`
//! to extend. A Python service using `r.lock("lock:{K}")` and a Rust service
//! using this backend exclude each other.
//!
//! # Fencing tokens
//!
//! The acquire script increments `lock:{K}:fence`: by 8 for an exclusive lock,
//! reserving a block of tokens for the grants it may serve within this process
//! (see [Passing a lock on](#passing-a-lock-on)), by 1 otherwise. A counter
//! that does not exist yet starts at the server's clock in microseconds, not at
//! 1, and the counter expires a day after the key was last locked. So counters
//! do not pile up as keys come and go, and a token never goes backwards when a
//! counter is lost (expired, or a restart without persistence): the new start
//! is above any value the old counter reached, unless a key was taken from
//! Redis more than once per eight microseconds on average, or the server clock
//! stepped back.
//!
//! # Waiting
//!
//! Within a process, acquisitions of a key queue in arrival order and only the
//! head talks to Redis. The head tries once; if the key is held it subscribes to
//! the key's release channel and tries again when a release is published, or
//! when the holder's lease would have run out (at most a second later, for
//! holders such as redis-py that do not publish). Releases, subscriptions and
//! commands share one RESP3 connection per backend, managed by the `redis`
//! crate's `ConnectionManager`, which reconnects and resubscribes.
//!
//! # Passing a lock on
//!
//! When a holder of an exclusive lock releases it while another acquisition
//! of the same key waits in this process, the Redis lock is handed to that
//! waiter instead of being released and taken again: no round trip, the key
//! never free in Redis in between, the lease and its renewal carried on. Each
//! grant still gets its own fencing token, the next of the block the Redis
//! acquisition reserved; when the block of 8 is used up the lock is released
//! in Redis, so a process passes a lock on at most 7 times before it is
//! released (and publishes its release) for everyone. Under contention this
//! makes a process's waiters far faster (one Redis acquisition per 8 grants),
//! at the price of fairness between processes, which Redis does not give
//! anyway (there is no queue in Redis, only the release message): this
//! process's next waiter sends its acquire right after the release, on the
//! same connection, and usually gets the key again before a waiter woken by
//! the release message elsewhere. So within a process waiters are served in
//! order, but a process whose queue for a key never runs dry can keep another
//! process waiting until it does; use ZooKeeper where waiters in different
//! processes must be served in order. A lock is passed on only while its
//! renewal is on time (more than two thirds of the lease surely left), so a
//! key that may have expired in Redis, say while the process was paused, is
//! taken from Redis again instead. Should the waiter the lock was handed to go
//! away before it takes the lock, the lock is released at once (and a renewal
//! that finds it waiting releases it too).
//!
//! # Leases and loss
//!
//! A held lock's lease is renewed every third of the lease. A renewal that
//! fails, times out (after a third of the lease), or finds the key gone or owned
//! by another token fires the lock's lost signal: within one renewal period,
//! and before the lease ends. A lost connection triggers a renewal at once.
//!
//! # Release
//!
//! A release is the compare-and-delete script, which also publishes on the
//! release channel; a lock [passed on](#passing-a-lock-on) runs no script
//! and stays taken in Redis for its next holder. [`LockGuard::release`](crate::LockGuard::release) waits
//! for its answer; dropping the guard (as the layer does) sends it and goes
//! on, the answer awaited in the background. Either way this process's next
//! waiter for the key may send its acquire at once: Redis runs a
//! connection's commands in order, so the acquire lands after the release and
//! finds the lock free, and the two round trips overlap. Other clients see
//! the key released once the script has run. When the connection breaks
//! before the answer, the script is sent again in the background on the new
//! connection until it is answered or the lease would have ended anyway (it
//! is safe to repeat: the token is unique); an awaited release then reports
//! the error. [`Backend::flush`] waits until every release sent has been
//! answered: call it before the process exits, or a release still in flight
//! is lost and its key stays taken until its lease ends.
//!
//! # What it does not guarantee
//!
//! A single Redis is a single point of failure. Without persistence, a
//! restarted Redis has forgotten every lock: a holder learns at once (its
//! connection dropped, its renewal finds the key gone) and is told the lock is
//! lost, but another process may take the key in the moments before. Fencing
//! tokens make that overlap harmless for storage that checks them; and
//! [`RedisOptions::restart_quarantine`] closes it, by granting nothing for the
//! longest lease after the server comes back empty (the Redlock paper's
//! delayed restart, done by the clients). A holder
//! paused longer than its lease (a stopped process, a long GC) loses the lock
//! without knowing until it runs again; again, fencing tokens catch its writes.
//! Waiters in every mode are served first come first served within a process,
//! but not across processes (see [Passing a lock on](#passing-a-lock-on)).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind, Script, Value};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::{Acquired, Backend, BackendFuture, InFlight, LeaseHandle, LockRequest, MemoryBackend};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::{HasLostState, LostSignal, LostState};
use crate::mode::{LockMode, Wait};
use crate::token::FencingToken;

/// Fencing tokens an exclusive acquisition reserves: one per grant while
/// this process passes the lock between its own waiters (see
/// [Passing a lock on](self#passing-a-lock-on)).
const FENCE_BLOCK: u64 = 8;
/// Pause between tries of a release that got no answer.
const RELEASE_RETRY: Duration = Duration::from_millis(100);
/// How long a fencing counter outlives the last acquisition of its key.
const FENCE_TTL: Duration = Duration::from_secs(24 * 3600);
/// The longest a waiter sleeps without a release message before it looks
/// again: covers holders that never publish (redis-py) and lost messages.
const MAX_RECHECK: Duration = Duration::from_secs(1);
/// Idle subscriptions are dropped after this long.
const SUBSCRIPTION_LINGER: Duration = Duration::from_secs(10);
/// The shortest lease accepted: renewal runs every third of it.
const MIN_LEASE: Duration = Duration::from_millis(30);

/// Refuses a lease too short to renew in time.
pub(super) fn check_lease(lease: Duration, backend: &str) -> Result<(), LockError> {
    if lease < MIN_LEASE {
        return Err(LockError::Config(format!(
            "a {backend} lease must be at least {} ms",
            MIN_LEASE.as_millis()
        )));
    }
    Ok(())
}

/// Queues `request` in this process first: only the head of a key's local
/// queue talks to the servers. The core enforces the deadline by dropping
/// the caller's future, so a timed wait waits here without one of its own.
pub(super) fn queue_locally(
    local: &MemoryBackend,
    request: &LockRequest,
) -> BackendFuture<Result<Acquired, LockError>> {
    let wait = match request.wait {
        Wait::FailFast => Wait::FailFast,
        _ => Wait::Forever,
    };
    local.acquire(LockRequest::new(request.key.clone(), request.mode).with_wait(wait))
}

/// Runs `release` (the remote release) and gives up this process's queue
/// position as soon as the release's commands are on the connection(s).
///
/// Redis runs a connection's commands in order, so the next local waiter may
/// send its acquire at once: it lands after the release, and the two round
/// trips overlap. (Should the release fail, that acquire finds the key held
/// and waits, as any other would.)
pub(super) async fn release_then_open<T>(
    release: impl Future<Output = T>,
    local: &Mutex<Option<Acquired>>,
) -> T {
    let mut release = std::pin::pin!(release);
    let first = poll_once(release.as_mut());
    lock(local).take();
    match first {
        std::task::Poll::Ready(result) => result,
        std::task::Poll::Pending => release.await,
    }
}

/// Releases from a destructor: puts `release` (which retries on its own) on
/// the connection(s), gives up this process's queue position as above, and
/// leaves the answer to a task that [`Backend::flush`] waits for. A failure
/// is logged.
pub(super) fn release_in_background(
    release: impl Future<Output = Result<(), LockError>> + Send + 'static,
    local: Option<&Mutex<Option<Acquired>>>,
    in_flight: &Arc<InFlight>,
) {
    let mut release = Box::pin(release);
    let first = poll_once(release.as_mut());
    if let Some(local) = local {
        lock(local).take();
    }
    let failed = |e: LockError| {
        tracing::warn!(error = %e, "releasing a redis lock failed; it ends with its lease");
    };
    match (first, tokio::runtime::Handle::try_current()) {
        (std::task::Poll::Ready(result), _) => result.unwrap_or_else(failed),
        (std::task::Poll::Pending, Ok(rt)) => {
            in_flight.spawn(&rt, async move { release.await.unwrap_or_else(failed) })
        }
        (std::task::Poll::Pending, Err(_)) => tracing::warn!(
            "lock dropped outside a Tokio runtime; it is not released and will expire with its lease"
        ),
    }
}

/// One poll, which puts a release's commands on the connection(s).
fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
    fut.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
}

/// Whether a failed release may not have run (the connection dropped, the
/// answer timed out): then it is worth sending again.
pub(super) fn uncertain(e: &redis::RedisError) -> bool {
    !matches!(e.retry_method(), redis::RetryMethod::NoRetry)
}

/// Locks in one Redis server (or one Cluster, through hash tags).
///
/// See the [module documentation](self) for the layout, the fencing tokens,
/// and what it guarantees.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::RedisBackend;
/// use tower_lock::{BackendExt, LockLayer, PathParam};
///
/// let redis = RedisBackend::connect("redis://127.0.0.1:6379/").await?;
/// let guard = redis.lock("report:daily").await?;
/// guard.release().await?;
///
/// // Or per request, shared by every replica that uses the same Redis:
/// let layer = LockLayer::new(redis, PathParam("sku"));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<RedisInner>,
}

/// Connection settings of a [`RedisBackend`].
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::{RedisBackend, RedisOptions};
///
/// let options = RedisOptions::default()
///     .prefix("orders:lock:")
///     .connect_timeout(Duration::from_secs(2))
///     .response_timeout(Duration::from_millis(500))
///     // Every client of this server uses leases of at most 30 s.
///     .restart_quarantine(Duration::from_secs(30));
/// let redis = RedisBackend::connect_with("redis://127.0.0.1:6379/", options).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisOptions {
    prefix: String,
    connect_timeout: Duration,
    response_timeout: Duration,
    restart_quarantine: Option<Duration>,
    #[cfg(feature = "redis-tls")]
    tls_root_certificate: Option<Vec<u8>>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            prefix: "lock:".into(),
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            restart_quarantine: None,
            #[cfg(feature = "redis-tls")]
            tls_root_certificate: None,
        }
    }
}

impl RedisOptions {
    /// The prefix of every Redis key (default `lock:`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long to wait for a connection (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long to wait for a reply (default 1 s). A backend that does not
    /// answer in time makes the acquisition fail (503 through the layer).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// After the server comes back empty (restarted without persistence, or
    /// flushed), grant no lock for `longest_lease`: a holder from before
    /// cannot still be inside its lease when the next one starts. Set it to
    /// the longest lease any client of this server uses. Off by default.
    ///
    /// The server is recognised as empty by a marker key under the prefix
    /// (`<prefix>~alive`), which the first acquisition writes; so a new
    /// server also waits once. Not for Redis Cluster (the marker lives in
    /// one slot).
    pub fn restart_quarantine(mut self, longest_lease: Duration) -> Self {
        self.restart_quarantine = Some(longest_lease);
        self
    }

    /// For a `rediss://` URL: trust the CA certificate(s) in `pem` (PEM
    /// text, one or more certificates), and only them, instead of the
    /// system's trust store. For a server whose certificate a private CA
    /// signed. The host name in the URL must still match the certificate.
    /// [`connect_with`](RedisBackend::connect_with) refuses it with a URL
    /// that does not use TLS, and a `pem` that does not parse, as
    /// [`LockError::Config`]. Needs the `redis-tls` feature.
    #[cfg(feature = "redis-tls")]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_certificate = Some(pem.into());
        self
    }
}

/// Whether `url` asks for TLS: `rediss://`, or the redis crate's
/// `valkeys://`.
fn wants_tls(url: &str) -> bool {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}

/// Refuses a URL whose `scheme` asks for TLS when this build has none,
/// naming the feature that adds it (the redis crate's own error names its
/// features, not ours).
pub(super) fn check_tls_support(scheme: &str) -> Result<(), LockError> {
    tls_support(scheme, cfg!(feature = "redis-tls"))
}

/// The likely cause of a failed connection that failed the way one to a
/// server expecting TLS fails without it (the server drops it), or the other
/// way round (no answer to the TLS handshake).
fn tls_mismatch_hint(url: &str, e: &redis::RedisError) -> &'static str {
    let dropped = e.is_connection_dropped() && !e.is_connection_refusal();
    match wants_tls(url) {
        false if dropped => {
            " (the server dropped the connection: if it expects TLS, use rediss://)"
        }
        true if dropped || e.is_timeout() => {
            " (no TLS handshake: if the server does not speak TLS, use redis://)"
        }
        _ => "",
    }
}

fn tls_support(scheme: &str, built_in: bool) -> Result<(), LockError> {
    if built_in {
        return Ok(());
    }
    Err(LockError::Config(format!(
        "`{scheme}://` URLs connect over TLS, which this build of tower-lock leaves out: \
         enable its `redis-tls` feature (features = [\"redis-tls\"] in Cargo.toml)"
    )))
}

struct RedisInner {
    conn: ConnectionManager,
    prefix: String,
    quarantine: Option<Duration>,
    /// The in-process queue: only its head talks to Redis.
    local: MemoryBackend,
    watches: Arc<Watches>,
    tokens: Tokens,
    releases: Arc<InFlight>,
    /// Redis locks a local holder left for the next local holder, by key.
    batons: Mutex<HashMap<String, Arc<Remote>>>,
}

/// Waiters' interest in release channels, shared with the push handler.
#[derive(Default)]
struct Watches {
    channels: Mutex<HashMap<String, Channel>>,
    /// Woken on a lost connection: renewals check their lease at once.
    reconnected: Notify,
}

struct Channel {
    notify: Arc<Notify>,
    users: usize,
    subscribed: bool,
    idle_since: Option<tokio::time::Instant>,
}

impl Watches {
    fn on_push(&self, info: PushInfo) {
        match info.kind {
            PushKind::Message => {
                if let Some(Value::BulkString(channel)) = info.data.first() {
                    let channels = lock(&self.channels);
                    if let Some(c) = std::str::from_utf8(channel)
                        .ok()
                        .and_then(|c| channels.get(c))
                    {
                        c.notify.notify_waiters();
                    }
                }
            }
            PushKind::Disconnection => {
                // Messages may have been missed: every waiter looks again,
                // and every holder checks its lease.
                for c in lock(&self.channels).values() {
                    c.notify.notify_waiters();
                }
                self.reconnected.notify_waiters();
            }
            _ => {}
        }
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Random owner tokens: a per-backend random prefix and a counter.
pub(super) struct Tokens {
    seed: u64,
    next: AtomicU64,
}

impl Tokens {
    pub(super) fn new() -> Self {
        // `RandomState` is seeded from the OS's randomness.
        let seed = std::collections::hash_map::RandomState::new()
            .hash_one((std::process::id(), std::time::SystemTime::now()));
        Tokens {
            seed,
            next: AtomicU64::new(0),
        }
    }

    pub(super) fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{n:016x}", self.seed)
    }
}

/// The Redis keys of one lock.
#[derive(Clone)]
pub(super) struct Layout {
    kind: Kind,
    /// The string (exclusive, writer) or sorted set (reader, semaphore).
    main: String,
    /// The readers' set of a writer, the writer of a reader.
    other: Option<String>,
    fence: String,
    channel: String,
    /// Restart quarantine: the marker key, the quarantine key, its length.
    quarantine: Option<(String, String, u64)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Exclusive,
    Read,
    Write,
    Semaphore(u32),
}

impl Layout {
    pub(super) fn new(prefix: &str, key: &LockKey, mode: LockMode) -> Self {
        let base = format!("{prefix}{{{key}}}");
        let (kind, main, other) = match mode {
            LockMode::Exclusive => (Kind::Exclusive, base.clone(), None),
            LockMode::Read => (Kind::Read, format!("{base}:r"), Some(format!("{base}:w"))),
            LockMode::Write => (Kind::Write, format!("{base}:w"), Some(format!("{base}:r"))),
            LockMode::Semaphore { permits } => {
                (Kind::Semaphore(permits), format!("{base}:s"), None)
            }
        };
        Layout {
            kind,
            main,
            other,
            fence: format!("{base}:fence"),
            channel: format!("{base}:rel"),
            quarantine: None,
        }
    }

    /// Checks for a restarted server before granting: see
    /// [`RedisOptions::restart_quarantine`].
    pub(super) fn with_quarantine(mut self, prefix: &str, longest: Option<Duration>) -> Self {
        self.quarantine = longest.map(|d| {
            (
                format!("{prefix}~alive"),
                format!("{prefix}~quarantine"),
                d.as_millis().max(1) as u64,
            )
        });
        self
    }

    /// The Redis key holding the lock (for logs).
    pub(super) fn main_key(&self) -> &str {
        &self.main
    }

    /// Whether the lock is a string (else a member of a sorted set).
    fn is_string(&self) -> bool {
        matches!(self.kind, Kind::Exclusive | Kind::Write)
    }

    /// One attempt to take the lock for `token` on `conn`.
    pub(super) async fn try_acquire<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
        lease: Duration,
    ) -> Result<Attempt, LockError> {
        let s = scripts();
        let mut call = match self.kind {
            Kind::Exclusive => s.acquire_exclusive.key(&self.main),
            Kind::Read => s.acquire_read.key(&self.main),
            Kind::Write => s.acquire_write.key(&self.main),
            Kind::Semaphore(_) => s.acquire_semaphore.key(&self.main),
        };
        if let Some(other) = &self.other {
            call.key(other);
        }
        call.key(&self.fence)
            .arg(token)
            .arg(lease.as_millis() as u64)
            .arg(FENCE_TTL.as_millis() as u64);
        if let Kind::Semaphore(permits) = self.kind {
            call.arg(permits);
        }
        // Last, so that every script finds them past its own.
        if let Some((alive, quarantine, ms)) = &self.quarantine {
            call.key(alive).key(quarantine).arg(*ms);
        }
        let (granted, value): (i64, i64) = call
            .invoke_async(conn)
            .await
            .map_err(|e| redis_error("acquiring a lock", e))?;
        Ok(if granted == 1 {
            Attempt::Granted(value as u64)
        } else {
            Attempt::Busy(value)
        })
    }

    /// Extends `token`'s lease; false if the lock is no longer its.
    pub(super) async fn extend<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
        lease: Duration,
    ) -> Result<bool, LockError> {
        let s = scripts();
        let script = if self.is_string() {
            &s.extend_string
        } else {
            &s.extend_member
        };
        let extended: i64 = script
            .key(&self.main)
            .key(&self.fence)
            .arg(token)
            .arg(lease.as_millis() as u64)
            .arg(FENCE_TTL.as_millis() as u64)
            .invoke_async(conn)
            .await
            .map_err(|e| redis_error("renewing a lease", e))?;
        Ok(extended == 1)
    }

    /// Releases `token`'s hold (if it still has one) and publishes it.
    pub(super) async fn release<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
    ) -> redis::RedisResult<()> {
        let s = scripts();
        let script = if self.is_string() {
            &s.release_string
        } else {
            &s.release_member
        };
        let _released: i64 = script
            .key(&self.main)
            .arg(token)
            .arg(&self.channel)
            .invoke_async(conn)
            .await?;
        Ok(())
    }

    /// [Releases](Self::release) through `conn`. With a `deadline` (when the
    /// lease would have ended anyway), again on a reconnected connection
    /// while the release fails without an answer from the server (a dropped
    /// connection, a timeout): compare-and-delete by a unique token is safe
    /// to repeat.
    pub(super) async fn release_until(
        &self,
        conn: &ConnectionManager,
        token: &str,
        deadline: Option<tokio::time::Instant>,
    ) -> redis::RedisResult<()> {
        loop {
            match self.release(&mut conn.clone(), token).await {
                Err(e)
                    if uncertain(&e)
                        && deadline
                            .is_some_and(|d| tokio::time::Instant::now() + RELEASE_RETRY < d) =>
                {
                    tracing::debug!(error = %e, "retrying a redis release");
                    tokio::time::sleep(RELEASE_RETRY).await;
                }
                result => return result,
            }
        }
    }

    /// Fencing tokens an acquisition reserves: one per grant it may serve.
    fn fence_block(&self) -> u64 {
        if self.kind == Kind::Exclusive {
            FENCE_BLOCK
        } else {
            1
        }
    }
}

/// Lua helpers, each prepended only to the scripts that use it: Redis
/// creates a script's functions on every call.
const NOW_MS: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(x) return string.format('%.0f', x) end
"#;

/// Reserves `n` fencing tokens, returns the last.
const FENCE: &str = r#"
local function fence(key, ttl, n)
  local f = redis.call('INCRBY', key, n)
  if f == n then
    -- A new counter starts at the clock, above anything a lost one reached.
    local t = redis.call('TIME')
    f = tonumber(t[1]) * 1000000 + tonumber(t[2])
    redis.call('SET', key, string.format('%.0f', f))
  end
  redis.call('PEXPIRE', key, ttl)
  return f
end
"#;

/// Adds a member to a sorted set of holders scored by expiry, and keeps the
/// set alive as long as its longest holder. Needs `NOW_MS`.
const HOLD_IN_SET: &str = r#"
local function hold_in_set(key, token, lease, now)
  redis.call('ZADD', key, int(now + tonumber(lease)), token)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, last[2])
end
"#;

/// The restart quarantine, when the caller passes its keys after the
/// script's own `n` keys (marker, quarantine) and its length as the last
/// argument: the remaining quarantine in ms, or nil to go on.
const QUARANTINE: &str = r#"
local function quarantined(n)
  if #KEYS <= n then return nil end
  local left = redis.call('PTTL', KEYS[n + 2])
  if left > 0 then return left end
  if redis.call('EXISTS', KEYS[n + 1]) == 0 then
    -- An empty server: whoever held a lock here may still think so.
    redis.call('SET', KEYS[n + 1], '1')
    redis.call('SET', KEYS[n + 2], '1', 'PX', ARGV[#ARGV])
    return tonumber(ARGV[#ARGV])
  end
  return nil
end
"#;

/// KEYS: lock, fence. ARGV: token, lease ms, fence ttl ms.
const ACQUIRE_EXCLUSIVE: &str = r#"
local q = quarantined(2)
if q then return {0, q} end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, fence(KEYS[2], ARGV[3], FENCE_BLOCK)}
end
return {0, redis.call('PTTL', KEYS[1])}
"#;

/// KEYS: readers, writer, fence. ARGV: token, lease ms, fence ttl ms.
const ACQUIRE_READ: &str = r#"
local q = quarantined(3)
if q then return {0, q} end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, redis.call('PTTL', KEYS[2])}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return {1, fence(KEYS[3], ARGV[3], 1)}
"#;

/// KEYS: writer, readers, fence. ARGV: token, lease ms, fence ttl ms.
const ACQUIRE_WRITE: &str = r#"
local q = quarantined(3)
if q then return {0, q} end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('PTTL', KEYS[1])}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if first[1] then
  return {0, tonumber(first[2]) - now}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, fence(KEYS[3], ARGV[3], 1)}
"#;

/// KEYS: holders, fence. ARGV: token, lease ms, fence ttl ms, permits.
const ACQUIRE_SEMAPHORE: &str = r#"
local q = quarantined(2)
if q then return {0, q} end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, tonumber(first[2]) - now}
end
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return {1, fence(KEYS[2], ARGV[3], 1)}
"#;

/// KEYS: lock. ARGV: token, channel. redis-py's release, plus the PUBLISH.
const RELEASE_STRING: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0
"#;

/// KEYS: holders. ARGV: token, channel.
const RELEASE_MEMBER: &str = r#"
local n = redis.call('ZREM', KEYS[1], ARGV[1])
if n == 1 then
  redis.call('PUBLISH', ARGV[2], 'released')
end
return n
"#;

/// KEYS: lock, fence. ARGV: token, lease ms, fence ttl ms.
const EXTEND_STRING: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
"#;

/// KEYS: holders, fence. ARGV: token, lease ms, fence ttl ms.
const EXTEND_MEMBER: &str = r#"
local now = now_ms()
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now then
  hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
"#;

struct Scripts {
    acquire_exclusive: Script,
    acquire_read: Script,
    acquire_write: Script,
    acquire_semaphore: Script,
    release_string: Script,
    release_member: Script,
    extend_string: Script,
    extend_member: Script,
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| {
        let script = |parts: &[&str]| Script::new(&parts.concat());
        let in_set = [NOW_MS, HOLD_IN_SET].concat();
        Scripts {
            acquire_exclusive: script(&[
                &format!("local FENCE_BLOCK = {FENCE_BLOCK}\n"),
                QUARANTINE,
                FENCE,
                ACQUIRE_EXCLUSIVE,
            ]),
            acquire_read: script(&[QUARANTINE, &in_set, FENCE, ACQUIRE_READ]),
            acquire_write: script(&[QUARANTINE, NOW_MS, FENCE, ACQUIRE_WRITE]),
            acquire_semaphore: script(&[QUARANTINE, &in_set, FENCE, ACQUIRE_SEMAPHORE]),
            release_string: script(&[RELEASE_STRING]),
            release_member: script(&[RELEASE_MEMBER]),
            extend_string: script(&[EXTEND_STRING]),
            extend_member: script(&[&in_set, EXTEND_MEMBER]),
        }
    })
}

pub(super) fn redis_error(doing: &str, e: redis::RedisError) -> LockError {
    LockError::backend("redis", doing.to_owned(), Some(Box::new(e) as _))
}

/// The answer of an acquire script.
pub(super) enum Attempt {
    Granted(u64),
    /// Held; the holder's remaining lease in ms (negative: none known).
    Busy(i64),
}

impl RedisBackend {
    /// Connects with the default [`RedisOptions`].
    ///
    /// # URLs
    ///
    /// The `redis` crate's forms (`valkey://` and `valkeys://` too):
    ///
    /// | URL | connection |
    /// |---|---|
    /// | `redis://[user][:password@]host[:port][/db]` | plain TCP, port 6379 unless given |
    /// | `rediss://[user][:password@]host[:port][/db]` | TLS (feature `redis-tls`): the server's certificate must be valid for `host` and chain to a CA of the system's trust store (OpenSSL's: `/etc/ssl/certs`, or what `SSL_CERT_FILE` / `SSL_CERT_DIR` name), or to the one given by `RedisOptions::tls_root_certificate` |
    /// | `rediss://host:port/#insecure` | TLS that checks neither the certificate nor the host name: encrypted, but an impostor is not detected. For tests |
    ///
    /// Without the `redis-tls` feature a `rediss://` URL is a
    /// [`LockError::Config`] that says so. Client certificates (mutual TLS)
    /// are not supported. The backend always speaks RESP3, whatever
    /// `?protocol=` says. A `redis://` URL to a port that expects TLS fails
    /// like an unreachable server (the server drops the connection), within
    /// the connect timeout.
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] if the server cannot be reached or the TLS
    /// handshake fails (an untrusted certificate, say), or
    /// [`LockError::Config`] for a malformed URL.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Connects with `options`.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self, LockError> {
        if wants_tls(url) {
            check_tls_support("rediss")?;
        }
        let info = url
            .into_connection_info()
            .map_err(|e| LockError::Config(format!("invalid Redis URL {url:?}: {e}")))?;
        // Releases arrive as RESP3 pushes on the same connection.
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let info = info.set_redis_settings(settings);
        #[cfg(feature = "redis-tls")]
        let client = match options.tls_root_certificate {
            Some(_) if !wants_tls(url) => {
                return Err(LockError::Config(format!(
                    "a TLS root certificate was given, but {url:?} does not use TLS: use rediss://"
                )));
            }
            Some(pem) => redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            )
            .map_err(|e| LockError::Config(format!("invalid TLS root certificate: {e}")))?,
            None => redis::Client::open(info)
                .map_err(|e| LockError::Config(format!("invalid Redis URL {url:?}: {e}")))?,
        };
        #[cfg(not(feature = "redis-tls"))]
        let client = redis::Client::open(info)
            .map_err(|e| LockError::Config(format!("invalid Redis URL {url:?}: {e}")))?;
        let watches = Arc::new(Watches::default());
        let push = {
            let watches = Arc::downgrade(&watches);
            move |info: PushInfo| {
                if let Some(w) = watches.upgrade() {
                    w.on_push(info);
                }
                Ok::<(), ()>(())
            }
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.response_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500))
            .set_push_sender(push)
            .set_automatic_resubscription();
        let conn = client
            .get_connection_manager_with_config(config)
            .await
            .map_err(|e| {
                let hint = tls_mismatch_hint(url, &e);
                redis_error(&format!("connecting to {url}{hint}"), e)
            })?;
        let inner = Arc::new(RedisInner {
            conn,
            prefix: options.prefix,
            quarantine: options.restart_quarantine,
            local: MemoryBackend::new(),
            watches,
            tokens: Tokens::new(),
            releases: Arc::default(),
            batons: Mutex::default(),
        });
        tokio::spawn(sweep_subscriptions(Arc::downgrade(&inner)));
        Ok(RedisBackend { inner })
    }

    /// The Redis key of an exclusive lock on `key`, for peers in other
    /// languages: redis-py's `r.lock(name)` with this name excludes us.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::backend::RedisBackend;
    /// use tower_lock::LockKey;
    ///
    /// let redis = RedisBackend::connect("redis://127.0.0.1:6379/").await?;
    /// let name = redis.redis_key(&LockKey::new("order:42")?);
    /// assert_eq!(name, "lock:{order:42}");
    /// // In Python: redis.Redis().lock("lock:{order:42}") excludes this backend's holders.
    /// # Ok(()) }
    /// ```
    pub fn redis_key(&self, key: &LockKey) -> String {
        format!("{}{{{key}}}", self.inner.prefix)
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

/// Unsubscribes from channels nobody has waited on for a while. Stops when
/// the backend is dropped.
async fn sweep_subscriptions(inner: Weak<RedisInner>) {
    loop {
        tokio::time::sleep(SUBSCRIPTION_LINGER).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now = tokio::time::Instant::now();
        let idle: Vec<String> = {
            let mut channels = lock(&inner.watches.channels);
            let idle: Vec<String> = channels
                .iter()
                .filter(|(_, c)| {
                    c.users == 0 && c.idle_since.is_some_and(|t| now - t >= SUBSCRIPTION_LINGER)
                })
                .map(|(name, _)| name.clone())
                .collect();
            for name in &idle {
                channels.remove(name);
            }
            idle
        };
        let mut conn = inner.conn.clone();
        for name in idle {
            let _ = conn.unsubscribe(&name).await;
        }
    }
}

/// A waiter's interest in a release channel.
struct Watch {
    inner: Arc<RedisInner>,
    channel: String,
    notify: Arc<Notify>,
}

impl RedisInner {
    async fn watch(self: &Arc<Self>, channel: &str) -> Watch {
        let (notify, subscribe) = {
            let mut channels = lock(&self.watches.channels);
            let c = channels
                .entry(channel.to_owned())
                .or_insert_with(|| Channel {
                    notify: Arc::new(Notify::new()),
                    users: 0,
                    subscribed: false,
                    idle_since: None,
                });
            c.users += 1;
            c.idle_since = None;
            (c.notify.clone(), !c.subscribed)
        };
        if subscribe {
            match self.conn.clone().subscribe(channel).await {
                Ok(()) => {
                    if let Some(c) = lock(&self.watches.channels).get_mut(channel) {
                        c.subscribed = true;
                    }
                }
                // Without the subscription the waiter still re-checks at the
                // holder's remaining lease.
                Err(e) => {
                    tracing::warn!(channel, error = %e, "could not subscribe to lock releases")
                }
            }
        }
        Watch {
            inner: self.clone(),
            channel: channel.to_owned(),
            notify,
        }
    }

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
            .with_quarantine(&self.prefix, self.quarantine);
        let local = LocalWait {
            wait: queue_locally(&self.local, &request),
            unclaimed: Some(Unclaimed {
                inner: &self,
                key: &request.key,
                main: &layout.main,
            }),
        }
        .await?;
        // No await from the local grant to here: a baton left for this
        // key's next local holder is ours to take.
        if let Some(remote) = self.take_baton(&layout.main) {
            if remote.lease == request.lease && remote.may_pass_on() {
                return Ok(Remote::grant(remote, local));
            }
            // Another lease, or lost meanwhile: release it, then acquire anew
            // (after it, on the same connection).
            remote.release_later(None);
        }

        let token = self.tokens.next();
        let mut sent = tokio::time::Instant::now();
        let mut attempt = self.attempt(&layout, &token, request.lease).await?;
        if let (Attempt::Busy(_), Wait::FailFast) = (&attempt, request.wait) {
            return Err(LockError::Busy);
        }
        if let Attempt::Busy(_) = attempt {
            let watch = self.watch(&layout.channel).await;
            loop {
                // Armed before the attempt, so a release published between
                // the attempt and the wait is not missed.
                let released = watch.notify.notified();
                tokio::pin!(released);
                released.as_mut().enable();
                sent = tokio::time::Instant::now();
                attempt = self.attempt(&layout, &token, request.lease).await?;
                let Attempt::Busy(ttl) = attempt else {
                    break;
                };
                let recheck = u64::try_from(ttl)
                    .map(|ms| Duration::from_millis(ms + 1))
                    .unwrap_or(MAX_RECHECK)
                    .min(MAX_RECHECK);
                tokio::select! {
                    _ = released => {}
                    _ = tokio::time::sleep(recheck) => {}
                }
            }
        }
        let Attempt::Granted(fence) = attempt else {
            unreachable!("the loop ends on a grant");
        };
        let grants = layout.fence_block();
        let remote = Arc::new(Remote {
            inner: self.clone(),
            key: request.key,
            layout,
            token,
            lease: request.lease,
            lost: LostState::new(),
            renewal: Mutex::new(None),
            // The script reserved the block of tokens up to `fence`.
            first_fence: fence + 1 - grants,
            grants_left: AtomicU64::new(grants),
            valid_until: Mutex::new(sent + request.lease - drift(request.lease)),
        });
        let renewal = tokio::spawn(renew(Arc::downgrade(&remote)));
        *lock(&remote.renewal) = Some(renewal);
        Ok(Remote::grant(remote, local))
    }

    /// One acquire script. Dropped while it is in flight (the caller gave
    /// up), or failed without an answer, it may still have granted the lock:
    /// then the lock is released in the background.
    async fn attempt(
        self: &Arc<Self>,
        layout: &Layout,
        token: &str,
        lease: Duration,
    ) -> Result<Attempt, LockError> {
        let mut in_flight = Attempting {
            inner: self,
            layout,
            token,
            lease,
            armed: true,
        };
        let result = layout
            .try_acquire(&mut self.conn.clone(), token, lease)
            .await;
        in_flight.armed = result.is_err();
        result
    }

    /// Takes the Redis lock a local holder of `main` left for the next one.
    fn take_baton(&self, main: &str) -> Option<Arc<Remote>> {
        let mut batons = lock(&self.batons);
        if batons.is_empty() {
            return None;
        }
        batons.remove(main)
    }
}

/// The wait for this process's queue of a key. Its fields drop in order: a
/// waiter that goes away after it was granted gives the grant back first,
/// and then a Redis lock passed on to it, with nobody left to take it, is
/// released.
struct LocalWait<'a> {
    wait: BackendFuture<Result<Acquired, LockError>>,
    unclaimed: Option<Unclaimed<'a>>,
}

struct Unclaimed<'a> {
    inner: &'a RedisInner,
    key: &'a LockKey,
    main: &'a str,
}

impl Future for LocalWait<'_> {
    type Output = Result<Acquired, LockError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let result = std::task::ready!(std::pin::Pin::new(&mut self.wait).poll(cx));
        self.unclaimed = None;
        std::task::Poll::Ready(result)
    }
}

impl Drop for Unclaimed<'_> {
    fn drop(&mut self) {
        if self.inner.local.is_idle(self.key) {
            if let Some(remote) = self.inner.take_baton(self.main) {
                remote.release_later(None);
            }
        }
    }
}

/// An acquire script in flight; dropped, it releases what the script may
/// have granted (compare-and-delete by the attempt's token: harmless if it
/// granted nothing).
struct Attempting<'a> {
    inner: &'a Arc<RedisInner>,
    layout: &'a Layout,
    token: &'a str,
    lease: Duration,
    armed: bool,
}

impl Drop for Attempting<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (inner, layout, token) = (
            self.inner.clone(),
            self.layout.clone(),
            self.token.to_owned(),
        );
        let deadline = tokio::time::Instant::now() + self.lease;
        let releases = inner.releases.clone();
        release_in_background(
            async move {
                layout
                    .release_until(&inner.conn, &token, Some(deadline))
                    .await
                    .map_err(|e| redis_error("releasing an abandoned attempt", e))
            },
            None,
            &releases,
        );
    }
}

/// What is taken off a lease for clock drift before counting on it.
pub(super) fn drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(c) = lock(&self.inner.watches.channels).get_mut(&self.channel) {
            c.users -= 1;
            if c.users == 0 {
                c.idle_since = Some(tokio::time::Instant::now());
            }
        }
    }
}

impl Backend for RedisBackend {
    fn instance_id(&self) -> usize {
        // Clones share `inner`, and so their locks.
        Arc::as_ptr(&self.inner).cast::<()>() as usize
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        BackendFuture::new(self.inner.clone().acquire(request))
    }

    /// Also releases a lock passed on to a local waiter that has not taken
    /// it yet (it acquires anew).
    fn flush(&self) -> BackendFuture<()> {
        let parked: Vec<_> = lock(&self.inner.batons).drain().collect();
        for (_, remote) in parked {
            remote.release_later(None);
        }
        let inner = self.inner.clone();
        BackendFuture::new(async move { inner.releases.idle().await })
    }
}

/// A lock this process holds in Redis. Its local holders pass it on: see the
/// module documentation's [Passing a lock on](self#passing-a-lock-on).
struct Remote {
    inner: Arc<RedisInner>,
    key: LockKey,
    layout: Layout,
    token: String,
    lease: Duration,
    lost: LostState,
    renewal: Mutex<Option<JoinHandle<()>>>,
    /// The fencing token of the first grant; each later one adds one.
    first_fence: u64,
    /// How many more grants this hold may serve: the tokens left in the
    /// block the acquire script reserved.
    grants_left: AtomicU64,
    /// Until when Redis surely keeps the key for us: the last acquire or
    /// extend that succeeded, counted from when it was sent, less drift.
    valid_until: Mutex<tokio::time::Instant>,
}

impl Remote {
    /// The next local grant under this hold.
    fn grant(remote: Arc<Remote>, local: Acquired) -> Acquired {
        let left = remote.grants_left.fetch_sub(1, Ordering::Relaxed) - 1;
        let fence = remote.first_fence + (remote.layout.fence_block() - 1 - left);
        let hold = Arc::new(RedisHold {
            remote,
            local: Mutex::new(Some(local)),
        });
        let lost = LostSignal::new(hold.clone());
        Acquired::new(FencingToken::new(fence), hold).with_lost(lost)
    }

    /// Whether a new local holder may be given this hold without asking
    /// Redis: not lost, and its renewal not late (more than two thirds of
    /// the lease surely left), so that a key that expired in Redis while
    /// this process was not running is never handed on.
    fn may_pass_on(&self) -> bool {
        !self.lost.is_fired()
            && tokio::time::Instant::now() + self.lease / 3 < *lock(&self.valid_until)
    }

    async fn extend(&self) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        self.layout.extend(&mut conn, &self.token, self.lease).await
    }

    /// One release on the backend's connection.
    async fn release_once(&self) -> redis::RedisResult<()> {
        let conn = &self.inner.conn;
        self.layout.release_until(conn, &self.token, None).await
    }

    /// Releases, again on a reconnected connection while the answer is lost.
    async fn release_retrying(&self) -> Result<(), LockError> {
        let deadline = tokio::time::Instant::now() + self.lease;
        let conn = &self.inner.conn;
        self.layout
            .release_until(conn, &self.token, Some(deadline))
            .await
            .map_err(|e| redis_error("releasing a lock", e))
    }

    fn stop_renewal(&self) {
        if let Some(renewal) = lock(&self.renewal).take() {
            renewal.abort();
        }
    }

    /// Takes this hold back from the baton slot, if it is still there.
    fn take_back(self: &Arc<Self>) -> bool {
        let mut batons = lock(&self.inner.batons);
        match batons.get(&self.layout.main) {
            Some(parked) if Arc::ptr_eq(parked, self) => {
                batons.remove(&self.layout.main);
                true
            }
            _ => false,
        }
    }

    /// Stops the renewal and releases in the background, giving up `local`
    /// (a queue position) once the release is sent.
    fn release_later(self: Arc<Self>, local: Option<&Mutex<Option<Acquired>>>) {
        self.stop_renewal();
        let releases = self.inner.releases.clone();
        release_in_background(
            async move { self.release_retrying().await },
            local,
            &releases,
        );
    }
}

/// An awaited release whose answer has not come yet.
struct Unanswered(Option<Arc<Remote>>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(remote) = self.0.take() {
            remote.release_later(None);
        }
    }
}

/// One local grant of a [`Remote`] lock.
struct RedisHold {
    remote: Arc<Remote>,
    /// This process's queue position, given up after the Redis release.
    local: Mutex<Option<Acquired>>,
}

impl HasLostState for RedisHold {
    fn lost_state(&self) -> &LostState {
        &self.remote.lost
    }

    /// A holder that runs again after a pause past its lease is told at
    /// once, before the renewal task gets to run.
    fn expired(&self) -> Option<String> {
        (tokio::time::Instant::now() >= *lock(&self.remote.valid_until))
            .then(|| "the lease ran out before it was renewed".to_owned())
    }
}

impl RedisHold {
    /// Passes the Redis lock to this process's next waiter for the key, when
    /// there is one and the hold has tokens left; true if it did.
    fn pass_on(&self) -> bool {
        let r = &self.remote;
        if r.grants_left.load(Ordering::Relaxed) == 0
            || !r.may_pass_on()
            || r.inner.local.next_in_line(&r.key) != Some(LockMode::Exclusive)
        {
            return false;
        }
        lock(&r.inner.batons).insert(r.layout.main.clone(), r.clone());
        // Grants the next waiter, which takes the baton.
        lock(&self.local).take();
        // The waiter left in the meantime, or the renewal ended: nobody will
        // take it back otherwise.
        if (r.inner.local.is_idle(&r.key) || r.lost.is_fired()) && r.take_back() {
            r.clone().release_later(None);
        }
        true
    }
}

/// Renews a hold's lease every third of it until released or lost. A hold
/// found waiting in the baton slot (its next local holder was cancelled
/// before taking it) is released.
async fn renew(hold: Weak<Remote>) {
    let Some(period) = hold.upgrade().map(|h| h.lease / 3) else {
        return;
    };
    loop {
        let Some(reconnected) = hold.upgrade().map(|h| h.inner.clone()) else {
            return;
        };
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = reconnected.watches.reconnected.notified() => {}
        }
        drop(reconnected);
        let Some(h) = hold.upgrade() else {
            return;
        };
        if h.take_back() {
            drop(hold);
            return h.release_later(None);
        }
        let sent = tokio::time::Instant::now();
        let reason = match tokio::time::timeout(period, h.extend()).await {
            Ok(Ok(true)) => {
                *lock(&h.valid_until) = sent + h.lease - drift(h.lease);
                continue;
            }
            Ok(Ok(false)) => "the lock expired or another owner took it".to_owned(),
            Ok(Err(e)) => format!("renewing the lease failed: {e}"),
            Err(_) => "renewing the lease timed out".to_owned(),
        };
        tracing::warn!(key = %h.layout.main, reason, "redis lock lost");
        h.lost.fire(reason);
        // A hold waiting in the baton slot would have nobody to release it.
        if h.take_back() {
            h.release_later(None);
        }
        return;
    }
}

impl LeaseHandle for RedisHold {
    /// Waits for the answer: see the module documentation's
    /// [Release](self#release) section.
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        if self.pass_on() {
            return BackendFuture::ready(Ok(()));
        }
        self.remote.stop_renewal();
        BackendFuture::new(async move {
            let r = &self.remote;
            // Dropped before the answer (the caller gave up waiting): the
            // release is finished in the background.
            let mut unanswered = Unanswered(Some(r.clone()));
            let result = release_then_open(r.release_once(), &self.local).await;
            unanswered.0 = None;
            match result {
                Ok(()) => Ok(()),
                Err(e) => {
                    if uncertain(&e) {
                        // It may not have run: go on trying in the background.
                        r.clone().release_later(None);
                    }
                    Err(redis_error("releasing a lock", e))
                }
            }
        })
    }

    fn release_on_drop(self: Arc<Self>) {
        if self.pass_on() {
            return;
        }
        self.remote.clone().release_later(Some(&self.local));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_url_without_the_feature_is_a_config_error_naming_the_feature() {
        assert!(wants_tls("rediss://127.0.0.1:6379/"));
        assert!(wants_tls("REDISS://127.0.0.1/#insecure"));
        assert!(wants_tls("valkeys://127.0.0.1/"));
        assert!(!wants_tls("redis://127.0.0.1:6379/"));
        assert!(!wants_tls("redis://rediss:6379/"));
        assert!(tls_support("rediss", true).is_ok());
        match tls_support("rediss", false) {
            Err(LockError::Config(m)) => {
                assert!(m.contains("`rediss://`"), "{m}");
                assert!(m.contains("`redis-tls` feature"), "{m}");
            }
            other => panic!("expected a Config error, got {other:?}"),
        }
        assert_eq!(
            check_tls_support("rediss").is_ok(),
            cfg!(feature = "redis-tls")
        );
    }
}
