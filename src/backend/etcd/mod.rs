//! etcd: lease-bound locks, on etcd's own lock protocol (Go's
//! `concurrency.Mutex`, which `etcdctl lock` speaks).
//!
//! Enabled by the `etcd` feature; built on the `etcd-client` crate.
//!
//! # Protocol
//!
//! The lock for key `K` is the prefix `<root>/K/` (root `/tower-lock` unless
//! the URL or [`EtcdOptions::root`] says otherwise). Each acquisition puts
//! one key of its own under the prefix, attached to the backend's lease,
//! and the keys are served in the order of their create revisions, whoever
//! made them:
//!
//! 1. One transaction puts our key (if it does not exist yet, so that a
//!    retry after a lost answer finds the key it made) and reads the head
//!    of the queue. Our key first: the lock is held, in one round trip.
//! 2. Otherwise the contender watches the deletion of the key just before
//!    its own (for a reader, of the nearest writer before it), then reads
//!    whether that key went before the watch began, so a deletion in
//!    between is not missed. The watch starts at the current revision:
//!    etcd serves one that starts in the past from a catch-up loop that
//!    runs every 100 ms (which is what a handoff costs Go's
//!    `concurrency.Mutex`). One release wakes one waiter.
//! 3. After a wait, the key is read again: it must still exist, under our
//!    lease, with the create revision we had. Jepsen's analysis of etcd
//!    3.4.3 found etcd's lock service granting after the lease had expired
//!    (etcd issue 11456); the linearizable read rules that out here.
//!
//! `etcdctl lock <root>/K` (and any Go program with
//! `concurrency.NewMutex(session, "<root>/K")`) queues with this backend on
//! the same prefix: each waits for the other (tested in both directions).
//! A reader's key holds a value starting with `read`; any other key,
//! `etcdctl`'s included, counts as a writer. There is no semaphore mode.
//!
//! A key is named `<lease>-<n>` (hexadecimal lease id, `n` the lowest
//! number this process has not in use under the prefix), so that one
//! process's acquisitions reuse a name. A name is put again only after the
//! delete of its previous key has been answered; a create whose
//! acquisition is cancelled is still awaited before its key is deleted
//! (one client's requests travel on concurrent streams, so a delete sent
//! earlier could be applied first). A key of our lease that no acquisition
//! owns (an uncertain create that applied late) is deleted by the next
//! acquisition that meets it. A key ahead that is deleted and put again
//! under its name (a Go client locking again) is a new contender behind
//! us: the waiter compares create revisions, not names.
//!
//! # Fencing tokens
//!
//! A lock's token is the create revision of its key times
//! [`EtcdBackend::TOKEN_SPACING`] (64). The revision is the cluster's, which only grows,
//! across keys, restarts and leader elections. The holders this process
//! passes the key to (see [Cohorting](#cohorting)) take the tokens between,
//! all below the token of any key created later.
//!
//! # Cohorting
//!
//! As for ZooKeeper, a [`Cohort`](crate::backend::Cohort) sits in front: a process's acquisitions
//! of a key queue in the process and only the first puts a key; an
//! exclusive or write lock passes from holder to holder within the process,
//! up to [`CohortOptions`]'s bound, while the lease is surely alive.
//! [`CohortOptions::off`] gives each acquisition a key of its own.
//!
//! # Leases: what is and is not guaranteed
//!
//! Every lock of a backend is attached to one etcd lease (TTL
//! [`EtcdOptions::DEFAULT_LEASE_TTL`]), as a Go `concurrency.Session` does.
//!
//! - **Known alive.** The leader expires a lease a TTL after the last
//!   keep-alive it received. The backend sends one every sixth of the TTL
//!   and counts the lease alive only until the send time of the last one
//!   answered plus two thirds of the TTL. When that passes without an
//!   answer (a server stopped or partitioned away, in either direction, a
//!   cluster without a leader), the lease is given up and every lock on it
//!   is reported lost, a third of the TTL before the server can expire it
//!   and grant the lock to someone else. Watch events and other traffic
//!   from the server never count.
//! - **Expiry** (a keep-alive answered with TTL 0: the lease expired or was
//!   revoked) fires every held lock's [lost signal](crate::LostSignal) at
//!   once. The next acquire takes a new lease.
//! - A lease given up is not revoked: the third of the TTL between telling
//!   its holders and the server expiring it is theirs to stop in.
//! - **A paused holder** beyond the TTL cannot be told in time: the lease
//!   expires and the next waiter takes the lock. It is told as soon as it
//!   runs again, and its fencing token is older than the new holder's.
//! - A key deleted by hand while held is not noticed by its holder (as
//!   with Go's mutex).
//! - Not covered, on a cluster of etcd 3.4.23 (Debian 12's): a leader
//!   paused and resumed revokes the leases that expired in its own view
//!   before it learns it was deposed, and the revoke is applied (etcd
//!   issues 12528 and 15247, fixed upstream by pull request 16822). The
//!   locks on such a lease are freed while their holders still count on
//!   them; each holder hears of it at its next keep-alive, a sixth of the
//!   TTL later at most, and its fencing token is older than the next
//!   holder's.
//!
//! On a cluster, the client balances over the endpoints; every request
//! that decides (the transaction, the re-check, keep-alives) is
//! linearizable, so a member cut off from the leader cannot grant.
//!
//! # Release
//!
//! A release is one delete. [`LockGuard::release`](crate::LockGuard::release)
//! waits for its answer; dropping the guard sends it and goes on, the
//! answer awaited in the background and the delete sent again after a
//! broken connection (and, for one lease TTL, after a refusal: the key
//! would keep the lock from everyone) until done or, once the lease has
//! ended, a lease time after the release.
//! [`Backend::flush`](crate::Backend::flush) waits for them. When the
//! backend is dropped, its lease is revoked, which deletes whatever it
//! still held.
//!
//! The `lease` of a [`LockRequest`] does not apply: a lock ends when it is
//! released or its lease does.
//!
//! # History
//!
//! etcd keeps every key name it has seen in its index, and every revision
//! of it, until its history is compacted. Names are reused per lease, so
//! they pile up only with new leases (a process started, a lease lost);
//! revisions pile up with every acquisition. Run etcd with history
//! compaction (`--auto-compaction-retention`, as Kubernetes clusters do).
//!
//! # Examples
//!
//! ```no_run
//! # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
//! use tower_lock::backend::etcd::EtcdBackend;
//! use tower_lock::BackendExt;
//!
//! let etcd = EtcdBackend::connect("etcd://127.0.0.1:2379/locks").await?;
//! let guard = etcd.lock("order:42").await?; // key /locks/order:42/<lease>-0
//! println!("fencing token {}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod contender;
mod inspect;
mod session;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use self::session::EtcdStore;
use crate::backend::engine::lease::Lease;
use crate::backend::engine::{InFlight, Store};
use crate::backend::identity::holder_identity;
use crate::backend::{
    Acquired, BreakScope, Broken, Capabilities, CohortOptions, Inspection, LockRequest,
    RemoteBackend,
};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;
use crate::sync::lock;
use crate::token::FencingToken;

