//! ZooKeeper: session-bound locks, wire-compatible with Apache Curator.
//!
//! Enabled by the `zookeeper` feature; built on the `zookeeper-client` crate.
//!
//! # Layout
//!
//! The lock for key `K` lives under `<root>/<node(K)>` (root `/tower-lock`
//! unless the URL or [`ZookeeperOptions::root`] says otherwise). Each
//! acquisition creates one ephemeral sequential child named as Curator 5
//! names them, so Curator's recipes and this backend queue together on the
//! same path:
//!
//! | mode | node | Curator recipe on the same path |
//! |---|---|---|
//! | exclusive | `_c_<uuid>-lock-<seq>` | `InterProcessMutex` |
//! | read | `_c_<uuid>-__READ__<seq>` | `InterProcessReadWriteLock.readLock()` |
//! | write | `_c_<uuid>-__WRIT__<seq>` | `InterProcessReadWriteLock.writeLock()` |
//! | semaphore | mutex `locks/_c_<uuid>-lock-<seq>`, then `leases/_c_<uuid>-lease-<seq>` | `InterProcessSemaphoreV2` |
//!
//! Parents are created as container nodes, which the server removes once
//! they are empty (every `znode.container.checkIntervalMs`, one minute by
//! default), so idle keys leave nothing behind for long.
//!
//! Nodes are served in order of their sequence numbers (FIFO). Each waiter
//! watches only the node it waits for, with a `getData` watch: the one just
//! before it (exclusive, write, the semaphore's mutex) or the nearest writer
//! before it (read). A release therefore wakes one waiter, not all of them.
//!
//! An acquire sends `create` and `getChildren` back to back on one session:
//! the server answers a session's requests in order, so the listing already
//! contains the new node and an uncontended acquire costs one write round
//! trip. Under a parent the session has not seen exist (a key new to it),
//! the parent and the node are created in one `multi`, one write whose
//! node is the parent's only child, so no listing is sent; where the parent
//! did exist after all, the `multi` fails whole and the node's `create`
//! follows, one round trip more (once per key, while the session remembers
//! the parents it has seen: 4096 of them). A release is one `delete`.
//!
//! # Key encoding
//!
//! A node name is the key itself, with `%` and the characters ZooKeeper
//! refuses in names (U+E000..=U+F8FF, U+FFF0..=U+FFFF) written as `%XX` per
//! UTF-8 byte, so the mapping is one-to-one and a plain key such as
//! `order:42` is the node `order:42` (which is where a Curator user points
//! their recipe). Keys cannot contain `/` or `..`, nor be `.`, and hold at
//! most [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes (at most three times that
//! once encoded): the core refuses them before they reach this backend.
//!
//! # Fencing tokens
//!
//! A lock's token is the creation zxid of its node times [`ZookeeperBackend::TOKEN_SPACING`]
//! (64). The zxid is the ensemble's transaction id, which only grows, across
//! keys, restarts and leader elections, and even when a container parent is
//! reaped and its sequence numbers start again from zero. The zxid has no
//! gaps to hand out, so the spacing makes room: the holders this process
//! passes the node to (see [Cohorting](#cohorting)) take the next tokens,
//! all below the token of any node created later.
//!
//! # Cohorting
//!
//! The backend is a [`Cohort`](crate::backend::Cohort) in front of the recipes: a process's
//! acquisitions of a key queue in the process and only the first creates a
//! node. An exclusive or write lock passes from holder to holder within the
//! process without touching the server, up to [`CohortOptions`]'s bound (32
//! holders, at most [`ZookeeperBackend::TOKEN_SPACING`], or 50 ms from the grant) and only
//! while the session is surely alive; then the node is deleted and the next
//! node in the server's queue, another process's or this one's next, is
//! granted. So processes take turns in the order of their nodes, but within
//! a turn a process serves its own waiters first: waiters are in arrival
//! order across processes only with [`ZookeeperOptions::cohort`] set to
//! [`CohortOptions::off`], which makes one node per acquisition as Curator
//! does.
//!
//! # Sessions: what is and is not guaranteed
//!
//! A lock lives as long as the ZooKeeper session that created it. One
//! session serves all of a backend's locks (as one Curator client does).
//!
//! - **Expiry** (or the client closed) fires every held lock's
//!   [lost signal](crate::LostSignal); the layer's default then aborts the
//!   handler. The next acquire opens a new session: a lock is never assumed
//!   held across sessions.
//! - **Known alive.** The server expires a session a session timeout after
//!   the last request it received from it. The backend therefore sends a
//!   `sync` every sixth of the timeout, and counts the session alive only
//!   until the send time of the last request the server answered plus two
//!   thirds of the timeout. When that passes without an answer (the server
//!   is stopped, the network is partitioned in either direction or both,
//!   the connection is lost), the session is given up and every lock on it
//!   is reported lost, a third of the timeout before the server can expire
//!   it and grant the lock to someone else. Watch notifications and other
//!   traffic from the server never count: under a one-way partition they
//!   keep arriving while nothing this client sends gets through. A short
//!   disconnect (Curator's `SUSPENDED`) that heals in time keeps the locks:
//!   the client reconnects to the same session.
//! - **A paused holder** (GC pause, SIGSTOP) beyond the session timeout
//!   cannot be told in time: its session expires and the next waiter takes
//!   the lock. It is told as soon as it runs again (the lost signal checks
//!   the deadline whenever it is looked at), and its fencing token is older
//!   than the new holder's, so a store that checks tokens refuses its late
//!   writes.
//! - A node deleted by hand while held is not noticed by its holder (as with
//!   Curator).
//!
//! # Release
//!
//! A release is one `delete`. [`LockGuard::release`](crate::LockGuard::release)
//! waits for its answer; dropping the guard (as the layer does) sends it and
//! goes on, the answer awaited in the background. Either way the server
//! applies a session's requests in order, so whatever this backend sends
//! next (the next acquire of the same key, say) already sees the lock
//! released; other clients see it once the delete is applied. When the
//! connection breaks before the answer, the delete is sent again in the
//! background until it is done or the session (and with it the ephemeral
//! node) has ended, which are the only outcomes a delete of one's own node
//! can have; an awaited release then reports the error. In that case an
//! acquire sent meanwhile may still find the released node for a moment: it
//! waits for it like any other, or answers busy under fail-fast.
//! [`Backend::flush`](crate::Backend::flush) waits until every delete sent has been answered: call
//! it before the process exits, or a delete still in flight is lost and its
//! node stays until the session times out.
//!
//! The `lease` of a [`LockRequest`] does not apply: a lock ends when it is
//! released or its session does.
//!
//! # Other clients on the same path
//!
//! - **Curator**: mutex, read/write lock and semaphore interoperate in both
//!   directions (tested against Curator 5.4).
//! - **kazoo**: kazoo's `Lock` names its nodes `<hex>__lock__<seq>`, its
//!   `ReadLock` `<hex>__rlock__<seq>`. This backend counts them as writers
//!   and readers, so it waits for kazoo holders. kazoo ignores other
//!   clients' nodes unless told about them: create kazoo's locks with
//!   `extra_lock_patterns=["-lock-", "__WRIT__", "__READ__"]` and it waits
//!   for ours too (tested).
//!
//! # Semaphore
//!
//! As Curator's `InterProcessSemaphoreV2`: take the mutex `<key>/locks`,
//! create a lease under `<key>/leases`, wait (watching the leases' children)
//! until at most `permits` leases exist, drop the mutex. The differences:
//! the permit count is per request rather than stored in a shared count
//! node, and a lease's data is empty.
//!
//! # Examples
//!
//! ```no_run
//! # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
//! use tower_lock::backend::zookeeper::ZookeeperBackend;
//! use tower_lock::BackendExt;
//!
//! let zk = ZookeeperBackend::connect("zk://127.0.0.1:2181/locks").await?;
//! let guard = zk.lock("order:42").await?; // node /locks/order:42/_c_...-lock-...
//! println!("fencing token {}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod inspect;
mod node;
mod recipes;
mod session;
mod url;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use self::node::Node;
use self::recipes::Role;
use self::session::Session;
pub use self::session::ZookeeperStore;
pub use self::url::node_name;
use self::url::{check_root, parse_url};
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

