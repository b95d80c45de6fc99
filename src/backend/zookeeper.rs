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
//! Waiters are served in order of their sequence numbers (FIFO). Each waiter
//! watches only the node it waits for, with a `getData` watch: the one just
//! before it (exclusive, write, the semaphore's mutex) or the nearest writer
//! before it (read). A release therefore wakes one waiter, not all of them.
//!
//! An acquire sends `create` and `getChildren` back to back on one session:
//! the server answers a session's requests in order, so the listing already
//! contains the new node and an uncontended acquire costs one write round
//! trip. A release is one `delete`.
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
//! A lock's token is the creation zxid of its node: the ensemble's
//! transaction id, which only grows, across keys, restarts and leader
//! elections, and even when a container parent is reaped and its sequence
//! numbers start again from zero.
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
//! [`Backend::flush`] waits until every delete sent has been answered: call
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
//! use tower_lock::backend::ZookeeperBackend;
//! use tower_lock::BackendExt;
//!
//! let zk = ZookeeperBackend::connect("zk://127.0.0.1:2181/locks").await?;
//! let guard = zk.lock("order:42").await?; // node /locks/order:42/_c_...-lock-...
//! println!("fencing token {}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use zookeeper_client as zk;

use super::{Acquired, Backend, BackendFuture, InFlight, LeaseHandle, LockRequest};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::{Deadline, HasLostState, LostSignal, LostState};
use crate::mode::{LockMode, Wait};
use crate::token::FencingToken;

/// The root used when the URL names none.
pub const DEFAULT_ROOT: &str = "/tower-lock";
/// The session timeout asked of the server (which clamps it between 2 and
/// 20 of its ticks).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting may take before the acquire fails.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

const LOCK_NAME: &str = "lock-";
const READ_NAME: &str = "__READ__";
const WRITE_NAME: &str = "__WRIT__";
const LEASE_NAME: &str = "lease-";
/// Curator's protected-mode prefix: `_c_<uuid>-`.
const PROTECTED: &str = "_c_";

/// Settings of a [`ZookeeperBackend`].
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::{ZookeeperBackend, ZookeeperOptions};
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
}

impl Default for ZookeeperOptions {
    fn default() -> Self {
        ZookeeperOptions {
            root: None,
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }
}

impl ZookeeperOptions {
    /// The path under which lock nodes live, e.g. `/locks`; overrides the
    /// URL's path. Default [`DEFAULT_ROOT`].
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = Some(root.into());
        self
    }

    /// The session timeout to ask for. Default [`DEFAULT_SESSION_TIMEOUT`].
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// How long opening a session may take. Default
    /// [`DEFAULT_CONNECT_TIMEOUT`].
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
/// use tower_lock::backend::ZookeeperBackend;
/// use tower_lock::{LockLayer, PathParam};
///
/// let zk = ZookeeperBackend::connect("zk://127.0.0.1:2181").await?;
/// let layer = LockLayer::new(zk, PathParam("sku"));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ZookeeperBackend {
    inner: Arc<ZkInner>,
}

struct ZkInner {
    hosts: String,
    root: String,
    session_timeout: Duration,
    connect_timeout: Duration,
    current: Mutex<Option<Arc<Session>>>,
    /// One session opening at a time.
    opening: tokio::sync::Mutex<()>,
    /// Deletes sent and not yet answered, on every session.
    releases: Arc<InFlight>,
}

/// One ZooKeeper session and the locks that live with it.
struct Session {
    client: zk::Client,
    /// Until when the server surely keeps the session: see [`keep_alive`].
    alive_until: crate::lost::Deadline,
    /// Set when the session ends (or is given up): no new lock is taken on
    /// it, and every lock it holds is lost with it.
    ended: AtomicBool,
    /// Wakes the acquires waiting on this session when it ends.
    ended_notify: tokio::sync::Notify,
    /// The locks held on this session by node path, told when it ends.
    /// Each has a lost state of its own, so that a lock's waker list lives
    /// only as long as the lock. The flag marks exclusive and write locks:
    /// their waiters need not list the children again when they go.
    holds: Mutex<HashMap<String, (Weak<ZkHold>, bool)>>,
    /// The backend's deletes in flight.
    releases: Arc<InFlight>,
}

impl Session {
    /// Whether new requests may use this session.
    fn usable(&self) -> bool {
        !self.ended.load(Ordering::Acquire) && alive(self) && !self.alive_until.passed()
    }

    /// Ends the session, saying why in the log.
    fn end_with_warning(&self, reason: String) {
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        tracing::warn!(
            session = self.client.session_id().0,
            reason,
            "zookeeper locks lost"
        );
        self.end(reason);
    }

