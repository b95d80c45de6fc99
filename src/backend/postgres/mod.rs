//! PostgreSQL session-level advisory locks (feature `postgres`).
//!
//! For teams whose replicas share nothing but their database: the lock
//! needs no other server.
//!
//! # How a lock is taken
//!
//! A key `K` is locked with `pg_advisory_lock(hashtextextended(K, 0))`
//! (`pg_advisory_lock_shared` for a read lock): the server hashes the key
//! text to the 64-bit advisory key, so SQL can take the same lock:
//!
//! ```sql
//! SELECT pg_advisory_lock(hashtextextended('sku:A1', 0));
//! ```
//!
//! Two keys whose hashes collide (about one pair in 2³² among 2³² keys in
//! use at once) share a lock: they wait for each other, but a lock is never
//! granted twice. A [namespace](crate::LockLayer::namespace) keeps a
//! service's keys apart from other users of advisory locks in the same
//! database, whose integer keys could be anything.
//!
//! - A key that is free is tried (`pg_try_advisory_lock`) on one shared
//!   connection, which holds any number of such locks: one round trip, and
//!   no connection per holder.
//! - A key that is held is waited for in the server, on a connection of its
//!   own (no polling): PostgreSQL queues waiters from every process in
//!   arrival order, and a waiter that gives up (timeout, cancellation) is
//!   cancelled on the server and its connection closed, so no waiter is
//!   left in `pg_locks`. That connection then holds the lock it waited for
//!   and goes back to a small pool after the release.
//! - Waiters in this process queue in front of the server ([`Cohort`](crate::backend::Cohort)): a
//!   held lock passes to the next local waiter without a round trip, within
//!   [`CohortOptions`](crate::backend::CohortOptions)' bounds.
//! - Releasing is `pg_advisory_unlock`, one round trip.
//!
//! # Fencing tokens
//!
//! Drawn from a sequence (`tower_lock_tokens` by default, created on first
//! use; see [`PostgresOptions::sequence`]) in the same statement as the
//! grant, after it: a lock's token is `nextval × PostgresBackend::TOKEN_SPACING`, and the
//! tokens in between serve the local holders a grant is passed to. Each
//! grant draws after the previous holder's grant, so tokens rise in grant
//! order across every process.
//!
//! No clock floor, unlike MariaDB's: a PostgreSQL sequence is WAL-logged
//! ahead of the values it hands out (32 at a time), so a crash or restart
//! makes it skip forward, never back; the torture runs kill and restart
//! the server with `tokens_backwards=0`. A floor would only serve a replica
//! promoted without the last values (asynchronous replication), where the
//! advisory locks themselves are gone too (they are not replicated), so
//! tokens are not the first thing to break there.
//!
//! # When a lock is lost
//!
//! An advisory lock lives as long as the server session that took it. The
//! connection is known alive until the send time of the last request the
//! server answered plus the [lease](PostgresOptions::session_lease); while it holds
//! locks it is asked every quarter lease. No answer in time, or a broken
//! connection, and every lock on it is reported lost (the lost signal of
//! each guard), before the server can free them:
//!
//! - Each session tells the server to give up a silent client no sooner
//!   than a lease after it last heard from it (`tcp_keepalives_*`,
//!   `tcp_user_timeout`), and turns off `statement_timeout`,
//!   `idle_session_timeout` and `idle_in_transaction_session_timeout`.
//! - A server restart frees every lock at once. The backend learns the
//!   server's start time with each connection and grants nothing until the
//!   server has been up for a lease (plus drift): by then every holder of
//!   the old server has been told.
//! - A holder process that dies closes its connections; the server frees
//!   its locks as soon as it sees that, and the next waiter gets the lock.
//! - Not covered: a connection cut between holder and server (a reset, a
//!   proxy or pooler closing it) frees the lock as soon as the server sees
//!   the cut; the holder hears of the same cut at about that moment and is
//!   told, but not surely before another process is granted the lock (the
//!   torture harness measured a few milliseconds). Nor an administrator
//!   terminating the session
//!   (`pg_terminate_backend`) frees its locks at once, and its holder hears
//!   of it at its next keep-alive, within a quarter lease. Nor a server
//!   that reinitialises after a crashed backend without restarting the
//!   postmaster, or a failover to a standby (or to another host of a
//!   multi-host URL): their start time is older than a lease, so the
//!   quarantine does not hold grants back, and a holder cut off from the
//!   server at that moment learns of it only when its lease runs out.
//!   Fencing tokens make such a holder's late writes refusable.
//!
//! # Connection poolers
//!
//! Session-level locks need the session: connect straight to PostgreSQL or
//! through PgBouncer in **session** pooling. In transaction pooling every
//! statement may run on another server connection, where the lock would
//! be stranded: the advisory mode refuses to run there (see below); use the
//! lease-table mode.
//!
//! # The lease-table mode
//!
//! With [`PostgresOptions::lease_table`] (or `?lease_table` in the URL) a
//! lock is a row of a table, created on first use:
//!
//! ```sql
//! CREATE TABLE tower_lock_leases (
//!     key text PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL,
//!     wanted boolean NOT NULL DEFAULT false);
//! ```
//!
//! - Acquiring is one statement: insert the row, or take over a row whose
//!   `expires_at` has passed, by the server's clock, or else mark it
//!   `wanted`. It returns the fencing token, drawn from the sequence once
//!   the row is written (so tokens rise in grant order), or the holder's
//!   time left. A waiter's later tries are two: insert the row, marked
//!   `wanted`, or nothing (`ON CONFLICT DO NOTHING`); then, if the row was
//!   there, the acquire statement, unless the row is held, unexpired and
//!   already marked. So the waiters a release wakes write nothing but the
//!   winner's row, and none queues on it, with its commit, ahead of the
//!   winner's release. A row a waiter won is marked from the start: its
//!   release notifies even when no one waits any more.
//! - The holder renews the row every third of the lock's lease (the
//!   request's lease, [`LockLayer::lease`](crate::LockLayer::lease)), and is
//!   told lost when a renewal finds the row gone, expired or taken, or gets
//!   no answer in time: before the lease, counted from the send time of the
//!   last renewal answered, ends. A holder that dies leaves a row that
//!   others take over once it expires; expired rows are deleted each
//!   second by every backend in this mode.
//! - Releasing deletes the row by owner and, if a waiter marked it wanted,
//!   notifies the table's channel (`NOTIFY tower_lock_leases, key`).
//!   Waiters `LISTEN` on a connection of their own and look again when
//!   notified, or when the holder's time is up (at most a second). Where
//!   notifications do not arrive (the listener behind a pooler in
//!   transaction mode: give it a direct address with
//!   [`PostgresOptions::listen_url`], or in the URL as
//!   `?lease_table&listen=db:5432`), waiters look every 50 ms instead, with
//!   a warning in the log.
//! - Every statement is a single statement in its own transaction, so any
//!   server session may run it: PgBouncer in transaction mode works.
//!   Statements are unnamed (parsed each time) until the listener, on the
//!   same URL, hears a notification another connection sent, which proves
//!   sessions last; then they are prepared once per connection. Unnamed,
//!   each is sent as the call of a PL/pgSQL function made in the table's
//!   schema (`tower_lock_` and a hash of its text), so that the server
//!   plans a one-line call and the function keeps the statement's plan. A
//!   function is called only if its body is the one this version makes
//!   and it is owned by the connecting role or the table's owner; where
//!   one cannot be made, is not trusted, or is dropped or its use revoked
//!   later, the statements are sent themselves (logged at INFO). Functions
//!   an older version made stay: drop the `tower_lock_…` functions no
//!   running version calls.
//!   Statements go over four connections, a key always on the same one.
//!   Locks survive a server restart (the table is durable).
//! - Each acquire and release is a committed write, which waits for the
//!   server's WAL flush: this mode costs about two such commits per lock,
//!   where an advisory lock costs less than two `SELECT`s.
//! - Exclusive locks only. Expiry is counted on the server's wall clock:
//!   a clock stepped forward expires leases early.
//!
//! The advisory mode does not share a lock through a pooler in transaction
//! mode: each of its connections marks the server session it sets up (a
//! custom setting, `tower_lock.session`, set only on a session that has no
//! mark and holds no advisory lock), and every lock statement and
//! keep-alive checks the mark, so a statement handed to another session
//! takes nothing and fails with an error that says why, and a holder whose
//! keep-alive lands elsewhere is told lost. The pooler is found out at the
//! first statement that lands on a session not its own, which may be after
//! a grant: that lock then stays with its pooled session (no other client
//! of this crate can take it there) until the pooler closes the session.