/// Settings of a [`ZookeeperBackend`].
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::zookeeper::{ZookeeperBackend, ZookeeperOptions};
///
/// let options = ZookeeperOptions::default()
///     .root("/services/orders/locks")
///     .session_timeout(Duration::from_secs(6))
///     .connect_timeout(Duration::from_secs(2));
/// let zk = ZookeeperBackend::connect_with("zk://10.0.0.1:2181,10.0.0.2:2181", options).await?;
/// assert_eq!(zk.root(), "/services/orders/locks");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct ZookeeperOptions {
    root: Option<String>,
    session_timeout: Duration,
    connect_timeout: Duration,
    cohort: CohortOptions,
    label: Option<String>,
}

impl Default for ZookeeperOptions {
    fn default() -> Self {
        ZookeeperOptions {
            root: None,
            session_timeout: ZookeeperOptions::DEFAULT_SESSION_TIMEOUT,
            connect_timeout: ZookeeperOptions::DEFAULT_CONNECT_TIMEOUT,
            cohort: CohortOptions::default(),
            label: None,
        }
    }
}

impl ZookeeperOptions {
    /// The root used when the URL names none.
    pub const DEFAULT_ROOT: &str = "/tower-lock";
    /// The session timeout asked of the server (which clamps it between 2 and
    /// 20 of its ticks).
    pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);
    /// How long connecting may take before the acquire fails.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

    /// The path under which lock nodes live, e.g. `/locks`; overrides the
    /// URL's path. Default [`ZookeeperOptions::DEFAULT_ROOT`].
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = Some(root.into());
        self
    }

    /// The session timeout to ask for. Default [`ZookeeperOptions::DEFAULT_SESSION_TIMEOUT`].
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// How this process's waiters share a lock (see [`Cohort`](crate::backend::Cohort)): on by
    /// default, up to [`CohortOptions::DEFAULT_MAX_GRANTS`] holders (at most
    /// [`ZookeeperBackend::TOKEN_SPACING`]) or [`CohortOptions::DEFAULT_MAX_HOLD`] per lock
    /// node; [`CohortOptions::off`] gives each acquisition a node of its
    /// own, as Curator does.
    pub fn cohort(mut self, cohort: CohortOptions) -> Self {
        self.cohort = cohort;
        self
    }

    /// A label for this process (a service name, say), written with its
    /// process id and host name as each lock node's data, where
    /// [`Backend::inspect`](crate::Backend::inspect) and `tower-lock
    /// inspect` show it (Curator writes its address there). Default none:
    /// the process id and host name alone.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// How long opening a session may take. Default
    /// [`ZookeeperOptions::DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }
}

