//! MariaDB `GET_LOCK` locks (feature `mysql`).
//!
//! For teams whose replicas share a MariaDB database and nothing else.
//!
//! # How a lock is taken
//!
//! A key `K` is locked with `GET_LOCK(name, wait)`, where `name` is `K`
//! itself up to 64 characters (MySQL's limit on lock names) and beyond, `/`
//! and the first 63 hex digits of `SHA2(K, 256)`: no key holds a `/`, so a
//! long key's name is never a short key's, and SQL can take the same lock:
//!
//! ```sql
//! SELECT GET_LOCK(IF(CHAR_LENGTH('sku:A1') <= 64, 'sku:A1',
//!                    CONCAT('/', LEFT(SHA2('sku:A1', 256), 63))), 10);
//! ```
//!
//! Lock names are compared without regard to case, so `sku:a1` and `sku:A1`
//! share a lock (they wait for each other; a lock is never granted twice).
//!
//! - Each acquisition takes a connection from a small pool and waits in the
//!   server (no polling); the lock then lives on that connection, which
//!   goes back to the pool once `RELEASE_LOCK` is answered. A waiter that
//!   gives up is interrupted on the server (`KILL QUERY` from another
//!   connection) and its connection closed, so no waiter is left.
//! - Waiters in this process queue in front of the server ([`Cohort`](crate::backend::Cohort)): a
//!   held lock passes to the next local waiter without a round trip, within
//!   [`CohortOptions`]' bounds.
//! - MariaDB does not promise an order among waiters from several
//!   processes; the cohort lets a process's own waiters that queued behind
//!   a holder ask again only once its release is answered, so other
//!   processes' waiters get their turn. An acquisition that comes after
//!   the release was sent goes at once, on another connection: `GET_LOCK`
//!   waits in the server for the release if it overtakes it (one that does
//!   not wait, or not long enough, may then find the lock busy).
//!
//! # Fencing tokens
//!
//! Drawn from a sequence (`tower_lock_tokens` by default, created on first
//! use) in the same statement as the grant, after it: a lock's token is
//! `NEXTVAL × MysqlBackend::TOKEN_SPACING`, the tokens in between serving the local
//! holders a grant is passed to. Sequences need MariaDB 10.3 or later; a
//! MySQL server is refused with an error saying so.
//!
//! A sequence is not durable: one kept by InnoDB, its server killed, can
//! restart below values it had handed out (its last updates were never
//! written). So each new connection first lifts the sequence to the
//! server's clock in microseconds (`SETVAL`, which never lowers it) before
//! it draws a token; a server restarted, or a replica promoted, hands out
//! tokens above every token drawn before, provided its clock did not go
//! back by more than the restart took (grants never draw faster than one a
//! microsecond, so the sequence does not run ahead of the clock). Tokens
//! are therefore large numbers, about `microseconds since 1970 × 64`,
//! above 2^53: a store that keeps them as JSON numbers or doubles loses
//! their last digits, so keep them as 64-bit integers or text. A proxy that
//! keeps the client's connection open across a restart of the server
//! behind it (MaxScale, ProxySQL) would skip the lift: connect directly.
//!
//! # When a lock is lost
//!
//! A `GET_LOCK` lock lives as long as its connection. While it holds a
//! lock, the connection is pinged every quarter
//! [lease](MysqlOptions::session_lease), and known alive until the send time of the
//! last answered request plus the lease; no answer in time, or a broken
//! connection, and the lock is reported lost (the guard's lost signal)
//! before the server can free it:
//!
//! - Each connection sets `wait_timeout` to twice the lease: the server
//!   closes a silent holder's connection (and frees its lock) no sooner.
//! - A server restart frees every lock; the backend grants nothing until
//!   the server has been up a lease (plus drift), by when every holder of
//!   the old server has been told.
//! - A holder process that dies closes its connections; the server frees
//!   its locks at once.
//! - Not covered: a connection cut between holder and server (a reset, a
//!   proxy closing it) frees the lock as soon as the server sees the cut,
//!   and the holder hears of it at about that moment but not surely first;
//!   `KILL` of a holder's connection by an administrator frees its lock at
//!   once, and the holder hears of it at its next ping. Fencing tokens make
//!   such a holder's late writes refusable.
//! - Not covered: a replica promoted after a failover. `GET_LOCK` locks are
//!   not replicated, so the new primary knows none and grants every key at
//!   once; holders on the old primary hear of it when their connection
//!   fails or their next ping gets no answer (within a lease). Tokens stay
//!   above the old primary's while its sequence's replicated value plus the
//!   clock floor is above them.
//!
//! # Limits
//!
//! Exclusive locks only (`GET_LOCK` has no shared mode; read, write and
//! semaphore requests are refused with [`LockError::InvalidMode`]). One
//! connection per lock held or waited for, up to
//! [`MysqlOptions::max_connections`]; past that an acquisition waits for
//! one to be given back, up to the connect timeout, and then fails with an
//! error saying so. Connections given back stay open for the next
//! acquisitions and close after a minute unused.
//!
//! The driver moves a TCP connection to a server on the same host onto
//! that server's Unix socket once connected (`prefer_socket`, on by
//! default): locks behave the same, but a proxy on the TCP path (one that
//! injects faults, say) is then bypassed. Add `?prefer_socket=false` to
//! the URL to keep TCP.
//!
//! Each connection prepares the lock's two statements when it opens and
//! keeps them; a `?stmt_cache_size=` below 8 is raised to 8, since the
//! driver closes the statements it evicts (0, no cache, is kept).
//!
//! # Examples
//!
//! ```no_run
//! # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
//! use tower_lock::backend::mysql::MysqlBackend;
//! use tower_lock::Locker;
//!
//! let db = MysqlBackend::connect("mysql://app@127.0.0.1:3306/orders").await?;
//! let guard = Locker::new(db).lock("order:42").await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod inspect;
mod session;

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;
use mysql_async::Opts;