//! # Limits
//!
//! Of the advisory locks (the default mode):
//!
//! - Modes: exclusive, read and write (a write lock is the exclusive lock
//!   of the key), and semaphores. A semaphore of N permits is N exclusive
//!   advisory locks, one per permit, on the key text followed by `\x01permit`
//!   and the permit's number (`hashtextextended('sku:A1' || E'\x01permit0', 0)`
//!   in SQL). A free permit is looked for on the shared connection, one
//!   round trip per permit tried, starting from a different one each time;
//!   when all are taken, the wait is in the server for one of them, chosen
//!   in turn, so a waiter may wait while another permit is free (permits
//!   are not pooled like a counting semaphore's; across processes each
//!   permit's queue is in arrival order). The permit count is per request:
//!   callers must agree on it.
//! - Connections: one shared, plus one per key waited for (or held after a
//!   wait) at once, up to [`PostgresOptions::max_connections`]; past that
//!   an acquisition fails at once with an error saying so (a 503 through
//!   the layer), rather than wait for a connection. Pooled idle ones are
//!   closed to make room. Read locks are not passed between a process's
//!   readers, and a second concurrent read of one key in a process takes a
//!   connection of its own: many concurrent readers of one key need as many
//!   connections.
//!
//! # Examples
//!
//! ```no_run
//! # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
//! use tower_lock::backend::postgres::PostgresBackend;
//! use tower_lock::Locker;
//!
//! let pg = PostgresBackend::connect("postgres://app@127.0.0.1:5432/orders").await?;
//! let guard = Locker::new(pg).lock("order:42").await?;
//! // ... write to the database with guard.token() as the fencing token ...
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod advisory;
mod inspect;
mod options;
mod session;
mod table;
mod table_sql;

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