    /// Ends the session for this backend: tells its waiters and holders.
    fn end(&self, reason: String) {
        self.ended.store(true, Ordering::Release);
        self.ended_notify.notify_waiters();
        let holds: Vec<_> = lock(&self.holds).drain().collect();
        for (_, (hold, _)) in holds {
            if let Some(hold) = hold.upgrade() {
                hold.lost.fire(reason.clone());
            }
        }
    }
}

fn zk_error(doing: &str, e: zk::Error) -> LockError {
    LockError::backend("zookeeper", doing.to_owned(), Some(Box::new(e) as _))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `zk://host:port[,host:port...][/root]` into hosts and root.
fn parse_url(url: &str) -> Result<(String, Option<String>), LockError> {
    let rest = url.strip_prefix("zk://").ok_or_else(|| {
        LockError::Config(format!(
            "a ZooKeeper URL looks like zk://host:port[,host:port...][/root], not {url:?}"
        ))
    })?;
    let (hosts, root) = match rest.find('/') {
        Some(i) => (&rest[..i], Some(&rest[i..])),
        None => (rest, None),
    };
    if hosts.is_empty() || hosts.split(',').any(|h| !h.contains(':')) {
        return Err(LockError::Config(format!(
            "a ZooKeeper URL names each server as host:port: {url:?}"
        )));
    }
    let root = root.filter(|r| *r != "/").map(str::to_owned);
    Ok((hosts.to_owned(), root))
}

fn check_root(root: &str) -> Result<(), LockError> {
    let bad = |why: &str| Err(LockError::Config(format!("ZooKeeper root {root:?} {why}")));
    if !root.starts_with('/') || root.len() < 2 {
        return bad("must be an absolute path below `/`");
    }
    if root.ends_with('/') {
        return bad("must not end with `/`");
    }
    for segment in root[1..].split('/') {
        if segment.is_empty() || segment == "." || segment == ".." {
            return bad("has an empty, `.` or `..` segment");
        }
        if segment.chars().any(forbidden_in_name) {
            return bad("holds a character ZooKeeper refuses in node names");
        }
    }
    if root == "/zookeeper" || root.starts_with("/zookeeper/") {
        return bad("is inside ZooKeeper's reserved `/zookeeper`");
    }
    Ok(())
}

/// Characters ZooKeeper refuses in a node name (its `PathUtils`), beyond `/`.
fn forbidden_in_name(c: char) -> bool {
    matches!(c, '\0'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}')
}

/// The node name of a key: the key, with `%` and refused characters
/// percent-encoded. See the [module documentation](self#key-encoding).
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), tower_lock::KeyError> {
/// use tower_lock::backend::zookeeper::node_name;
/// use tower_lock::LockKey;
///
/// assert_eq!(node_name(&LockKey::new("order:42")?), "order:42");
/// assert_eq!(node_name(&LockKey::new("50%")?), "50%25");
/// # Ok(()) }
/// ```
pub fn node_name(key: &LockKey) -> std::borrow::Cow<'_, str> {
    let key = key.as_str();
    if !key.chars().any(|c| c == '%' || forbidden_in_name(c)) {
        return std::borrow::Cow::Borrowed(key);
    }
    let mut out = String::with_capacity(key.len() + 8);
    let mut utf8 = [0u8; 4];
    for c in key.chars() {
        if c == '%' || forbidden_in_name(c) {
            for b in c.encode_utf8(&mut utf8).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

impl ZookeeperBackend {
    /// Connects to `zk://host:port[,host:port...][/root]` with default
    /// [options](ZookeeperOptions).
    ///
    /// Opens the session at once, so a wrong address fails here.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_lock::backend::ZookeeperBackend;
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
            .unwrap_or_else(|| DEFAULT_ROOT.to_owned());
        check_root(&root)?;
        let backend = ZookeeperBackend {
            inner: Arc::new(ZkInner {
                hosts,
                root,
                session_timeout: options.session_timeout,
                connect_timeout: options.connect_timeout,
                current: Mutex::new(None),
                opening: tokio::sync::Mutex::new(()),
                releases: Arc::default(),
            }),
        };
        backend.inner.session().await?;
        Ok(backend)
    }

    /// The path of the node under which `key`'s lock nodes are created.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::backend::ZookeeperBackend;
    /// use tower_lock::LockKey;
    ///
    /// let zk = ZookeeperBackend::connect("zk://127.0.0.1:2181/locks").await?;
    /// assert_eq!(zk.root(), "/locks");
    /// // Where Curator's `InterProcessMutex` points to share the lock:
    /// assert_eq!(zk.lock_path(&LockKey::new("order:42")?), "/locks/order:42");
    /// # Ok(()) }
    /// ```
    pub fn lock_path(&self, key: &LockKey) -> String {
        self.inner.dir(key)
    }

    /// The root under which all lock paths live.
    pub fn root(&self) -> &str {
        &self.inner.root
    }

    /// The current session's id, if one is open (for diagnostics and tests).
    pub fn session_id(&self) -> Option<i64> {
        lock(&self.inner.current)
            .as_ref()
            .map(|s| s.client.session_id().0)
    }
}

impl fmt::Debug for ZookeeperBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZookeeperBackend")
            .field("hosts", &self.inner.hosts)
            .field("root", &self.inner.root)
            .finish_non_exhaustive()
    }
}

