//! Redis: one instance, a master followed through Sentinel, or a Redis
//! Cluster (feature `redis`).
//!
//! # Layout
//!
//! For a key `K` and the prefix `lock:` (the default), every Redis key shares
//! the hash tag `{K}`, so that each script touches one hash slot (on a
//! Redis Cluster, one master: see [Cluster](#cluster)):
//!
//! | mode | Redis keys |
//! |---|---|
//! | exclusive | `lock:{K}`, a string holding the owner's random token (or, for the 100 ms of a waiter's turn, `~` and its token: see [Waiting](#waiting)); waiters' places in `lock:{K}:queue`, `:places` and `:grants` |
//! | read/write | `lock:{K}:w`, the writer's token; `lock:{K}:r`, a sorted set of reader tokens scored by their expiry (ms) |
//! | semaphore | `lock:{K}:s`, a sorted set of holder tokens scored by their expiry (ms) |
//! | all, on a Cluster | `lock:{{~n}:epoch`, one per slot: the epoch its fencing floors come from (see [Fencing tokens](#fencing-tokens)) |
//! | all | `lock:{K}:fence`, the fencing counter; releases publish on the channel `lock:{K}:rel`, those of an exclusive lock only to the next waiter's process, on `lock:{K}:rel:` and its process's token prefix (see [Waiting](#waiting)) |
//!
//! The exclusive lock is redis-py's `Lock` on the same name: `SET name token
//! NX PX lease` to take it, compare-and-delete to release, compare-and-`PEXPIRE`
//! to extend. A Python service using `r.lock("lock:{K}")` and a Rust service
//! using this backend exclude each other.
//!
//! # Fencing tokens
//!
//! The acquire script increments `lock:{K}:fence`: for an exclusive or write
//! lock by the number of tokens the acquisition reserves for the holders it
//! may serve within this process (see [Passing a lock on](#passing-a-lock-on);
//! [`CohortOptions::DEFAULT_MAX_GRANTS`] by default), by 1 otherwise. A
//! counter never falls behind the server's clock in microseconds (a new
//! one starts there, not at 1; through Sentinel or on a Cluster, plus a
//! floor that rises with each failover: see [Sentinel](#sentinel)), and it
//! expires a day after the key was last
//! locked (the scripts read and raise it in one `SET … GET`: Redis 6.2 or
//! later). So counters do not pile up as keys come and go, and a token never
//! goes backwards when a counter is lost (expired, a restart without
//! persistence, a failover to a replica that lacked its last increments):
//! it starts again above any value the old counter reached, unless the
//! key's tokens were used up faster than one per microsecond on average, or
//! the new server's clock is behind the old one's by more than the time
//! between the two acquisitions.
//!
//! # Waiting
//!
//! Within a process, acquisitions of a key queue in arrival order and only the
//! head talks to Redis (see [Passing a lock on](#passing-a-lock-on)). The head
//! tries once; if the key is held it waits for a release message, or for the
//! holder's lease to run out (looking again at most a second later, for
//! holders such as redis-py that do not publish). Releases, subscriptions and
//! commands share one RESP3 connection per backend, managed by the `redis`
//! crate's `ConnectionManager`, which reconnects and resubscribes.
//!
//! An exclusive lock on one server (or the master Sentinel names) also has a
//! queue in Redis: a waiter that finds it held takes a place, in the order
//! waiters first found it held, and keeps it alive by looking at least every
//! second (a place lasts 3 s). A release gives the first waiter whose place
//! is alive its turn, so that no one overtakes the queue, the process that
//! released included, and only that waiter's process hears of it (on the
//! key's channel followed by the process's token prefix: one release wakes
//! one process, not every one with a waiter).
//!
//! On one server, the turn is the lock itself: the release script sets the
//! key to the waiter's token, draws its fencing tokens and sends them in the
//! message, and the waiter holds the lock as it hears it, with no acquire of
//! its own (one round trip less per hand-off between processes). Its lease
//! is known from the send time of its last attempt that found the key held
//! (the grant came after that answer), for its own lease up to its place's
//! 3 s, renewed to the whole lease if its section lasts past a third of
//! that; a grant it hears too late is taken by an attempt instead, which the
//! script answers as it answers a holder. A waiter that gave up (or died
//! with its place alive) holds the lock back that long at most: one that
//! gives up releases it at once, handing it on. Through Sentinel, with
//! [`RedisOptions::wait_for_replicas`] or with a restart quarantine, an
//! acquisition checks what a release cannot (the master's epoch, the
//! replicas, the server's restart), so there the release sets the key to
//! the waiter's turn (`~` and its token) for 100 ms, which only that waiter
//! takes (nor may a redis-py client take the key meanwhile), and the
//! process of the waiter behind hears too, and looks once those 100 ms are
//! over in case the named one did not come (a process gone, a message
//! missed).
//!
//! A waiter that gives up leaves its place, handing its turn on if it had
//! one. redis-py clients take no place and may still take a lock its lease
//! freed; a named waiter that comes after its turn (a process paused past
//! 100 ms), or finds a redis-py client overtook it so, goes to the back.
//! On one server, while waiters of
//! this crate queue, a release hands the key straight on and it is never
//! free: a redis-py client waits until they are served (excluded always,
//! it is not served in turn). A
//! lock freed by its lease running out (a holder gone) names nobody: its
//! waiters look when they expected it to run out, and the first to ask
//! wins. Processes with a waiter each are thus served in turn (measured:
//! eight processes of one worker each, equal shares within 0.1%). Read,
//! write and semaphore locks and Redis Cluster (a script's keys must all be
//! on the node while its slot migrates) have no such queue: there every
//! waiter tries again when it hears of a release. Redlock queues on every
//! instance ([its waiting](redlock#waiting)). Versions before the
//! queue listen on the key's channel only: mixed with them during an
//! upgrade, a waiter may not hear the other version's releases and looks
//! again within a second. Earlier versions kept a named waiter's turn in
//! `lock:{K}:next`, which this one does not read: mixed with them, a named
//! waiter may be overtaken, or wait out its 100 ms (exclusion holds).
//!
//! # Passing a lock on
//!
//! The backend is a [`Cohort`](crate::backend::Cohort) in front of the Redis protocol: when a holder
//! of an exclusive or write lock releases it while another acquisition of the
//! same key in the same mode waits in this process, the Redis lock is handed
//! to that waiter instead of being released and taken again. No round trip,
//! the key never free in Redis in between, the lease and its renewal carried
//! on; each holder still gets its own fencing token, the next of the block the
//! Redis acquisition reserved. The lock goes back to Redis when the block is
//! used up, when [`CohortOptions::DEFAULT_MAX_HOLD`] has passed since Redis
//! granted it, when the renewal is late (a key that may have expired in
//! Redis, say while the process was paused, is never handed on), or when no
//! local waiter wants it. [`RedisOptions::cohort`] changes the bound or turns
//! it off.
//!
//! Without the server's queue (write locks, Redis Cluster) the first to ask
//! after a release wins: a process that gives the lock back with waiters of
//! its own still queued would win nearly every time. So when the release
//! script says subscribers elsewhere heard the message, the next waiter here
//! waits until another process's release is heard (or 5 ms, after which
//! hand-offs on that key pause until one is): processes take turns
//! (measured: two processes of four workers each, equal shares within 2%
//! on a Redis Cluster).
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
//! A release is the compare-and-delete script, which also tells the next
//! waiter (see [Waiting](#waiting)); a lock [passed on](#passing-a-lock-on) runs no script
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
//! the error. [`Backend::flush`](crate::Backend::flush) waits until every release sent has been
//! answered: call it before the process exits, or a release still in flight
//! is lost and its key stays taken until its lease ends.
//!
//! # Sentinel
//!
//! `redis+sentinel://s1:p1,s2:p2,s3:p3/<master>` asks every Sentinel which
//! server is the master `<master>` and works on the one named under the
//! highest config epoch (a Sentinel that has not heard of the last failover
//! names the old master under an older one). A majority of the Sentinels
//! listed must answer (each within a second; a Sentinel leading a failover,
//! which names the old master until it switches, does not count): one
//! Sentinel alone may be the one cut off from a failover the others made.
//! List every Sentinel of the group: the majority is of those listed. The backend listens
//! for the Sentinels' `+switch-master` messages on one Sentinel, which it
//! pings every second and replaces when it stops answering, and asks again
//! when a command fails (asks for failing commands come at least 25 ms
//! apart, doubling up to 250 ms while they keep coming, so a master that
//! fails everything does not send every command to the Sentinels). On a
//! new master it moves its connection there, has every holder renew at
//! once, and, once the master is confirmed, subscribes there to the release
//! channels in use. Credentials and database in the URL are the Redis
//! servers' (the Sentinels are asked without).
//!
//! Replication is asynchronous: a lock (or renewal) the old master had not
//! yet passed on is lost in a failover, and the next client can be granted
//! the lock while its holder still counts on it. The holder learns at its
//! next renewal, and its fencing token is below the new holder's (the
//! counter follows the clock, above).
//!
//! For a while two servers can both grant: a master the Sentinels replaced
//! (paused, cut off, or failed over twice in a row) serves as master until
//! they convert it, to clients that have not yet heard of the switch. Both
//! counters follow the same clock, so their tokens could meet; through
//! Sentinel the counter therefore never falls behind the master's config
//! epoch times 2^36 µs (some 19 hours) plus the clock: a newer master's
//! tokens are above anything an older one hands out (unless the two
//! clocks are that far apart), and the fenced store refuses the older
//! master's holders. The floor is applied by the script, so every client
//! of a master shares one counter whatever epoch it knows; a client asks
//! again while the Sentinels disagree on the master of the newest epoch.
//! Tokens stay below 2^53 (exact as JSON numbers) up to epoch 65,536.
//!
//! [`RedisOptions::wait_for_replicas`]
//! (or `?wait_replicas=N&wait_timeout_ms=T` in the URL) closes that gap at
//! the cost of the replicas' acknowledgement on each acquire and renewal.
//!
//! # Cluster
//!
//! `redis+cluster://n1:p1,n2:p2,n3:p3` learns the cluster from the first
//! node that answers (any node will do; give several in case one is down)
//! and sends each script to the master of its key's slot: locks on
//! different keys spread over the masters, and [`lock_all`](crate::BackendExt::lock_all) takes keys in
//! different slots one by one, like any keys. The `redis` crate's cluster
//! connection follows `MOVED` and `ASK` (a slot resharded while locks in
//! it are held: their keys move with the slot, and renewals and releases
//! follow them) and retries within the response timeout; a script that
//! meets a slot half-migrated (`TRYAGAIN`) is retried the same way, 10 to
//! 100 ms apart. Release messages are sharded (`SPUBLISH`, `SSUBSCRIBE`:
//! Redis 7.0+; with an older server none are sent and waiters look again
//! each second): the channel `lock:{K}:rel` shares the lock's hash tag, so
//! a release is heard by the nodes of its slot only, not broadcast to the
//! whole cluster, and a subscription follows the slot when it moves.
//!
//! A master failover is Sentinel's case again: replication is
//! asynchronous, a lock the old master had not passed on is lost, and a
//! master cut off from the majority serves its clients for up to the
//! cluster's `cluster-node-timeout` before it stops taking writes. The
//! fencing floor comes from the node that runs the script (its config
//! epoch, which a failover raises above every other node's), so a
//! promoted replica's tokens are above the old master's.
//! [`RedisOptions::wait_for_replicas`] (or `?wait_replicas=N` in the URL)
//! sends `WAIT` to the same master behind each acquire and renewal.
//! [`RedisOptions::restart_quarantine`] is refused: its marker lives on
//! one master and cannot tell that another came back empty. Database 0
//! only, no TLS.
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
//!
//! A lock key removed behind the backend's back frees the key for anyone at
//! once: evicted by Redis under memory pressure (lock keys carry a TTL, so
//! a `volatile-*` `maxmemory-policy` may pick them, as may `allkeys-*`) or
//! deleted by hand. The holder is told the lock is lost at its next renewal,
//! within a third of the lease; until then this process may hand the lock
//! on to its next local waiter. Run the Redis that holds locks with
//! `maxmemory-policy noeviction` (writes then fail, and acquisitions with
//! them, rather than locks vanish).