pub use self::options::PostgresOptions;
use self::session::Advisory;
use self::table::LeaseTable;
use super::sql::take_param;
use crate::backend::engine::lease::check_lease;
use crate::backend::engine::{InFlight, Store};
use crate::backend::identity::holder_identity_within;
use crate::backend::{
    Acquired, BreakScope, Broken, Capabilities, Inspection, LockRequest, RemoteBackend,
};
use crate::error::LockError;
use crate::key::LockKey;
use crate::token::FencingToken;

/// Locks held as PostgreSQL session-level advisory locks.
///
/// See the [module documentation](self) for how locks are taken, the
/// tokens, and what a connection does and does not guarantee. Cloning is
/// cheap and shares the connections.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::postgres::PostgresBackend;
/// use tower_lock::{LockLayer, PathParam};
///
/// let pg = PostgresBackend::connect("postgres://app@127.0.0.1:5432/orders").await?;
/// let layer = LockLayer::new(pg, PathParam("sku")).namespace("sku");
/// # Ok(()) }
/// ```
pub type PostgresBackend = RemoteBackend<PostgresStore>;

/// PostgreSQL in one of its two modes, advisory locks or a lease table: the
/// store behind [`PostgresBackend`]. Each mode's acquire path is in its
/// file; the engine ([`RemoteBackend`]) does the rest.
pub struct PostgresStore {
    mode: Mode,
}

enum Mode {
    Advisory(Arc<Advisory>),
    Table(Arc<LeaseTable>),
}

impl Store for PostgresStore {
    const NAME: &'static str = "postgres";

    async fn acquire(self: Arc<Self>, request: LockRequest) -> Result<Acquired, LockError> {
        match &self.mode {
            Mode::Advisory(pg) => pg.clone().acquire(request).await,
            // Boxed: its future is twice the advisory one's, which every
            // advisory acquire would otherwise carry and be copied with.
            Mode::Table(table) => Box::pin(table.clone().acquire(request)).await,
        }
    }

    fn releases(&self) -> &Arc<InFlight> {
        match &self.mode {
            Mode::Advisory(pg) => &pg.releases,
            Mode::Table(table) => &table.releases,
        }
    }

    async fn inspect(self: Arc<Self>, key: LockKey) -> Result<Inspection, LockError> {
        match &self.mode {
            Mode::Advisory(pg) => pg.inspect(key).await,
            Mode::Table(table) => table.inspect(key).await,
        }
    }

    async fn list(self: Arc<Self>, prefix: String) -> Result<Vec<LockKey>, LockError> {
        match &self.mode {
            Mode::Advisory(_) => Err(LockError::Unsupported(
                "PostgreSQL keeps only a hash of each advisory lock's key (pg_locks): \
                 inspect a key by name instead"
                    .into(),
            )),
            Mode::Table(table) => table.list(&prefix).await,
        }
    }