impl Backend for ZookeeperBackend {
    fn instance_id(&self) -> usize {
        // Clones share `inner`, and so their locks.
        Arc::as_ptr(&self.inner).cast::<()>() as usize
    }

    fn name(&self) -> &'static str {
        "zookeeper"
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        BackendFuture::new(self.inner.clone().acquire(request))
    }

    fn flush(&self) -> BackendFuture<()> {
        let inner = self.inner.clone();
        BackendFuture::new(async move { inner.releases.idle().await })
    }
}

impl ZkInner {
    fn dir(&self, key: &LockKey) -> String {
        format!("{}/{}", self.root, node_name(key))
    }

    /// The live session, opening a new one if there is none or it ended.
    async fn session(&self) -> Result<Arc<Session>, LockError> {
        if let Some(s) = lock(&self.current).as_ref().filter(|s| s.usable()) {
            return Ok(s.clone());
        }
        let _opening = self.opening.lock().await;
        if let Some(s) = lock(&self.current).as_ref().filter(|s| s.usable()) {
            return Ok(s.clone());
        }
        // The session cannot have been heard by the server before this.
        let connecting = std::time::Instant::now();
        let connect = zk::Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_fail_eagerly()
            .connect(&self.hosts);
        let client = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                return Err(zk_error(
                    &format!("connecting to ZooKeeper at {}", self.hosts),
                    e,
                ))
            }
            Err(_) => {
                return Err(LockError::backend(
                    "zookeeper",
                    format!(
                        "connecting to ZooKeeper at {} timed out after {} ms",
                        self.hosts,
                        self.connect_timeout.as_millis()
                    ),
                    None,
                ))
            }
        };
        let states = client.state_watcher();
        let known_alive = known_alive(client.session_timeout());
        let session = Arc::new(Session {
            alive_until: Deadline::new(connecting + known_alive),
            client,
            ended: AtomicBool::new(false),
            ended_notify: tokio::sync::Notify::new(),
            holds: Mutex::new(HashMap::new()),
            releases: self.releases.clone(),
        });
        tokio::spawn(watch_session(Arc::downgrade(&session), states));
        tokio::spawn(keep_alive(Arc::downgrade(&session), known_alive));
        *lock(&self.current) = Some(session.clone());
        Ok(session)
    }

    async fn acquire(self: Arc<Self>, request: LockRequest) -> Result<Acquired, LockError> {
        let session = self.session().await?;
        let dir = self.dir(&request.key);
        let role = match request.mode {
            LockMode::Exclusive => Role::Exclusive,
            LockMode::Read => Role::Read,
            LockMode::Write => Role::Write,
            LockMode::Semaphore { permits } => {
                let lease = session.semaphore(&dir, permits, request.wait).await?;
                return Ok(Self::held(&session, lease, false));
            }
        };
        let node = session.lock_node(&dir, role, request.wait).await?;
        Ok(Self::held(&session, node, role != Role::Read))
    }

    /// A granted node as an [`Acquired`], registered with its session;
    /// `writer` for exclusive and write locks.
    fn held(session: &Arc<Session>, node: Node, writer: bool) -> Acquired {
        let token = FencingToken::new(node.czxid as u64);
        let path = node.path.clone().unwrap_or_default();
        let hold = Arc::new(ZkHold {
            node: Mutex::new(Some(node)),
            lost: LostState::new(),
        });
        lock(&session.holds).insert(path, (Arc::downgrade(&hold), writer));
        // Ended meanwhile: `end` may have drained the map before the insert.
        if session.ended.load(Ordering::Acquire) {
            hold.lost.fire("the ZooKeeper session ended");
        }
        let lost = LostSignal::new(hold.clone());
        Acquired::new(token, hold).with_lost(lost)
    }
}