pub use self::session::MysqlStore;
use self::session::{my_error, Session};
use crate::backend::engine::lease::{check_lease, Lease, Protocol, Released};
use crate::backend::engine::{InFlight, Store};
use crate::backend::{
    Acquired, BreakScope, Broken, Capabilities, CohortOptions, Inspection, LockRequest,
    RemoteBackend,
};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::Wait;
use crate::token::FencingToken;

/// The lock name of `key`: the key itself up to 64 characters, else `/`
/// and the first 63 hex digits of its SHA-256, as the module
/// documentation's SQL makes it for other clients (the interop tests check
/// that both agree). Made here, not in each statement, so that the server
/// evaluates no expression per lock (a twentieth of its work per lock,
/// measured), and used by every statement that names a lock, so that
/// locking and inspection agree whatever the connection's character set.
pub(super) fn lock_name(key: &str) -> Cow<'_, str> {
    // `CHAR_LENGTH` counts characters: a key of 64 bytes or fewer has 64
    // characters or fewer.
    if key.len() <= 64 || key.chars().count() <= 64 {
        return Cow::Borrowed(key);
    }
    use sha2::Digest;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut name = String::with_capacity(64);
    name.push('/');
    for b in sha2::Sha256::digest(key.as_bytes()) {
        name.push(char::from(HEX[usize::from(b >> 4)]));
        name.push(char::from(HEX[usize::from(b & 15)]));
    }
    name.truncate(64);
    Cow::Owned(name)
}
/// The texts of the two statements a lock takes, made once per backend
/// and prepared once per connection ([`session::Prepared`]).
pub(super) struct Statements {
    /// `g<token>` granted, `b` busy, NULL an error: one column that cannot
    /// mistake a grant for busy, whatever the sequence holds.
    lock: String,
    release: String,
}