mod call;
mod cluster;
mod connection;
mod inspect;
mod layout;
mod master;
mod options;
mod pubsub;
pub mod redlock;
mod replicas;
mod scripts;
mod server;
mod urls;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;
use redis::{PushInfo, PushKind};

use self::connection::{Connection, Doubt, Link};
use self::layout::{redis_error, Tokens};
use self::options::tls_mismatch_hint;
pub use self::options::RedisOptions;
use self::pubsub::{sweep_subscriptions, Watches};
pub use self::server::RedisStore;
#[cfg(doc)]
use super::CohortOptions;
use super::RemoteBackend;
use crate::backend::engine::renewal::Renewals;
use crate::error::LockError;
use crate::key::LockKey;

/// Locks in one Redis server, in the master that Redis Sentinel names, or
/// in a Redis Cluster.
///
/// See the [module documentation](self) for the layout, the fencing tokens,
/// and what it guarantees.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::redis::RedisBackend;
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
pub type RedisBackend = RemoteBackend<RedisStore>;

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
    /// | `redis+sentinel://[user[:password]@]s1:p1[,s2:p2...]/master[/db][?wait_replicas=N&wait_timeout_ms=T]` | the master the Sentinels `s1`, `s2`... name `master`, followed through failovers (see [Sentinel](self#sentinel)); user, password and database are the Redis servers', `wait_replicas` is [`RedisOptions::wait_for_replicas`] |
    /// | `redis+cluster://[user[:password]@]n1:p1[,n2:p2...][?wait_replicas=N&wait_timeout_ms=T]` | a Redis Cluster, learnt from the nodes given, each key on its slot's master (see [Cluster](self#cluster)) |
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
        let tokens = Tokens::new();
        let watches = Arc::new(Watches::new(tokens.prefix()));
        let doubt = Arc::new(Doubt::default());
        let push = {
            let (watches, doubt) = (Arc::downgrade(&watches), Arc::downgrade(&doubt));
            move |info: PushInfo| {
                if info.kind == PushKind::Disconnection {
                    if let Some(d) = doubt.upgrade() {
                        d.broke();
                    }
                }
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
            .set_push_sender(push.clone())
            .set_automatic_resubscription();
        let sentinel = match url.starts_with(urls::SENTINEL) {
            true => Some(urls::parse_sentinel(url)?),
            false => None,
        };
        let cluster = match url.starts_with(urls::CLUSTER) {
            true => Some(urls::parse_cluster(url)?),
            false => None,
        };
        let wait = sentinel
            .as_ref()
            .and_then(|s| s.wait)
            .or(cluster.as_ref().and_then(|c| c.wait));
        let replicas = options.replicas.or(wait);
        if let Some(r) = replicas {
            // `WAIT n 0` waits forever, and holds up the connection it shares.
            if r.timeout < Duration::from_millis(1) || r.timeout >= options.response_timeout {
                return Err(LockError::Config(format!(
                    "the time to wait for replicas ({} ms) must be at least 1 ms and below the \
                     response timeout ({} ms)",
                    r.timeout.as_millis(),
                    options.response_timeout.as_millis()
                )));
            }
        }
        // A release may grant a waiter the lock directly only where the
        // waiter itself would check nothing more (see `Layout::direct_grants`).
        let direct_grants = sentinel.is_none()
            && cluster.is_none()
            && replicas.is_none()
            && options.restart_quarantine.is_none();
        let conn = if let Some(sentinel) = sentinel {
            options.check_sentinel()?;
            let (master, conn) = master::Master::connect(&sentinel, config).await?;
            let conn = Link::Server(conn);
            let conn = Arc::new(Connection::new(conn, master.epoch(), doubt, true));
            tokio::spawn(master::follow(
                master,
                Arc::downgrade(&conn),
                Arc::downgrade(&watches),
            ));
            conn
        } else if let Some(cluster) = cluster {
            options.check_cluster()?;
            let conn = cluster::connect(&cluster, &options, push).await?;
            Arc::new(Connection::new(Link::Cluster(conn), 0, doubt, false))
        } else {
            let client = options.client(url)?;
            let conn = client
                .get_connection_manager_with_config(config)
                .await
                .map_err(|e| {
                    let hint = tls_mismatch_hint(url, &e);
                    redis_error(&format!("connecting to {url}{hint}"), e)
                })?;
            Arc::new(Connection::new(Link::Server(conn), 0, doubt, false))
        };
        tokio::spawn(sweep_subscriptions(
            Arc::downgrade(&watches),
            Arc::downgrade(&conn),
        ));
        let store = RedisStore {
            conn,
            replicas,
            response_timeout: options.response_timeout,
            prefix: options.prefix,
            quarantine: options.restart_quarantine,
            direct_grants,
            renewals: Renewals::new(Some(watches.reconnected.clone())),
            watches,
            tokens,
            releases: Arc::default(),
        };
        Ok(RemoteBackend::new(store, options.cohort))
    }

    /// The Redis key of an exclusive lock on `key`, for peers in other
    /// languages: redis-py's `r.lock(name)` with this name excludes us.
    ///
    /// It is the prefix and `{key}`, the key as the Cluster hash tag. In a
    /// key with a brace, `{` is written `{(` and `}` is written `{)`, so
    /// that the tag can neither end early nor be empty.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::backend::redis::RedisBackend;
    /// use tower_lock::LockKey;
    ///
    /// let redis = RedisBackend::connect("redis://127.0.0.1:6379/").await?;
    /// let name = redis.redis_key(&LockKey::new("order:42")?);
    /// assert_eq!(name, "lock:{order:42}");
    /// // In Python: redis.Redis().lock("lock:{order:42}") excludes this backend's holders.
    /// # Ok(()) }
    /// ```
    pub fn redis_key(&self, key: &LockKey) -> String {
        layout::redis_name(&self.store().prefix, key.as_str())
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.store().prefix)
            .field("cohort", &self.cohort_options())
            .finish_non_exhaustive()
    }
}