    async fn break_lock(
        self: Arc<Self>,
        key: LockKey,
        scope: BreakScope,
    ) -> Result<Broken, LockError> {
        match &self.mode {
            Mode::Advisory(pg) => pg.break_key(key, scope).await,
            Mode::Table(table) => table.break_key(key).await,
        }
    }

    fn capabilities(&self) -> Capabilities {
        match self.mode {
            // The server queues waiters from every process in order. A lock
            // taken on the shared connection is released on it, and the
            // next try follows the unlock there; a lock taken after a wait
            // is released on its own connection, and a try that overtakes
            // that unlock finds the key busy and waits for it in the
            // server: either way the next local waiter may go as soon as
            // the unlock is sent.
            Mode::Advisory(_) => Capabilities::new()
                .max_tokens(PostgresBackend::TOKEN_SPACING)
                .ordered_release(true)
                .fifo(true),
            // One statement connection per key: a release sent lands before
            // the next acquire.
            Mode::Table(_) => Capabilities::new()
                .exclusive_only()
                .max_tokens(PostgresBackend::TOKEN_SPACING)
                .ordered_release(true),
        }
    }
}

impl PostgresBackend {
    /// How far apart two grants' fencing tokens are: the tokens between serve
    /// the local holders a [`Cohort`](crate::backend::Cohort) passes one grant to.
    pub const TOKEN_SPACING: u32 = 64;

    /// Connects to `postgres://user[:password]@host:port/database` (or
    /// `postgresql://`, and any parameter the driver takes, such as
    /// `?connect_timeout=2`) with default [options](PostgresOptions).
    ///
    /// Opens the shared connection (and creates the token sequence if
    /// missing) at once, so a wrong address or role fails here.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_lock::backend::postgres::PostgresBackend;
    /// use tower_lock::LockError;
    ///
    /// // A malformed URL is refused before anything is connected to.
    /// let wrong = PostgresBackend::connect("postgres://app@db:notaport/orders").await;
    /// assert!(matches!(wrong, Err(LockError::Config(_))));
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::connect_with(url, PostgresOptions::default()).await
    }

    /// Connects with explicit [options](PostgresOptions).
    pub async fn connect_with(url: &str, mut options: PostgresOptions) -> Result<Self, LockError> {
        let UrlParts {
            mut config,
            table: from_url,
            sequence,
            listen,
        } = parse_url(url)?;
        if let Some(sequence) =
            sequence.filter(|_| options.sequence == PostgresOptions::DEFAULT_SEQUENCE)
        {
            options.sequence = sequence;
        }
        if options.label.is_some() || config.get_application_name().is_none() {
            // PostgreSQL keeps 63 bytes of it.
            config.application_name(holder_identity_within(options.label.as_deref(), 63));
        }
        check_lease(options.lease, "PostgreSQL")?;
        super::sql::check_name(&options.sequence, "PostgresOptions::sequence")?;
        if let Some(table) = options.lease_table.clone().or(from_url) {
            super::sql::check_name(&table, "PostgresOptions::lease_table")?;
            // The table's name is also its notification channel's, which
            // PostgreSQL limits to 63 bytes.
            if table.len() > 63 {
                return Err(LockError::Config(format!(
                    "PostgresOptions::lease_table {table:?}: at most 63 characters"
                )));
            }
            // The builder's address, else the URL's.
            let listen_config = match &options.listen_url {
                Some(url) => Some(parse_url(url)?.config),
                None => listen,
            };
            let target = target(&config);
            let inner = LeaseTable::new(
                config,
                listen_config,
                target,
                options.connect_timeout,
                &table,
                &options.sequence,
            );
            inner.start().await?;
            let store = PostgresStore {
                mode: Mode::Table(inner),
            };
            return Ok(RemoteBackend::new(store, options.cohort));
        }
        if options.listen_url.is_some() || listen.is_some() {
            return Err(LockError::Config(
                "PostgresOptions::listen_url (or the URL's listen parameter) applies to the \
                 lease-table mode only (PostgresOptions::lease_table)"
                    .into(),
            ));
        }
        if options.max_connections == 0 {
            return Err(LockError::Config(
                "PostgresOptions::max_connections must be at least 1".into(),
            ));
        }
        let pg = Arc::new(Advisory {
            target: target(&config),
            config,
            lease: options.lease,
            connect_timeout: options.connect_timeout,
            sequence: options.sequence,
            sequence_ready: std::sync::atomic::AtomicBool::new(false),
            shared: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            idle: Mutex::new(Vec::new()),
            connections: super::sql::Connections::new(options.max_connections),
            releases: Arc::default(),
            markers: crate::backend::engine::owner::Tokens::new(),
        });
        pg.shared().await?;
        let store = PostgresStore {
            mode: Mode::Advisory(pg),
        };
        Ok(RemoteBackend::new(store, options.cohort))
    }

    /// The advisory-lock connections open now, the shared one included
    /// (for diagnostics and tests); 0 in the lease-table mode.
    pub fn connections(&self) -> usize {
        match &self.store().mode {
            Mode::Advisory(c) => c.connections.open(),
            Mode::Table(_) => 0,
        }
    }

    /// Whether this backend locks rows of a lease table
    /// ([`PostgresOptions::lease_table`]) rather than advisory locks.
    pub fn is_lease_table(&self) -> bool {
        matches!(self.store().mode, Mode::Table(_))
    }

    /// In the lease-table mode, how many release notifications woke a
    /// waiter of this backend, or its wait to hand a lock on (for
    /// diagnostics and tests).
    pub fn releases_heard(&self) -> u64 {
        match &self.store().mode {
            Mode::Advisory(_) => 0,
            Mode::Table(c) => c.releases_heard(),
        }
    }

    /// In the lease-table mode, whether releases are heard as
    /// notifications now (rather than looked for every 50 ms).
    pub fn hears_releases(&self) -> bool {
        match &self.store().mode {
            Mode::Advisory(_) => false,
            Mode::Table(c) => c.notifications(),
        }
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (mode, target) = match &self.store().mode {
            Mode::Advisory(c) => ("advisory", &c.target),
            Mode::Table(c) => ("lease table", &c.target),
        };
        f.debug_struct("PostgresBackend")
            .field("mode", &mode)
            .field("target", target)
            .field("cohort", &self.cohort_options())
            .finish_non_exhaustive()
    }
}