/// Follows a session's state; ends it (its locks are told) when it expires,
/// is closed or fails authentication. A disconnect alone ends nothing here:
/// [`keep_alive`] decides how long the session is known alive.
async fn watch_session(session: Weak<Session>, mut states: zk::StateWatcher) {
    let mut state = states.state();
    let reason = loop {
        match state {
            zk::SessionState::Expired => break "the ZooKeeper session expired",
            zk::SessionState::Closed => break "the ZooKeeper session was closed",
            zk::SessionState::AuthFailed => break "ZooKeeper authentication failed",
            // Dropping the last client closes the session, which ends here
            // as `Closed`.
            _ => state = states.changed().await,
        }
    };
    if let Some(s) = session.upgrade() {
        s.end_with_warning(reason.to_owned());
    }
}

/// How long after sending a request the server answered the session is
/// known alive: two thirds of the negotiated session timeout. The server
/// expires a session a timeout after the last request it received from it,
/// and it received an answered request after it was sent; the third left
/// over covers clock drift, telling the holders, and the holders stopping.
fn known_alive(session_timeout: Duration) -> Duration {
    session_timeout * 2 / 3
}

/// Keeps a session known alive, or ends it (its locks are told lost) before
/// the server can expire it and grant its locks to someone else.
///
/// Only answers count: a `sync` every sixth of the session timeout, whose
/// send time, once answered, moves [`Session::alive_until`] to that time
/// plus [`known_alive`]. Watch notifications and other traffic from the
/// server prove nothing about what the server has heard from this client
/// (under a one-way partition they keep coming while every request is
/// lost), so they never count; the client library's own disconnect
/// detection, which counts them, is not relied upon either. `sync` rather
/// than a read, so that on an ensemble the answer comes through the leader,
/// which is where sessions expire.
async fn keep_alive(session: Weak<Session>, known_alive: Duration) {
    let every = known_alive / 4;
    loop {
        let Some(s) = session
            .upgrade()
            .filter(|s| !s.ended.load(Ordering::Acquire))
        else {
            return;
        };
        let deadline = s.alive_until.get();
        // A clone of the client, not the session, is kept while waiting: an
        // unused session still closes when its last user drops it.
        let client = s.client.clone();
        drop(s);
        let sent = std::time::Instant::now();
        let answer = tokio::time::timeout_at(deadline.into(), client.sync("/")).await;
        drop(client);
        let Some(s) = session.upgrade() else { return };
        match answer {
            Ok(Ok(())) => {
                s.alive_until.extend(sent + known_alive);
                drop(s);
                tokio::time::sleep_until((sent + every).into()).await;
            }
            Err(_) => {
                let silent = sent.saturating_duration_since(deadline - known_alive) + known_alive;
                s.end_with_warning(format!(
                    "no answer from ZooKeeper to a request sent {} ms ago; the session may expire",
                    silent.as_millis().max(known_alive.as_millis())
                ));
                return;
            }
            // Disconnected, or the session ended (which `watch_session`
            // reports): try again shortly, until the deadline.
            Ok(Err(_)) => {
                drop(s);
                let retry = (sent + every / 8).min(deadline);
                tokio::time::sleep_until(retry.into()).await;
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Exclusive,
    Read,
    Write,
}

impl Role {
    /// The lock name in its nodes, as Curator writes it.
    fn node_name(self) -> &'static str {
        match self {
            Role::Exclusive => LOCK_NAME,
            Role::Read => READ_NAME,
            Role::Write => WRITE_NAME,
        }
    }
}

/// What a contender does after reading the children.
#[derive(Debug, PartialEq, Eq)]
enum Next<'a> {
    Granted,
    /// Watch this child, then look again.
    Watch(&'a str),
    /// Our node is not among the children.
    Gone,
}

/// The sequence number at the end of a lock node's name: its last ten (or,
/// past `i32::MAX`, nineteen) digits.
///
/// Only the digits count: a lock name such as `lock-` ends in a `-`, so a
/// sign cannot be told apart. (The server's counter would wrap to negative
/// after 2^31 nodes under one parent; a container parent is reaped long
/// before.)
fn sequence(name: &str) -> Option<i64> {
    let digits = name.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits < 10 {
        return None;
    }
    name[name.len() - digits..].parse().ok()
}

/// Whether a node is a shared (read) contender: ours or Curator's
/// `__READ__`, kazoo's `__rlock__`. Anything else is exclusive.
fn is_reader(name: &str) -> bool {
    name.contains(READ_NAME) || name.contains("__rlock__")
}

/// Decides from one listing. One pass, no sort: what matters is the nearest
/// blocking node before ours.
fn next_step<'a>(children: &'a [String], ours: &str, role: Role) -> Next<'a> {
    let Some(our_seq) = sequence(ours) else {
        return Next::Gone;
    };
    let mut found = false;
    let mut blocker: Option<(i64, &str)> = None;
    for child in children {
        if child == ours {
            found = true;
            continue;
        }
        let Some(seq) = sequence(child) else {
            continue;
        };
        if seq >= our_seq || (role == Role::Read && is_reader(child)) {
            continue;
        }
        if blocker.is_none_or(|(b, _)| seq > b) {
            blocker = Some((seq, child));
        }
    }
    match (found, blocker) {
        (false, _) => Next::Gone,
        (true, None) => Next::Granted,
        (true, Some((_, child))) => Next::Watch(child),
    }
}