impl Statements {
    fn new(sequence: &str) -> Self {
        Statements {
            lock: format!(
                "SELECT CASE GET_LOCK(?, ?) WHEN 1 THEN CONCAT('g', NEXTVAL({sequence})) \
                 WHEN 0 THEN 'b' END"
            ),
            release: "SELECT RELEASE_LOCK(?)".to_owned(),
        }
    }
}

/// Sequence values from here on would not fit a token once multiplied by
/// [`MysqlBackend::TOKEN_SPACING`].
const MAX_SEQUENCE_VALUE: i64 = 1 << 58;

/// `GET_LOCK` takes seconds; "forever" is a year (MariaDB refuses -1).
const FOREVER_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// Settings of a [`MysqlBackend`].
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::mysql::{MysqlBackend, MysqlOptions};
///
/// let options = MysqlOptions::default()
///     .session_lease(Duration::from_secs(5))
///     .max_connections(8);
/// let db = MysqlBackend::connect_with("mysql://app@db:3306/orders", options).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct MysqlOptions {
    lease: Duration,
    connect_timeout: Duration,
    max_connections: usize,
    sequence: String,
    cohort: CohortOptions,
}

impl Default for MysqlOptions {
    fn default() -> Self {
        MysqlOptions {
            lease: MysqlOptions::DEFAULT_SESSION_LEASE,
            connect_timeout: MysqlOptions::DEFAULT_CONNECT_TIMEOUT,
            max_connections: MysqlOptions::DEFAULT_MAX_CONNECTIONS,
            sequence: MysqlOptions::DEFAULT_SEQUENCE.to_owned(),
            cohort: CohortOptions::default(),
        }
    }
}

impl MysqlOptions {
    /// How long a connection is known alive after a request it sent was
    /// answered.
    pub const DEFAULT_SESSION_LEASE: Duration = Duration::from_secs(10);
    /// How long connecting may take before the acquisition fails.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// The most connections one backend opens.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 32;
    /// The token sequence used when none is named.
    pub const DEFAULT_SEQUENCE: &str = "tower_lock_tokens";

    /// How long a connection is known alive after a request it sent was
    /// answered (see the [module docs](self)); a lock request's own lease
    /// does not apply. Default [`MysqlOptions::DEFAULT_SESSION_LEASE`].
    pub fn session_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long opening a connection may take. Default
    /// [`MysqlOptions::DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The most connections this backend opens. Default
    /// [`MysqlOptions::DEFAULT_MAX_CONNECTIONS`].
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }

    /// The sequence fencing tokens are drawn from (`name` or `db.name`, in
    /// lower-case letters, digits and `_`), created on first use if
    /// missing. One made by hand needs `INCREMENT 1`, `NOCYCLE` and a
    /// `MAXVALUE` of at least 2^52 (the defaults of `CREATE SEQUENCE`):
    /// each connection lifts it to the server's clock in microseconds (see
    /// [Fencing tokens](self#fencing-tokens)), and
    /// [`connect_with`](MysqlBackend::connect_with) refuses another with
    /// [`LockError::Config`]. Default [`MysqlOptions::DEFAULT_SEQUENCE`], or
    /// the URL's `?sequence=name` (which is how the `tower-lock` command,
    /// that takes only a URL, is told the application's).
    pub fn sequence(mut self, name: impl Into<String>) -> Self {
        self.sequence = name.into();
        self
    }

    /// How this process's waiters share a lock (see [`Cohort`](crate::backend::Cohort)).
    pub fn cohort(mut self, cohort: CohortOptions) -> Self {
        self.cohort = cohort;
        self
    }
}