/// Locks in a ZooKeeper ensemble, compatible with Curator's recipes.
///
/// See the [module documentation](self) for the layout, the tokens and what
/// a session does and does not guarantee. Cloning is cheap and shares the
/// session.
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::zookeeper::ZookeeperBackend;
/// use tower_lock::{LockLayer, PathParam};
///
/// let zk = ZookeeperBackend::connect("zk://127.0.0.1:2181").await?;
/// let layer = LockLayer::new(zk, PathParam("sku"));
/// # Ok(()) }
/// ```
pub type ZookeeperBackend = RemoteBackend<ZookeeperStore>;

impl ZookeeperBackend {
    /// How far apart the fencing tokens of two lock nodes are: a node's token
    /// is its creation zxid times this, and the tokens between are the ones a
    /// [`Cohort`](crate::backend::Cohort) hands to the holders it passes the lock to. So it bounds how
    /// many local holders one node serves.
    pub const TOKEN_SPACING: u32 = 64;

    /// Connects to `zk://host:port[,host:port...][/root]` with default
    /// [options](ZookeeperOptions).
    ///
    /// Opens the session at once, so a wrong address fails here.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_lock::backend::zookeeper::ZookeeperBackend;
    /// use tower_lock::LockError;
    ///
    /// // A malformed URL is refused before anything is connected to.
    /// let wrong = ZookeeperBackend::connect("zookeeper://127.0.0.1:2181").await;
    /// assert!(matches!(wrong, Err(LockError::Config(_))));
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::connect_with(url, ZookeeperOptions::default()).await
    }

    /// Connects with explicit [options](ZookeeperOptions); an option's root
    /// wins over the URL's.
    pub async fn connect_with(url: &str, options: ZookeeperOptions) -> Result<Self, LockError> {
        let (hosts, url_root) = parse_url(url)?;
        let root = options
            .root
            .or(url_root)
            .unwrap_or_else(|| ZookeeperOptions::DEFAULT_ROOT.to_owned());
        check_root(&root)?;
        let store = ZookeeperStore {
            hosts,
            root,
            session_timeout: options.session_timeout,
            connect_timeout: options.connect_timeout,
            identity: holder_identity(options.label.as_deref())
                .into_bytes()
                .into(),
            current: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            releases: Arc::default(),
        };
        store.session().await?;
        Ok(RemoteBackend::new(store, options.cohort))
    }

    /// The path of the node under which `key`'s lock nodes are created.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::backend::zookeeper::ZookeeperBackend;
    /// use tower_lock::LockKey;
    ///
    /// let zk = ZookeeperBackend::connect("zk://127.0.0.1:2181/locks").await?;
    /// assert_eq!(zk.root(), "/locks");
    /// // Where Curator's `InterProcessMutex` points to share the lock:
    /// assert_eq!(zk.lock_path(&LockKey::new("order:42")?), "/locks/order:42");
    /// # Ok(()) }
    /// ```
    pub fn lock_path(&self, key: &LockKey) -> String {
        self.store().dir(key)
    }

    /// The root under which all lock paths live.
    pub fn root(&self) -> &str {
        &self.store().root
    }

    /// The current session's id, if one is open (for diagnostics and tests).
    pub fn session_id(&self) -> Option<i64> {
        lock(&self.store().current)
            .as_ref()
            .map(|s| s.client.session_id().0)
    }
}