/// Whether a request failed without a definite answer: the connection
/// broke (the client reports that as `ConnectionLoss`, or as a custom error
/// for a socket error or a silent server) and the request may or may not
/// have been applied. The session may well survive it.
fn uncertain(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::ConnectionLoss | zk::Error::Custom(_) | zk::Error::Timeout
    )
}

/// Runs a ZooKeeper call again after an [uncertain] failure, until it
/// succeeds, fails for certain, or the session ends (for an acquire, also
/// when this backend has given the session up).
async fn retry<T, F, Fut>(session: &Session, doing: &str, call: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, zk::Error>>,
{
    retry_while(session, Session::usable, call)
        .await
        .map_err(|e| zk_error(doing, e))
}

/// Whether a session still lives at all, even given up: its nodes live as
/// long as it does, so cleaning up goes on until then.
fn alive(session: &Session) -> bool {
    !session.client.state().is_terminated()
}

/// [`retry`], going on while `go_on(session)`, with the client's error.
async fn retry_while<T, F, Fut>(
    session: &Session,
    go_on: impl Fn(&Session) -> bool,
    mut call: F,
) -> Result<T, zk::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, zk::Error>>,
{
    let mut pause = Duration::from_millis(10);
    loop {
        match call().await {
            Err(e) if uncertain(&e) && go_on(session) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            result => return result,
        }
    }
}

const EPHEMERAL_SEQUENTIAL: zk::CreateOptions<'static> =
    zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
const CONTAINER: zk::CreateOptions<'static> =
    zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());

impl Session {
    /// Creates our node under `dir` and waits until `role` may hold it.
    async fn lock_node(
        self: &Arc<Self>,
        dir: &str,
        role: Role,
        wait: Wait,
    ) -> Result<Node, LockError> {
        // From here on, dropping `node` (cancellation, error) deletes
        // whatever this call created.
        let (node, mut children) = self.create_node(dir, role.node_name(), true).await?;
        loop {
            let ours = node.name();
            let watch = match next_step(&children, ours, role) {
                Next::Granted => return Ok(node),
                Next::Gone => {
                    return Err(LockError::backend(
                        "zookeeper",
                        format!("our lock node {dir}/{ours} was deleted while waiting"),
                        None,
                    ))
                }
                Next::Watch(_) if wait == Wait::FailFast => {
                    node.delete().await?;
                    return Err(LockError::Busy);
                }
                Next::Watch(child) => format!("{dir}/{child}"),
            };
            // A holder on this very session, of an exclusive or write lock,
            // was granted with nothing before it, and nothing can be queued
            // before it later; between it and us nothing blocks (we watch the
            // nearest blocker). Its deletion therefore hands the lock to us:
            // no need to list again, which saves a round trip per local
            // handoff.
            let handoff = lock(&self.holds)
                .get(&watch)
                .is_some_and(|(_, writer)| *writer);
            let watched = retry_while(self, Session::usable, || {
                self.client.get_and_watch_data(&watch)
            })
            .await;
            match watched {
                Ok((_, _, watcher)) => {
                    let event = self.changed(watcher).await?;
                    if handoff && event.event_type == zk::EventType::NodeDeleted {
                        return Ok(node);
                    }
                }
                // Gone already: look again.
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(zk_error("watching the lock node ahead", e)),
            }
            children = self.list(dir).await?;
        }
    }

    /// Curator's `InterProcessSemaphoreV2`: mutex, lease, wait, unlock.
    async fn semaphore(
        self: &Arc<Self>,
        dir: &str,
        permits: u32,
        wait: Wait,
    ) -> Result<Node, LockError> {
        let mutex = self
            .lock_node(&format!("{dir}/locks"), Role::Exclusive, wait)
            .await?;
        let leases = format!("{dir}/leases");
        let (lease, _) = self.create_node(&leases, LEASE_NAME, false).await?;
        loop {
            let (children, watcher) = retry(self, "listing the semaphore's leases", || {
                self.client.list_and_watch_children(&leases)
            })
            .await?;
            let held = children.iter().filter(|c| sequence(c).is_some()).count();
            if held <= permits as usize {
                break;
            }
            if wait == Wait::FailFast {
                lease.delete().await?;
                mutex.delete().await?;
                return Err(LockError::Busy);
            }
            self.changed(watcher).await?;
        }
        mutex.delete().await?;
        Ok(lease)
    }