/// Locks held with MariaDB's `GET_LOCK`.
///
/// See the [module documentation](self). Cloning is cheap and shares the
/// connections.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::mysql::MysqlBackend;
/// use tower_lock::{LockLayer, PathParam};
///
/// let db = MysqlBackend::connect("mysql://app@127.0.0.1:3306/orders").await?;
/// let layer = LockLayer::new(db, PathParam("sku")).namespace("sku");
/// # Ok(()) }
/// ```
pub type MysqlBackend = RemoteBackend<MysqlStore>;

impl MysqlBackend {
    /// How far apart two grants' fencing tokens are.
    pub const TOKEN_SPACING: u32 = 64;

    /// Connects to `mysql://user[:password]@host:port/database` (or
    /// `mariadb://`) with default [options](MysqlOptions).
    ///
    /// Opens one connection (and creates the token sequence if missing) at
    /// once, so a wrong address or user fails here.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_lock::backend::mysql::MysqlBackend;
    /// use tower_lock::LockError;
    ///
    /// let wrong = MysqlBackend::connect("postgres://app@db/orders").await;
    /// assert!(matches!(wrong, Err(LockError::Config(_))));
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::connect_with(url, MysqlOptions::default()).await
    }

    /// Connects with explicit [options](MysqlOptions).
    pub async fn connect_with(url: &str, mut options: MysqlOptions) -> Result<Self, LockError> {
        let (url, sequence) = super::sql::take_param(url, "sequence");
        match sequence {
            Some(name) if name.is_empty() => {
                return Err(LockError::Config(
                    "the URL's sequence parameter needs a name: ?sequence=db.name".into(),
                ))
            }
            Some(name) if options.sequence == MysqlOptions::DEFAULT_SEQUENCE => {
                options.sequence = name
            }
            _ => {}
        }
        let opts = parse_url(&url)?;
        check_lease(options.lease, "MariaDB")?;
        super::sql::check_name(&options.sequence, "MysqlOptions::sequence")?;
        if options.max_connections == 0 {
            return Err(LockError::Config(
                "MysqlOptions::max_connections must be at least 1".into(),
            ));
        }
        let target = format!(
            "{}:{}/{}",
            opts.ip_or_hostname(),
            opts.tcp_port(),
            opts.db_name().unwrap_or("(no database)")
        );
        let store = MysqlStore {
            opts,
            target,
            lease: options.lease,
            connect_timeout: options.connect_timeout,
            statements: Statements::new(&options.sequence),
            sequence: options.sequence,
            sequence_ready: AtomicBool::new(false),
            idle: Arc::default(),
            connections: super::sql::Connections::new(options.max_connections),
            releases: Arc::default(),
        };
        let first = store.session(true).await?;
        store.give_back(first);
        Ok(RemoteBackend::new(store, options.cohort))
    }

    /// The connections open now (for diagnostics and tests).
    pub fn connections(&self) -> usize {
        self.store().connections.open()
    }
}

impl fmt::Debug for MysqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlBackend")
            .field("target", &self.store().target)
            .field("cohort", &self.cohort_options())
            .finish_non_exhaustive()
    }
}

impl Store for MysqlStore {
    const NAME: &'static str = "mysql";