impl fmt::Debug for ZookeeperBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZookeeperBackend")
            .field("hosts", &self.store().hosts)
            .field("root", &self.store().root)
            .field("cohort", &self.cohort_options())
            .finish_non_exhaustive()
    }
}

impl Store for ZookeeperStore {
    const NAME: &'static str = "zookeeper";

    async fn acquire(self: Arc<Self>, request: LockRequest) -> Result<Acquired, LockError> {
        let session = self.session().await?;
        let dir = self.dir(&request.key);
        let role = match request.mode {
            LockMode::Exclusive => Role::Exclusive,
            LockMode::Read => Role::Read,
            LockMode::Write => Role::Write,
            LockMode::Semaphore { permits } => {
                let lease = session.semaphore(&dir, permits, request.wait).await?;
                return Ok(self.held(&session, lease, false, 1));
            }
        };
        let node = session.lock_node(&dir, role, request.wait).await?;
        let tokens = if role == Role::Read {
            1
        } else {
            request.tokens
        };
        Ok(self.held(&session, node, role != Role::Read, tokens))
    }

    fn releases(&self) -> &Arc<InFlight> {
        &self.releases
    }

    // A session's requests are applied in order, and waiters queue by
    // sequence number across every client.
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
            .max_tokens(ZookeeperBackend::TOKEN_SPACING)
            .ordered_release(true)
            .fifo(true)
    }
}

impl ZookeeperStore {
    /// A granted node as an [`Acquired`], registered with its session;
    /// `writer` for exclusive and write locks.
    fn held(&self, session: &Arc<Session>, node: Node, writer: bool, tokens: u32) -> Acquired {
        let tokens = tokens.clamp(1, ZookeeperBackend::TOKEN_SPACING);
        let token =
            FencingToken::new(node.czxid as u64 * u64::from(ZookeeperBackend::TOKEN_SPACING));
        let lock = node.into_lock();
        let path = lock.path.clone();
        let lease = Lease::new(
            lock,
            self.session_timeout,
            session.alive_until.clone(),
            self.releases.clone(),
        );
        session.holds.insert(path, &lease, writer);
        lease.acquired(token, tokens)
    }
}