/// The driver's settings, and the lease table and token sequence the
/// `?lease_table[=name]` and `?sequence=name` parameters name (taken out:
/// the driver knows no such parameter).
fn parse_url(url: &str) -> Result<UrlParts, LockError> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(LockError::Config(format!(
            "not a PostgreSQL URL: {:?} (expected postgres://user@host:port/database)",
            crate::redact::redact(url)
        )));
    };
    if scheme != "postgres" && scheme != "postgresql" {
        return Err(LockError::Config(format!(
            "not a PostgreSQL URL: {:?} (expected postgres:// or postgresql://)",
            crate::redact::redact(url)
        )));
    }
    let (url, table, sequence) = split_url(url);
    if sequence.as_deref() == Some("") {
        return Err(LockError::Config(
            "the URL's sequence parameter needs a name: ?sequence=schema.name".into(),
        ));
    }
    let (url, listen) = super::sql::take_param(&url, "listen");
    let driver = |url: &str| {
        tokio_postgres::Config::from_str(url)
            .map_err(|e| LockError::Config(format!("invalid PostgreSQL URL: {e}")))
    };
    let config = driver(&url)?;
    let listen = match listen.as_deref() {
        None => None,
        Some(hosts) if !hosts.is_empty() && !hosts.contains(['/', '@', '?', '#']) => {
            Some(driver(&with_hosts(&url, hosts))?)
        }
        Some(_) => {
            return Err(LockError::Config(
                "the URL's listen parameter needs a host and port: ?listen=db:5432".into(),
            ))
        }
    };
    Ok(UrlParts {
        config,
        table,
        sequence,
        listen,
    })
}

/// What a PostgreSQL URL says.
struct UrlParts {
    /// The driver's configuration.
    config: tokio_postgres::Config,
    /// The lease table a `lease_table` parameter names.
    table: Option<String>,
    /// The sequence a `sequence` parameter names.
    sequence: Option<String>,
    /// The listener's configuration when a `listen=host:port` parameter
    /// sends it elsewhere: the URL's, with those hosts.
    listen: Option<tokio_postgres::Config>,
}

/// `url` with its hosts (and ports) replaced by `hosts`, its user,
/// password, database and parameters kept.
fn with_hosts(url: &str, hosts: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    let user = authority.rfind('@').map_or("", |at| &authority[..=at]);
    format!("{scheme}://{user}{hosts}{path}")
}