    async fn acquire(self: Arc<Self>, request: LockRequest) -> Result<Acquired, LockError> {
        let key = request.key.as_str().to_owned();
        let secs = match request.wait {
            Wait::FailFast => 0.0,
            Wait::Timeout(d) => d.as_secs_f64().min(FOREVER_SECS),
            Wait::Forever => FOREVER_SECS,
        };
        let session = self.session(request.wait != Wait::FailFast).await?;
        session.alive.quarantine().await;
        let sent = Instant::now();
        let n = {
            let mut undo = Undo {
                inner: &self,
                session: &session,
                armed: true,
            };
            let mut conn = session.conn.lock().await;
            let row: Result<Option<Option<String>>, _> = conn
                .exec_first(&session.prepared.lock, (&*lock_name(&key), secs))
                .await;
            undo.armed = false;
            let outcome = match &row {
                Ok(Some(Some(b))) if b == "b" => Some(0),
                Ok(Some(Some(g))) => g
                    .strip_prefix('g')
                    .and_then(|n| n.parse::<i64>().ok())
                    .filter(|n| (1..MAX_SEQUENCE_VALUE).contains(n)),
                _ => None,
            };
            match (outcome, row) {
                (Some(n), _) => n,
                (None, Ok(got)) => {
                    drop(conn);
                    session.end("GET_LOCK failed");
                    return Err(LockError::backend(
                        "mysql",
                        format!(
                            "GET_LOCK answered {got:?}: an error in the server, or a token \
                             sequence that gave a value outside 1..2^58 (times {} \
                             it would not fit a token)",
                            MysqlBackend::TOKEN_SPACING
                        ),
                        None,
                    ));
                }
                (None, Err(e)) => {
                    drop(conn);
                    // It may have been granted: closing the connection
                    // frees it.
                    session.end("GET_LOCK failed");
                    return Err(my_error("taking a lock", e));
                }
            }
        };
        if n == 0 {
            self.give_back(session);
            return Err(match request.wait {
                Wait::FailFast => LockError::Busy,
                _ => LockError::Timeout {
                    waited: sent.elapsed(),
                },
            });
        }
        session.alive.answered(sent);
        // A long wait: one more round trip makes the connection known
        // alive from now.
        if session.alive.stale_after(sent) {
            let sent = Instant::now();
            let ping = session.conn.lock().await.ping().await;
            if let Err(e) = ping {
                session.end("the connection failed as the lock was granted");
                return Err(my_error("checking the connection", e));
            }
            session.alive.answered(sent);
        }
        // In range (checked above): the product and the local holders'
        // tokens after it fit.
        let token = token_of(n);
        let held = MysqlLock {
            inner: self.clone(),
            session: session.clone(),
            key,
        };
        let lease = Lease::new(
            held,
            self.lease,
            session.alive.until.clone(),
            self.releases.clone(),
        );
        // Told at once if the connection ended meanwhile.
        session.hold.insert((), &lease, ());
        Ok(lease.acquired(token, request.tokens.clamp(1, MysqlBackend::TOKEN_SPACING)))
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
        scope: BreakScope,
    ) -> Result<Broken, LockError> {
        self.break_key(key, scope).await
    }

    // No promised order among waiters, and a release and the next acquisition
    // go out on different connections; but `GET_LOCK` waits in the server, so
    // this process's next acquisition need not wait for the release's answer.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .exclusive_only()
            .max_tokens(MysqlBackend::TOKEN_SPACING)
            .waits_in_server(true)
    }
}

impl MysqlStore {}

/// A `GET_LOCK` in flight; dropped (the caller gave up), it interrupts the
/// wait on the server and closes the connection, which frees whatever the
/// wait got.
struct Undo<'a> {
    inner: &'a Arc<MysqlStore>,
    session: &'a Arc<Session>,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.session.end("an abandoned wait");
        if let Some(rt) = self.inner.releases.runtime() {
            let kill = self.inner.clone().kill_query(self.session.id);
            self.inner.releases.spawn(&rt, kill);
        }
    }
}

/// A held `GET_LOCK` lock.
pub(super) struct MysqlLock {
    inner: Arc<MysqlStore>,
    session: Arc<Session>,
    key: String,
}

impl MysqlLock {
    /// One `RELEASE_LOCK`; a failure closes the connection, which frees
    /// the lock.
    async fn unlock(&self) -> Result<(), LockError> {
        self.session.hold.remove(&());
        let key = self.key.as_str();
        let released: Result<Option<Option<i64>>, _> = {
            let mut conn = self.session.conn.lock().await;
            conn.exec_first(&self.session.prepared.release, (&*lock_name(key),))
                .await
        };
        match released {
            Ok(Some(Some(1))) => {}
            Ok(_) => tracing::warn!(
                key,
                "mariadb had no such lock on this connection to release"
            ),
            Err(e) => {
                self.session.end("a release failed");
                return Err(my_error("releasing a lock", e));
            }
        }
        self.inner.give_back(self.session.clone());
        Ok(())
    }
}

