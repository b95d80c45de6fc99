//! [`PostgresOptions`]: the settings of a [`PostgresBackend`].

use std::time::Duration;

#[cfg(doc)]
use super::PostgresBackend;
use crate::backend::CohortOptions;
#[cfg(doc)]
use crate::LockError;

/// Settings of a [`PostgresBackend`].
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::postgres::{PostgresBackend, PostgresOptions};
///
/// let options = PostgresOptions::default()
///     .session_lease(Duration::from_secs(5))
///     .max_connections(8)
///     .sequence("locks.tokens");
/// let pg = PostgresBackend::connect_with("postgres://app@db:5432/orders", options).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PostgresOptions {
    pub(super) lease: Duration,
    pub(super) connect_timeout: Duration,
    pub(super) max_connections: usize,
    pub(super) sequence: String,
    pub(super) lease_table: Option<String>,
    pub(super) listen_url: Option<String>,
    pub(super) cohort: CohortOptions,
    pub(super) label: Option<String>,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            lease: PostgresOptions::DEFAULT_SESSION_LEASE,
            connect_timeout: PostgresOptions::DEFAULT_CONNECT_TIMEOUT,
            max_connections: PostgresOptions::DEFAULT_MAX_CONNECTIONS,
            sequence: PostgresOptions::DEFAULT_SEQUENCE.to_owned(),
            lease_table: None,
            listen_url: None,
            cohort: CohortOptions::default(),
            label: None,
        }
    }
}

impl PostgresOptions {
    /// How long a session is known alive after a request it sent was answered.
    pub const DEFAULT_SESSION_LEASE: Duration = Duration::from_secs(10);
    /// How long connecting may take before the acquisition fails.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// The most connections one backend opens.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 32;
    /// The token sequence used when none is named.
    pub const DEFAULT_SEQUENCE: &str = "tower_lock_tokens";
    /// The lease table's name in a URL's `?lease_table` without a value.
    pub const DEFAULT_LEASE_TABLE: &str = "tower_lock_leases";

    /// How long a connection is known alive after a request it sent was
    /// answered (see the [module docs](super)); a lock request's own lease
    /// does not apply. Default [`PostgresOptions::DEFAULT_SESSION_LEASE`]; the server keeps a silent
    /// connection (and its locks) at least this long, so a dead holder's
    /// locks behind a partition are freed about twice this after it went
    /// silent.
    pub fn session_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long opening a connection may take. Default
    /// [`PostgresOptions::DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The most connections this backend opens. Default
    /// [`PostgresOptions::DEFAULT_MAX_CONNECTIONS`].
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }

    /// The sequence fencing tokens are drawn from, optionally
    /// schema-qualified (`schema.name`, lower-case letters, digits and
    /// `_`). Created on first use if missing; a role that may not create it
    /// needs it made once: `CREATE SEQUENCE tower_lock_tokens`. Default
    /// [`PostgresOptions::DEFAULT_SEQUENCE`], or the URL's `?sequence=name`
    /// (which is how the `tower-lock` command, that takes only a URL, is
    /// told the application's).
    ///
    /// One made by hand must hand out its values in the order they are
    /// drawn: `CACHE 1` (the default; with more, each session draws from a
    /// block of its own, and a later grant can get a lower token), `NO
    /// CYCLE` and a positive `INCREMENT`. Any other is refused with a
    /// [`LockError::Config`] that gives the `ALTER SEQUENCE` to run.
    pub fn sequence(mut self, name: impl Into<String>) -> Self {
        self.sequence = name.into();
        self
    }

    /// Locks rows of this table instead of taking advisory locks: the
    /// [lease-table mode](super#the-lease-table-mode), for a connection
    /// through a pooler in transaction mode. Optionally schema-qualified,
    /// as [`sequence`](Self::sequence); created on first use if missing.
    /// A URL selects it with `?lease_table=name` (or `?lease_table` for
    /// [`PostgresOptions::DEFAULT_LEASE_TABLE`]).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
    /// use tower_lock::backend::postgres::{PostgresBackend, PostgresOptions};
    ///
    /// // Statements through PgBouncer in transaction mode; notifications
    /// // of releases straight from the server.
    /// let options = PostgresOptions::default()
    ///     .lease_table("tower_lock_leases")
    ///     .listen_url("postgres://app@db:5432/orders");
    /// let pg = PostgresBackend::connect_with("postgres://app@pgbouncer:6432/orders", options).await?;
    /// # Ok(()) }
    /// ```
    pub fn lease_table(mut self, name: impl Into<String>) -> Self {
        self.lease_table = Some(name.into());
        self
    }

    /// In the lease-table mode, where the connection that listens for
    /// releases goes (`LISTEN` needs a session of its own, which a pooler
    /// in transaction mode does not keep): the server itself, or a pooler
    /// in session mode. Default: the URL's `listen=host:port` parameter
    /// (the URL with those hosts: `?lease_table&listen=db:5432`), else the
    /// backend's URL; where notifications do not arrive there, waiters look
    /// again every 50 ms instead.
    pub fn listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
        self
    }

    /// How this process's waiters share a lock (see [`Cohort`](crate::backend::Cohort)): on by
    /// default, up to [`CohortOptions::DEFAULT_MAX_GRANTS`] holders (at most
    /// [`PostgresBackend::TOKEN_SPACING`]) or [`CohortOptions::DEFAULT_MAX_HOLD`] per grant.
    pub fn cohort(mut self, cohort: CohortOptions) -> Self {
        self.cohort = cohort;
        self
    }

    /// A label for this process (a service name, say): with its process id
    /// and host name it is each connection's `application_name`, which
    /// [`Backend::inspect`](crate::Backend::inspect) and `tower-lock
    /// inspect` show beside an advisory lock's holder (`pg_stat_activity`).
    /// Default none: the URL's `application_name` if it sets one, else the
    /// process id and host name alone. PostgreSQL keeps 63 bytes of it.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
}