/// Settings of an [`EtcdBackend`].
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::etcd::{EtcdBackend, EtcdOptions};
///
/// let options = EtcdOptions::default()
///     .root("/services/orders/locks")
///     .lease_ttl(Duration::from_secs(6))
///     .connect_timeout(Duration::from_secs(2));
/// let etcd = EtcdBackend::connect_with("etcd://10.0.0.1:2379,10.0.0.2:2379", options).await?;
/// assert_eq!(etcd.root(), "/services/orders/locks");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    root: Option<String>,
    lease_ttl: Duration,
    connect_timeout: Duration,
    cohort: CohortOptions,
    label: Option<String>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            root: None,
            lease_ttl: EtcdOptions::DEFAULT_LEASE_TTL,
            connect_timeout: EtcdOptions::DEFAULT_CONNECT_TIMEOUT,
            cohort: CohortOptions::default(),
            label: None,
        }
    }
}

impl EtcdOptions {
    /// The root used when the URL names none.
    pub const DEFAULT_ROOT: &str = "/tower-lock";
    /// The lease TTL asked of the server (whole seconds; the server may grant
    /// more).
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
    /// How long the first answer may take before an acquire fails.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

    /// The prefix under which lock keys live, e.g. `/locks`; overrides the
    /// URL's path. Default [`EtcdOptions::DEFAULT_ROOT`].
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = Some(root.into());
        self
    }

    /// The TTL of the lease the locks are attached to, in whole seconds (at
    /// least one). Default [`EtcdOptions::DEFAULT_LEASE_TTL`].
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How this process's waiters share a lock (see [`Cohort`](crate::backend::Cohort)); on by
    /// default, [`CohortOptions::off`] gives each acquisition a key.
    pub fn cohort(mut self, cohort: CohortOptions) -> Self {
        self.cohort = cohort;
        self
    }

    /// A label for this process (a service name, say), written with its
    /// process id and host name in each lock key's value, where
    /// [`Backend::inspect`](crate::Backend::inspect) and `tower-lock
    /// inspect` show it. Default none: the process id and host name alone.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// How long the first answer (granting the lease) may take. Default
    /// [`EtcdOptions::DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }
}