impl Protocol for MysqlLock {
    const BACKEND: &'static str = "mysql";
    const EXPIRED: &'static str =
        "the MariaDB connection is no longer known alive (no answer within the lease)";

    fn describe(&self) -> &str {
        &self.key
    }

    /// Never called: the connection's keep-alive serves its lock.
    async fn renew(&self, _lease: Duration) -> Result<(), String> {
        Ok(())
    }

    async fn release(&self) -> Released {
        Released {
            result: self.unlock().await,
            // A failed release closed the connection: nothing to retry.
            again: false,
        }
    }

    async fn release_until(&self, _deadline: Instant) -> Result<(), LockError> {
        self.unlock().await
    }
}

/// The token of a grant (or floor) that drew `value` from the token
/// sequence ([`spaced_token`](super::sql::spaced_token)).
pub(super) fn token_of(value: i64) -> FencingToken {
    super::sql::spaced_token(value, MysqlBackend::TOKEN_SPACING)
}

fn parse_url(url: &str) -> Result<Opts, LockError> {
    let url = match url.split_once("://") {
        Some(("mysql", _)) => url.to_owned(),
        Some(("mariadb", rest)) => format!("mysql://{rest}"),
        _ => {
            return Err(LockError::Config(format!(
                "not a MariaDB URL: {:?} (expected mysql://user@host:port/database)",
                crate::redact::redact(url)
            )))
        }
    };
    // Each connection keeps its lock statements prepared, and a few more
    // run on it (inspection): a statement cache smaller than that would
    // evict them, and the driver closes what it evicts. Without a cache
    // (0) it closes nothing. Raised in the URL: rebuilt from parsed options,
    // an IPv6 host keeps its brackets and no longer resolves.
    let (rest, cache) = super::sql::take_param(&url, "stmt_cache_size");
    let url = match cache.as_deref().map(str::parse::<usize>) {
        Some(Ok(n)) if (1..MIN_STMT_CACHE).contains(&n) => {
            let joint = if rest.contains('?') { '&' } else { '?' };
            format!("{rest}{joint}stmt_cache_size={MIN_STMT_CACHE}")
        }
        _ => url,
    };
    Opts::from_url(&url).map_err(|e| LockError::Config(format!("invalid MariaDB URL: {e}")))
}

/// The smallest statement cache a connection is given (`stmt_cache_size`
/// in the URL; the driver's default is 32).
const MIN_STMT_CACHE: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_before_connecting() {
        assert!(parse_url("mysql://root@127.0.0.1:3306/test").is_ok());
        assert!(parse_url("mariadb://root@db/test").is_ok());
        assert!(parse_url("postgres://root@db/test").is_err());
        assert!(parse_url("mysql://root@db:port/test").is_err());
        let cache = |url| parse_url(url).unwrap().stmt_cache_size();
        assert_eq!(
            cache("mysql://root@db/test?stmt_cache_size=2"),
            MIN_STMT_CACHE
        );
        assert_eq!(cache("mysql://root@db/test?stmt_cache_size=0"), 0);
        assert_eq!(cache("mysql://root@db/test?stmt_cache_size=100"), 100);
        assert_eq!(
            cache("mysql://root@db/test?prefer_socket=false&stmt_cache_size=1"),
            8
        );
        // Raised in the URL itself: options rebuilt from parsed ones would
        // lose the IPv6 address's URL form.
        let v6 = "mysql://root@[::1]:3306/test?stmt_cache_size=";
        let raised = Opts::from_url(&format!("{v6}8")).unwrap();
        assert_eq!(parse_url(&format!("{v6}2")).unwrap(), raised);
    }
}