    /// Creates one protected ephemeral sequential node under `dir`, making
    /// parents. With `list`, also lists `dir`, sent back to back with the
    /// create: the server answers a session's requests in order, so the
    /// listing already holds the new node.
    async fn create_node(
        self: &Arc<Self>,
        dir: &str,
        name: &str,
        list: bool,
    ) -> Result<(Node, Vec<String>), LockError> {
        let protected = format!("{PROTECTED}{}-", uuid::Uuid::new_v4());
        let prefix = format!("{dir}/{protected}{name}");
        let mut node = Node::new(self.clone(), dir.to_owned(), protected);
        loop {
            let create = self.client.create(&prefix, &[], &EPHEMERAL_SEQUENTIAL);
            let listing = list.then(|| self.client.list_children(dir));
            match create.await {
                Ok((stat, seq)) => {
                    node.path = Some(format!("{prefix}{seq}"));
                    node.czxid = stat.czxid;
                    let children = match listing {
                        Some(listing) => match listing.await {
                            Ok(children) => children,
                            Err(_) => self.list(dir).await?,
                        },
                        None => Vec::new(),
                    };
                    return Ok((node, children));
                }
                Err(zk::Error::NoNode) => {
                    drop(listing);
                    self.make_dir(dir).await?;
                }
                Err(e) if uncertain(&e) && self.usable() => {
                    drop(listing);
                    // Protected mode: the create may have happened.
                    if node.find_own().await? {
                        let children = if list {
                            self.list(dir).await?
                        } else {
                            Vec::new()
                        };
                        return Ok((node, children));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(zk_error("creating a lock node", e)),
            }
        }
    }

    async fn list(&self, dir: &str) -> Result<Vec<String>, LockError> {
        retry(self, "listing lock nodes", || {
            self.client.list_children(dir)
        })
        .await
    }

    /// Creates `dir` and its missing parents as container nodes.
    async fn make_dir(&self, dir: &str) -> Result<(), LockError> {
        retry(self, "creating the lock's parent nodes", || {
            self.client.mkdir(dir, &CONTAINER)
        })
        .await
    }

    /// Waits for a watch to fire, or fails if the session ends first.
    /// Dropping the watcher (cancellation) removes the watch.
    async fn changed(
        self: &Arc<Self>,
        watcher: zk::OneshotWatcher,
    ) -> Result<zk::WatchedEvent, LockError> {
        let ended = self.ended_notify.notified();
        tokio::pin!(ended);
        // Registered before the check, so an end in between is not missed.
        ended.as_mut().enable();
        if !self.ended.load(Ordering::Acquire) {
            tokio::select! {
                event = watcher.changed() => return Ok(event),
                _ = ended => {}
            }
        }
        Err(LockError::backend(
            "zookeeper",
            "the ZooKeeper session ended while waiting",
            None,
        ))
    }
}

/// A lock node this process created (or is creating). Dropped without
/// [`delete`](Node::delete), it deletes itself in the background, retrying
/// until the server confirms or the session is gone.
struct Node {
    session: Arc<Session>,
    dir: String,
    /// `_c_<uuid>-`: finds the node when the create's answer was lost.
    protected: String,
    /// Known once the create answered.
    path: Option<String>,
    czxid: i64,
    /// Deleted (or found never created): nothing left to clean up.
    done: bool,
}

impl Node {
    fn new(session: Arc<Session>, dir: String, protected: String) -> Node {
        Node {
            session,
            dir,
            protected,
            path: None,
            czxid: 0,
            done: false,
        }
    }

    fn name(&self) -> &str {
        let path = self.path.as_deref().unwrap_or_default();
        &path[path.rfind('/').map_or(0, |i| i + 1)..]
    }

    /// Looks for our node after a lost create answer; fills in its path and
    /// zxid if the create happened.
    async fn find_own(&mut self) -> Result<bool, LockError> {
        let listed = retry_while(&self.session, alive, || {
            self.session.client.list_children(&self.dir)
        })
        .await;
        let children = match listed {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(false),
            Err(e) => return Err(zk_error("listing lock nodes", e)),
        };
        let Some(child) = children.iter().find(|c| c.starts_with(&self.protected)) else {
            return Ok(false);
        };
        let path = format!("{}/{child}", self.dir);
        let stat = retry_while(&self.session, alive, || {
            self.session.client.check_stat(&path)
        })
        .await
        .map_err(|e| zk_error("reading our lock node", e))?;
        match stat {
            Some(stat) => {
                self.czxid = stat.czxid;
                self.path = Some(path);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Deletes the node now. Cancelled, the drop finishes the job.
    async fn delete(mut self) -> Result<(), LockError> {
        if let Some(path) = &self.path {
            delete_until_done(&self.session, path).await?;
        }
        self.done = true;
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let session = self.session.clone();
        let path = self.path.take();
        let dir = std::mem::take(&mut self.dir);
        let protected = std::mem::take(&mut self.protected);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "zookeeper lock node dropped outside a Tokio runtime; it goes with the session"
            );
            return;
        };
        session.releases.clone().spawn(&rt, async move {
            let path = match path {
                Some(path) => path,
                // A create may be in flight or done: find it by its prefix.
                None => {
                    let mut node = Node::new(session.clone(), dir, protected);
                    let found = node.find_own().await;
                    node.done = true;
                    match (found, node.path.take()) {
                        (Ok(true), Some(path)) => path,
                        _ => return,
                    }
                }
            };
            if let Err(e) = delete_until_done(&session, &path).await {
                tracing::warn!(path, error = %e, "deleting a zookeeper lock node failed");
            }
        });
    }
}

/// Deletes `path`, retrying through connection loss. Done when the node is
/// gone, or the session (and with it the ephemeral node) is.
async fn delete_until_done(session: &Session, path: &str) -> Result<(), LockError> {
    let deleted = retry_while(session, alive, || session.client.delete(path, None)).await;
    deleted_or_gone(deleted)
}

/// A delete's outcome: the node or its session is gone, or a real error.
fn deleted_or_gone(result: Result<(), zk::Error>) -> Result<(), LockError> {
    match result {
        Ok(())
        | Err(
            zk::Error::NoNode
            | zk::Error::SessionExpired
            | zk::Error::ClientClosed
            | zk::Error::AuthFailed,
        ) => Ok(()),
        // After retrying, an uncertain failure means the session ended:
        // the ephemeral node went with it.
        Err(e) if uncertain(&e) => Ok(()),
        Err(e) => Err(zk_error("deleting the lock node", e)),
    }
}

/// One held ZooKeeper lock: its node.
struct ZkHold {
    node: Mutex<Option<Node>>,
    lost: LostState,
}

impl HasLostState for ZkHold {
    fn lost_state(&self) -> &LostState {
        &self.lost
    }

    fn expired(&self) -> Option<String> {
        let node = lock(&self.node);
        let session = &node.as_ref()?.session;
        session.alive_until.passed().then(|| {
            "the ZooKeeper session is no longer known alive (no answer in time)".to_owned()
        })
    }
}

/// The answer to a delete on the wire.
type DeleteAnswer = std::pin::Pin<Box<dyn Future<Output = Result<(), zk::Error>> + Send>>;

impl ZkHold {
    /// Takes the node out of the hold and sends its delete, which the server
    /// applies before anything this session sends later; `None` when there
    /// is nothing to send. Without a Tokio runtime, the node is returned to
    /// be deleted in place.
    fn send_delete(&self) -> Option<Result<(SentDelete, DeleteAnswer), Node>> {
        let mut node = lock(&self.node).take()?;
        if let Some(path) = &node.path {
            lock(&node.session.holds).remove(path);
        }
        let (Some(path), Ok(rt)) = (node.path.clone(), tokio::runtime::Handle::try_current())
        else {
            return Some(Err(node));
        };
        let answer = Box::pin(node.session.client.delete(&path, None));
        node.done = true;
        let session = node.session.clone();
        Some(Ok((SentDelete { session, path, rt }, answer)))
    }
}

/// A lock node whose delete is on the wire.
struct SentDelete {
    session: Arc<Session>,
    path: String,
    rt: tokio::runtime::Handle,
}

impl SentDelete {
    /// Awaits `answer` (if any) in the background, deleting again after an
    /// uncertain failure until done or the session ends; counted for
    /// [`Backend::flush`].
    fn finish_in_background(self, answer: Option<DeleteAnswer>) {
        let SentDelete { session, path, rt } = self;
        session.releases.clone().spawn(&rt, async move {
            let result = match answer {
                Some(answer) => match answer.await {
                    Err(e) if uncertain(&e) => delete_until_done(&session, &path).await,
                    other => deleted_or_gone(other),
                },
                None => delete_until_done(&session, &path).await,
            };
            if let Err(e) = result {
                tracing::warn!(path, error = %e, "releasing a zookeeper lock failed");
            }
        });
    }
}

/// An awaited delete whose answer has not come yet.
struct Unanswered(Option<(SentDelete, DeleteAnswer)>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some((sent, answer)) = self.0.take() {
            sent.finish_in_background(Some(answer));
        }
    }
}

impl LeaseHandle for ZkHold {
    /// Waits for the answer: see the [module documentation](self#release).
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        match self.send_delete() {
            None => BackendFuture::ready(Ok(())),
            Some(Err(node)) => BackendFuture::new(node.delete()),
            Some(Ok(pending)) => BackendFuture::new(async move {
                // Dropped before the answer (the caller gave up waiting): the
                // delete is finished in the background.
                let mut pending = Unanswered(Some(pending));
                let (_, answer) = pending.0.as_mut().expect("set above");
                let result = answer.await;
                let (sent, _) = pending.0.take().expect("set above");
                match result {
                    Err(e) if uncertain(&e) => {
                        // It may not have run: go on trying in the background.
                        sent.finish_in_background(None);
                        Err(zk_error("deleting the lock node", e))
                    }
                    other => deleted_or_gone(other),
                }
            }),
        }
    }

    fn release_on_drop(self: Arc<Self>) {
        match self.send_delete() {
            None => {}
            // Outside a runtime: the node's drop says it goes with the session.
            Some(Err(node)) => drop(node),
            Some(Ok((sent, answer))) => sent.finish_in_background(Some(answer)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn sequences_parse_from_every_client() {
        assert_eq!(sequence("_c_1b-lock-0000000042"), Some(42));
        assert_eq!(sequence("_c_1b-__READ__0000000007"), Some(7));
        assert_eq!(sequence("5f3a__lock__0000000003"), Some(3));
        assert_eq!(sequence("locks"), None);
        assert_eq!(sequence("lock-12"), None);
        assert_eq!(sequence("_c_1b-lock-2147483648000"), Some(2147483648000));
    }

    #[test]
    fn exclusive_waits_for_its_immediate_predecessor() {
        let c = names(&[
            "_c_a-lock-0000000003",
            "_c_b-lock-0000000001",
            "_c_c-lock-0000000002",
        ]);
        assert_eq!(
            next_step(&c, "_c_b-lock-0000000001", Role::Exclusive),
            Next::Granted
        );
        assert_eq!(
            next_step(&c, "_c_a-lock-0000000003", Role::Exclusive),
            Next::Watch("_c_c-lock-0000000002")
        );
        assert_eq!(
            next_step(&c, "_c_z-lock-0000000009", Role::Exclusive),
            Next::Gone
        );
    }

    #[test]
    fn readers_share_and_wait_only_for_the_nearest_writer() {
        let c = names(&[
            "_c_a-__READ__0000000001",
            "_c_b-__WRIT__0000000002",
            "_c_c-__READ__0000000003",
            "k__rlock__0000000004",
            "_c_d-__READ__0000000005",
            "_c_e-__WRIT__0000000006",
        ]);
        assert_eq!(
            next_step(&c, "_c_a-__READ__0000000001", Role::Read),
            Next::Granted
        );
        assert_eq!(
            next_step(&c, "_c_d-__READ__0000000005", Role::Read),
            Next::Watch("_c_b-__WRIT__0000000002")
        );
        assert_eq!(
            next_step(&c, "_c_b-__WRIT__0000000002", Role::Write),
            Next::Watch("_c_a-__READ__0000000001")
        );
        assert_eq!(
            next_step(&c, "_c_e-__WRIT__0000000006", Role::Write),
            Next::Watch("_c_d-__READ__0000000005")
        );
    }

    #[test]
    fn node_names_encode_only_what_zookeeper_refuses() {
        let plain = LockKey::new("order:42 ä.x").unwrap();
        assert_eq!(node_name(&plain), "order:42 ä.x");
        let odd = LockKey::new("50%\u{e000}\u{fff0}").unwrap();
        assert_eq!(node_name(&odd), "50%25%EE%80%80%EF%BF%B0");
        // One-to-one: the literal text of an encoding stays distinct.
        let literal = LockKey::new("50%25").unwrap();
        assert_eq!(node_name(&literal), "50%2525");
    }

    #[test]
    fn urls_and_roots_are_checked() {
        assert_eq!(
            parse_url("zk://a:1,b:2/locks").unwrap(),
            ("a:1,b:2".to_owned(), Some("/locks".to_owned()))
        );
        assert_eq!(parse_url("zk://a:1/").unwrap(), ("a:1".to_owned(), None));
        assert!(parse_url("zk://a/x").is_err());
        assert!(parse_url("redis://a:1").is_err());
        assert!(check_root("/tower-lock").is_ok());
        assert!(check_root("/a/b").is_ok());
        for bad in [
            "/",
            "a",
            "/a/",
            "/a//b",
            "/a/../b",
            "/zookeeper/x",
            "/a\u{1}",
        ] {
            assert!(check_root(bad).is_err(), "{bad:?}");
        }
    }
}