/// Locks in etcd, on the protocol of Go's `concurrency.Mutex`.
///
/// See the [module documentation](self) for the protocol, the tokens and
/// what a lease does and does not guarantee. Cloning is cheap and shares
/// the lease.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::etcd::EtcdBackend;
/// use tower_lock::{LockLayer, PathParam};
///
/// let etcd = EtcdBackend::connect("etcd://127.0.0.1:2379").await?;
/// let layer = LockLayer::new(etcd, PathParam("sku"));
/// # Ok(()) }
/// ```
pub type EtcdBackend = RemoteBackend<EtcdStore>;

/// Splits `etcd://host:port[,host:port...][/root]`.
fn parse_url(url: &str) -> Result<(Vec<String>, Option<String>), LockError> {
    let rest = url.strip_prefix("etcd://").ok_or_else(|| {
        LockError::Config(format!(
            "an etcd URL looks like etcd://host:port[,host:port...][/root], not {url:?}"
        ))
    })?;
    let (hosts, root) = match rest.find('/') {
        Some(i) => (&rest[..i], Some(&rest[i..])),
        None => (rest, None),
    };
    if hosts.contains('@') {
        // Shown redacted (`etcd://***@host`): the endpoints alone would
        // show the password.
        return Err(LockError::Config(format!(
            "an etcd URL takes no user or password: {url:?}"
        )));
    }
    let hosts: Vec<&str> = hosts.split(',').collect();
    if hosts.iter().any(|h| {
        h.rsplit_once(':')
            .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
    }) {
        return Err(LockError::Config(format!(
            "an etcd URL names each server as host:port: {url:?}"
        )));
    }
    let endpoints = hosts.iter().map(|h| format!("http://{h}")).collect();
    let root = root.filter(|r| *r != "/").map(str::to_owned);
    Ok((endpoints, root))
}

fn check_root(root: &str) -> Result<(), LockError> {
    if !root.starts_with('/') || root.ends_with('/') {
        return Err(LockError::Config(format!(
            "etcd root {root:?} must start with `/` and not end with it"
        )));
    }
    Ok(())
}

impl EtcdBackend {
    /// How far apart the fencing tokens of two lock keys are: a key's token is
    /// its create revision times this, and the tokens between go to the holders
    /// a [`Cohort`](crate::backend::Cohort) passes the key to.
    pub const TOKEN_SPACING: u32 = 64;