/// `url` without this crate's own parameters (`lease_table`, `sequence`,
/// `listen`), as the driver takes it: for a connection of the application's
/// own to the same database.
///
/// # Examples
///
/// ```
/// use tower_lock::backend::postgres::driver_url;
///
/// let url = "postgres://app@db:6432/orders?lease_table&listen=db:5432&connect_timeout=2";
/// assert_eq!(driver_url(url), "postgres://app@db:6432/orders?connect_timeout=2");
/// ```
pub fn driver_url(url: &str) -> String {
    super::sql::take_param(&split_url(url).0, "listen").0
}

/// The driver's URL, the lease table a `lease_table` parameter names and
/// the sequence a `sequence` parameter names.
fn split_url(url: &str) -> (String, Option<String>, Option<String>) {
    let (url, table) = take_param(url, "lease_table");
    let (url, sequence) = take_param(&url, "sequence");
    let table = table.map(|t| match t.is_empty() {
        true => PostgresOptions::DEFAULT_LEASE_TABLE.to_owned(),
        false => t,
    });
    (url, table, sequence)
}

/// The token of a grant (or floor) that drew `value` from the token
/// sequence ([`spaced_token`](super::sql::spaced_token)).
fn token_of(value: i64) -> FencingToken {
    super::sql::spaced_token(value, PostgresBackend::TOKEN_SPACING)
}

/// `host:port/database`, for messages: never the password.
fn target(config: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .zip(config.get_ports().iter().chain(std::iter::repeat(&5432)))
        .map(|(host, port)| match host {
            tokio_postgres::config::Host::Tcp(h) => format!("{h}:{port}"),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(p) => format!("{}:{port}", p.display()),
        })
        .collect();
    format!(
        "{}/{}",
        hosts.join(","),
        config.get_dbname().unwrap_or("(default database)")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn urls_are_checked_before_connecting() {
        assert!(parse_url("postgres://app@db:5432/orders").is_ok());
        assert!(parse_url("postgresql://app:secret@db/orders").is_ok());
        assert!(parse_url("mysql://app@db/orders").is_err());
        assert!(parse_url("postgres://app@db:port/orders").is_err());
        let parts = parse_url("postgres://app:secret@db:6543/orders").unwrap();
        assert_eq!(target(&parts.config), "db:6543/orders");
        assert_eq!((parts.table, parts.sequence), (None, None));
        assert!(parts.listen.is_none());
    }

    #[test]
    fn a_url_may_name_the_lease_table_and_the_sequence() {
        let table = |url: &str| parse_url(url).unwrap().table;
        assert_eq!(
            table("postgres://app@db/orders?lease_table=locks.leases"),
            Some("locks.leases".to_owned())
        );
        assert_eq!(
            table("postgres://app@db/orders?connect_timeout=2&lease_table"),
            Some(PostgresOptions::DEFAULT_LEASE_TABLE.to_owned())
        );
        let parts =
            parse_url("postgres://app@db/orders?lease_table=t&sequence=s.t&connect_timeout=2")
                .unwrap();
        assert_eq!(
            parts.config.get_connect_timeout(),
            Some(&Duration::from_secs(2))
        );
        assert_eq!(parts.sequence.as_deref(), Some("s.t"));
        assert!(parse_url("postgres://app@db/orders?no_such_thing=1").is_err());
    }

    #[test]
    fn a_url_may_send_the_listener_to_another_address() {
        let url = "postgres://app:secret@pgbouncer:6432/orders?lease_table&listen=db:5432&connect_timeout=2";
        let parts = parse_url(url).unwrap();
        assert_eq!(target(&parts.config), "pgbouncer:6432/orders");
        let listen = parts.listen.unwrap();
        assert_eq!(target(&listen), "db:5432/orders");
        assert_eq!(listen.get_user(), Some("app"));
        assert_eq!(listen.get_password(), Some(&b"secret"[..]));
        assert_eq!(listen.get_connect_timeout(), Some(&Duration::from_secs(2)));
        let two = parse_url("postgres://app@pgb/orders?listen=a:5432,b:5433&lease_table").unwrap();
        assert_eq!(target(&two.listen.unwrap()), "a:5432,b:5433/orders");
        for wrong in [
            "listen",
            "listen=",
            "listen=x@db:5432",
            "listen=db:5432/other",
        ] {
            let err = parse_url(&format!(
                "postgres://app:secret@pgb/orders?lease_table&{wrong}"
            ));
            assert!(matches!(err, Err(LockError::Config(_))), "{wrong}");
        }
        let Err(err) = parse_url("postgres://app:secret@pgb/orders?listen=db:port") else {
            panic!("a port that is no number was taken");
        };
        assert!(!err.to_string().contains("secret"), "{err}");
    }
}