    /// Connects to `etcd://host:port[,host:port...][/root]` with default
    /// [options](EtcdOptions).
    ///
    /// Grants the lease at once, so an unreachable cluster fails here.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_lock::backend::etcd::EtcdBackend;
    /// use tower_lock::LockError;
    ///
    /// // A malformed URL is refused before anything is connected to.
    /// let wrong = EtcdBackend::connect("etcd://127.0.0.1").await;
    /// assert!(matches!(wrong, Err(LockError::Config(_))));
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::connect_with(url, EtcdOptions::default()).await
    }

    /// Connects with explicit [options](EtcdOptions); an option's root wins
    /// over the URL's.
    pub async fn connect_with(url: &str, options: EtcdOptions) -> Result<Self, LockError> {
        let (endpoints, url_root) = parse_url(url)?;
        let root = options
            .root
            .or(url_root)
            .unwrap_or_else(|| EtcdOptions::DEFAULT_ROOT.to_owned());
        check_root(&root)?;
        if options.lease_ttl < Duration::from_secs(1) {
            return Err(LockError::Config(
                "an etcd lease TTL is at least one second".into(),
            ));
        }
        // HTTP/2 pings find a dead connection, so that requests fail over
        // to another endpoint rather than hang; they prove nothing about
        // the lease. A member cut off from the leader refuses at once
        // (`require_leader`) rather than hold a request until it times out.
        let ping = (options.lease_ttl / 6).max(Duration::from_millis(500));
        let connect = etcd_client::ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            .with_keep_alive(ping, ping)
            .with_keep_alive_while_idle(true)
            .with_require_leader(true);
        let client = etcd_client::Client::connect(&endpoints, Some(connect))
            .await
            .map_err(|e| {
                session::etcd_error(&format!("connecting to etcd at {}", endpoints.join(",")), e)
            })?;
        let store = EtcdStore {
            endpoints,
            root,
            ttl: options.lease_ttl,
            connect_timeout: options.connect_timeout,
            client,
            current: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            releases: Arc::default(),
            next: AtomicU64::new(0),
            identity: holder_identity(options.label.as_deref()),
        };
        store.session().await?;
        Ok(RemoteBackend::new(store, options.cohort))
    }

    /// The prefix under which `key`'s contender keys are put: what
    /// `etcdctl lock` is given to share the lock (without the final `/`).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::backend::etcd::EtcdBackend;
    /// use tower_lock::LockKey;
    ///
    /// let etcd = EtcdBackend::connect("etcd://127.0.0.1:2379/locks").await?;
    /// // `etcdctl lock /locks/order:42` takes the same lock.
    /// assert_eq!(etcd.lock_name(&LockKey::new("order:42")?), "/locks/order:42");
    /// # Ok(()) }
    /// ```
    pub fn lock_name(&self, key: &LockKey) -> String {
        self.store().name(key)
    }

    /// The root under which all lock names live.
    pub fn root(&self) -> &str {
        &self.store().root
    }

    /// The current lease's id, if one is held (for diagnostics and tests).
    pub fn lease_id(&self) -> Option<i64> {
        lock(&self.store().current).as_ref().map(|s| s.lease)
    }
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.store().endpoints)
            .field("root", &self.store().root)
            .field("cohort", &self.cohort_options())
            .finish_non_exhaustive()
    }
}

impl Store for EtcdStore {
    const NAME: &'static str = "etcd";

    async fn acquire(self: Arc<Self>, request: LockRequest) -> Result<Acquired, LockError> {
        let reader = match request.mode {
            LockMode::Exclusive | LockMode::Write => false,
            LockMode::Read => true,
            LockMode::Semaphore { .. } => {
                return Err(LockError::InvalidMode(
                    "the etcd backend has no semaphore locks".into(),
                ))
            }
        };
        let session = self.session().await?;
        let prefix = format!("{}/", self.name(&request.key));
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let value = if reader {
            format!("read {n:x} {}", self.identity)
        } else {
            format!("{n:x} {}", self.identity)
        };
        let contender = session
            .contend(&prefix, value.into_bytes(), request.wait)
            .await?;
        let tokens = if reader { 1 } else { request.tokens };
        let tokens = tokens.clamp(1, EtcdBackend::TOKEN_SPACING);
        let token =
            FencingToken::new(contender.revision as u64 * u64::from(EtcdBackend::TOKEN_SPACING));
        let held = contender.into_lock();
        let key = held.key().to_owned();
        let lease = Lease::new(
            held,
            self.ttl,
            session.alive_until.clone(),
            self.releases.clone(),
        );
        session.holds.insert(key, &lease, ());
        Ok(lease.acquired(token, tokens))
    }

    fn releases(&self) -> &Arc<InFlight> {
        &self.releases
    }

    // Keys queue by create revision across every client. Releases are not
    // ordered before later requests: one client's requests travel on
    // concurrent HTTP/2 streams. A create applied before the release it
    // followed finds the released key ahead and waits in the queue for its
    // delete, so the next acquire need not wait for the release's answer.
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

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .no_semaphore()
            .max_tokens(EtcdBackend::TOKEN_SPACING)
            .fifo(true)
            .waits_in_server(true)
    }
}

impl EtcdStore {
    fn name(&self, key: &LockKey) -> String {
        format!("{}/{}", self.root, key.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_every_server_and_an_optional_root() {
        let (endpoints, root) = parse_url("etcd://a:2379,b:2380/locks").unwrap();
        assert_eq!(endpoints, ["http://a:2379", "http://b:2380"]);
        assert_eq!(root.as_deref(), Some("/locks"));
        assert_eq!(parse_url("etcd://a:1/").unwrap().1, None);
        for bad in [
            "etcd://a",
            "etcd://",
            "etcd://a:1,",
            "zk://a:1",
            "etcd://a:x",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        assert!(check_root("/a/b").is_ok());
        assert!(check_root("a").is_err());
        assert!(check_root("/a/").is_err());
    }
}
