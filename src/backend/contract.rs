//! The [`Backend`] trait and the lock it grants (the request is in
//! `request.rs`). The contract is in the [module
//! documentation](super).

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use super::{BackendFuture, BreakScope, Broken, Capabilities, Inspection, LockRequest};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::LostSignal;
use crate::token::FencingToken;
#[cfg(doc)]
use crate::{backend::Cohort, MemoryBackend};

/// A lock store.
///
/// See the [module documentation](super) for the contract. Users do not call
/// these methods directly: they use [`BackendExt::lock`](crate::BackendExt::lock),
/// a [`Locker`](crate::Locker) or the [`LockLayer`](crate::LockLayer).
///
/// # Examples
///
/// A toy backend: exclusive locks on Tokio mutexes, one per key. The mutex
/// queues waiters in order and leaves its queue when a waiting future is
/// dropped, and every grant takes the next number of one counter, so the
/// contract holds; a real backend would also forget idle keys, as
/// [`MemoryBackend`] does.
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::{Arc, Mutex};
///
/// use tokio::sync::OwnedMutexGuard;
/// use tower_lock::backend::{Acquired, BackendFuture, LeaseHandle, LockRequest};
/// use tower_lock::{Backend, BackendExt, FencingToken, LockError, LockMode, Wait};
///
/// #[derive(Default)]
/// struct MutexBackend {
///     keys: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
///     tokens: Arc<AtomicU64>,
/// }
///
/// /// A granted lock: releasing it unlocks the mutex.
/// struct Held(Mutex<Option<OwnedMutexGuard<()>>>);
///
/// impl LeaseHandle for Held {
///     fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
///         self.0.lock().unwrap().take();
///         BackendFuture::ready(Ok(()))
///     }
/// }
///
/// fn grant(tokens: &AtomicU64, guard: OwnedMutexGuard<()>) -> Acquired {
///     let token = FencingToken::new(tokens.fetch_add(1, Ordering::Relaxed) + 1);
///     Acquired::new(token, Arc::new(Held(Mutex::new(Some(guard)))))
/// }
///
/// impl Backend for MutexBackend {
///     fn name(&self) -> &'static str {
///         "mutex"
///     }
///
///     fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
///         if request.mode != LockMode::Exclusive {
///             let why = format!("the mutex backend has no {} locks", request.mode);
///             return BackendFuture::ready(Err(LockError::InvalidMode(why)));
///         }
///         let key = request.key.as_str().to_owned();
///         let mutex = self.keys.lock().unwrap().entry(key).or_default().clone();
///         if request.wait == Wait::FailFast {
///             // Decided at once: no future to box.
///             let result = match mutex.try_lock_owned() {
///                 Ok(guard) => Ok(grant(&self.tokens, guard)),
///                 Err(_) => Err(LockError::Busy),
///             };
///             return BackendFuture::ready(result);
///         }
///         // The core enforces the wait by dropping this future.
///         let tokens = self.tokens.clone();
///         BackendFuture::new(async move { Ok(grant(&tokens, mutex.lock_owned().await)) })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), LockError> {
/// let backend = MutexBackend::default();
/// let first = backend.lock("order-1").await?;
/// assert!(matches!(backend.lock("order-1").fail_fast().await, Err(LockError::Busy)));
/// let earlier = first.token();
/// drop(first);
/// assert!(backend.lock("order-1").await?.token() > earlier);
/// # Ok(()) }
/// ```
pub trait Backend: Send + Sync + 'static {
    /// A short name for traces and errors: `memory`, `redis`, `zookeeper`.
    fn name(&self) -> &'static str;

    /// Acquires `request.key` in `request.mode`.
    ///
    /// # Cancel safety
    ///
    /// The core drops this future when the wait runs out or the request goes
    /// away, and the contract asks a backend to undo what it started: a
    /// queued waiter leaves the queue at once, and a lock granted as the
    /// future was dropped is released. The memory backend does it in the
    /// drop. The Redis and ZooKeeper backends start the undo (the release of
    /// an acquire script that may have granted, the delete of a node that
    /// may have been created) from the drop and finish it in a background
    /// task, which [`flush`](Self::flush) waits for; dropped outside a Tokio
    /// runtime, that undo cannot run, and the lock ends with its lease or
    /// session. The Redlock backend undoes a failed round, but not a round
    /// still in flight when its future is dropped: see its
    /// [module documentation][redlock-cancel].
    #[cfg_attr(
        feature = "redis",
        doc = "",
        doc = "[redlock-cancel]: crate::backend::redis::redlock#cancel-safety"
    )]
    #[cfg_attr(
        not(feature = "redis"),
        doc = "",
        doc = "[redlock-cancel]: https://docs.rs/tower-lock/latest/tower_lock/backend/redis/redlock/index.html#cancel-safety"
    )]
    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>>;

    /// Completes once no release this backend sent is waiting for its answer
    /// (each ends answered, or given up when its lease or session ended).
    /// Under steady traffic there may be no such moment: call it once the
    /// process has stopped taking locks.
    ///
    /// When a guard is dropped (as the layer does once a response is ready),
    /// remote backends send its release and await the answer in the
    /// background; so they do when a release must be sent again after a
    /// broken connection. Call this before a process exits, after a graceful
    /// shutdown: a release still in flight when the Tokio runtime stops is
    /// lost, and its lock then stays taken until its lease (Redis) or session
    /// (ZooKeeper) ends. The default, for backends that release at once,
    /// completes at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the future only waits. The releases it waits for run in
    /// tasks of their own on the Tokio runtime, so dropping it (a shutdown
    /// deadline that ran out, as below) stops the waiting and nothing else:
    /// they go on while the runtime runs, and a later `flush` waits for those
    /// still in flight. What is lost is what `flush` guards against: the
    /// releases still unanswered when the runtime stops. The Redis backend
    /// also releases, when `flush` is called and whether or not the future is
    /// then awaited, the locks it kept for local waiters that have not taken
    /// them yet (those waiters then acquire anew).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
    /// use std::time::Duration;
    /// use tower_lock::{Backend, BackendExt, MemoryBackend};
    ///
    /// let backend = MemoryBackend::new();
    /// backend.lock("sku-1").await?.release().await?;
    ///
    /// // After a graceful shutdown, give releases in flight five seconds.
    /// if tokio::time::timeout(Duration::from_secs(5), backend.flush()).await.is_err() {
    ///     eprintln!("some locks stay taken until their lease ends");
    /// }
    /// # Ok(()) }
    /// ```
    fn flush(&self) -> BackendFuture<()> {
        BackendFuture::ready(())
    }

    /// Identifies the locks this backend holds in this process: handles that
    /// share their state (clones) return the same value. A request that
    /// locks a key it already holds through the same backend
    /// [re-enters](crate::Locker#re-entrancy) that lock instead of waiting
    /// for itself.
    ///
    /// The default is the backend's address, right for a backend that is
    /// not a handle on shared state; a cloneable handle returns the address
    /// of what its clones share.
    fn instance_id(&self) -> usize {
        (self as *const Self).cast::<()>() as usize
    }

    /// What this backend can do: its modes, and what [`Cohort`] may rely
    /// on. The default is every mode, one token per grant, releases not
    /// ordered, waiters not served in order across processes.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
    }

    /// Who holds `key` and who waits for it, in any process, as the store
    /// can tell ([`Inspection`]); for operators, not for deciding whether
    /// to lock (the answer is stale as soon as it arrives). The default,
    /// for backends that keep nothing to show, is
    /// [`LockError::Unsupported`]. A PostgreSQL advisory semaphore shows as
    /// free: its permits are locks on other hashes. Where the token is
    /// "the server's grant", a lock this process's cohort passed on is
    /// held under a later token. What each store fills in:
    ///
    /// | backend | token | mode | lease left | identity | waiters |
    /// |---|---|---|---|---|---|
    /// | memory | yes | yes | no lease | no | yes |
    /// | Redis (one server, Sentinel, Cluster) | no: the key keeps its owner, the fence only the last token handed out | yes (a semaphore's permits: none) | yes | the owner's random token (the key holds only that; a label would travel in every renewal) | no: waiters of other modes, of a Cluster, and those not yet queued are in no list |
    /// | PostgreSQL, advisory locks | no: the server keeps none | exclusive or read | no lease: the session's | server process, client address, application name: the label, process id and host ([`PostgresOptions::label`](crate::backend::postgres::PostgresOptions::label)) unless the URL names it (`pg_locks`, `pg_stat_activity`) | yes, sessions waiting in the server |
    /// | PostgreSQL, lease table | no | exclusive | yes | the row's owner | no |
    /// | MariaDB | no | exclusive | no lease: the connection's | connection id, and its user and host where the process list shows them (`IS_USED_LOCK`) | no: the process list does not say which lock a connection waits for |
    /// | Redlock | no | yes | the least among the instances that have it | the owner, on how many instances; only holders a majority has | no |
    /// | ZooKeeper | the server's grant (the node's creation zxid) | yes (a semaphore's leases: no mode) | no lease: the session's | the session id, and the node's data: the label, process id and host ([`ZookeeperOptions::label`](crate::backend::zookeeper::ZookeeperOptions::label)); another client's (Curator's address, kazoo's identifier) | yes, the contenders behind (a semaphore's: those queued for its mutex) |
    /// | etcd | the server's grant (the key's create revision) | exclusive or read | the lease's time to live | the lease id, and the label, process id and host in the key's value ([`EtcdOptions::label`](crate::backend::etcd::EtcdOptions::label)) | yes, the keys behind |
    fn inspect(&self, key: LockKey) -> BackendFuture<Result<Inspection, LockError>> {
        let _ = key;
        BackendFuture::ready(Err(LockError::Unsupported(format!(
            "the {} backend cannot inspect its locks",
            self.name()
        ))))
    }

    /// The keys starting with `prefix` that some process holds, in order;
    /// for operators, as [`inspect`](Self::inspect). Where the store
    /// cannot list them, [`LockError::Unsupported`] says why:
    ///
    /// | backend | lists |
    /// |---|---|
    /// | memory, Redis (one server, Sentinel), Redlock (keys on a majority), ZooKeeper, etcd, PostgreSQL's lease table | held keys |
    /// | Redis Cluster | held keys, each master scanned in turn (`CLUSTER SLOTS`); a slot moving meanwhile may show its keys twice (listed once) or not at all |
    /// | PostgreSQL, advisory locks | no: the server keeps only a hash of each key (`pg_locks`); inspect a key by name |
    /// | MariaDB | held keys of up to 64 characters, with the `metadata_lock_info` plugin installed (`INSTALL SONAME 'metadata_lock_info'`); without it, no |
    fn list(&self, prefix: &str) -> BackendFuture<Result<Vec<LockKey>, LockError>> {
        let _ = prefix;
        BackendFuture::ready(Err(LockError::Unsupported(format!(
            "the {} backend cannot list its locks",
            self.name()
        ))))
    }

    /// Frees `key` whoever holds it, for an operator whose holder is stuck
    /// (a process hung with its session alive): first raises the key's
    /// fencing floor above every token handed out for it, then frees every
    /// holder, and returns the floor ([`Broken`]). The broken holders are
    /// not told at once; where the store lets them see it (a renewal that
    /// finds its lease gone, a session ended), their lost signal fires.
    ///
    /// Breaking does not stop a broken holder that still runs: a fenced
    /// store does, once it has seen the floor or a later holder's token.
    /// On the SQL stores a grant in flight at the break (its statement
    /// holding the lock, or writing its row, but not yet past drawing its
    /// token, microseconds) may end up on the wrong side of the floor; a
    /// sequence the application names must be named to the backend that
    /// breaks (`?sequence=` in the URL), and one never drawn from is
    /// refused. The default is [`LockError::Unsupported`]. What each store
    /// does:
    ///
    /// | backend | frees | floor |
    /// |---|---|---|
    /// | Redis (one server, Sentinel, Cluster) | the key's lock keys, in the script that raises the fence; waiters are woken | the fencing counter, raised past every token reserved |
    /// | Redlock | the same, on every instance that answers; a majority must answer | the highest of their counters: above earlier tokens as far as Redlock's tokens rise at all (see its module docs) |
    /// | ZooKeeper | the holders' nodes (not a semaphore's: a waiter's pending lease looks like a holder's) | the first token past the newest holder's node: a waiter's token is fixed when its node is made, and stays valid |
    /// | etcd | the holders' keys, in one transaction | the first token past the newest holder's key, for the same reason |
    /// | PostgreSQL, lease table | the key's row | the token sequence, drawn after the row is read |
    /// | PostgreSQL, advisory locks | only with [`BreakScope::Sessions`]: the holders' server processes (`pg_terminate_backend`, PostgreSQL 14+); a semaphore's permits are locks on other hashes, not found | the token sequence, drawn after the holders are read |
    /// | MariaDB | only with [`BreakScope::Sessions`]: the holder's connection (`KILL CONNECTION`) | the token sequence, drawn after the holder is read |
    /// | memory | not supported: drop the guard | |
    fn break_lock(
        &self,
        key: LockKey,
        scope: BreakScope,
    ) -> BackendFuture<Result<Broken, LockError>> {
        let _ = (key, scope);
        BackendFuture::ready(Err(LockError::Unsupported(format!(
            "the {} backend cannot break its locks",
            self.name()
        ))))
    }
}

impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    fn instance_id(&self) -> usize {
        (**self).instance_id()
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        (**self).acquire(request)
    }
    fn list(&self, prefix: &str) -> BackendFuture<Result<Vec<LockKey>, LockError>> {
        (**self).list(prefix)
    }
    fn inspect(&self, key: LockKey) -> BackendFuture<Result<Inspection, LockError>> {
        (**self).inspect(key)
    }
    fn break_lock(
        &self,
        key: LockKey,
        scope: BreakScope,
    ) -> BackendFuture<Result<Broken, LockError>> {
        (**self).break_lock(key, scope)
    }
    fn flush(&self) -> BackendFuture<()> {
        (**self).flush()
    }
}

impl<B: Backend + ?Sized> Backend for Box<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    fn instance_id(&self) -> usize {
        (**self).instance_id()
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        (**self).acquire(request)
    }
    fn list(&self, prefix: &str) -> BackendFuture<Result<Vec<LockKey>, LockError>> {
        (**self).list(prefix)
    }
    fn inspect(&self, key: LockKey) -> BackendFuture<Result<Inspection, LockError>> {
        (**self).inspect(key)
    }
    fn break_lock(
        &self,
        key: LockKey,
        scope: BreakScope,
    ) -> BackendFuture<Result<Broken, LockError>> {
        (**self).break_lock(key, scope)
    }
    fn flush(&self) -> BackendFuture<()> {
        (**self).flush()
    }
}

/// What a backend hands back for a granted lock.
///
/// Dropping it without turning it into a guard releases the lock.
///
/// # Examples
///
/// A backend builds one from its fencing token, its [`LeaseHandle`] and, if
/// the lock can be lost, the signal of a [`LostTrigger`](crate::backend::LostTrigger)
/// it keeps:
///
/// ```
/// use std::sync::Arc;
/// use tower_lock::backend::{Acquired, BackendFuture, LeaseHandle};
/// use tower_lock::{FencingToken, LockError};
/// use tower_lock::backend::LostTrigger;
///
/// struct Hold;
/// impl LeaseHandle for Hold {
///     fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
///         BackendFuture::ready(Ok(()))
///     }
/// }
///
/// let trigger = LostTrigger::new();
/// let acquired = Acquired::new(FencingToken::new(42), Arc::new(Hold)).with_lost(trigger.signal());
/// assert_eq!(acquired.token().get(), 42);
/// assert!(!acquired.lost().is_lost());
/// trigger.fire("lease expired"); // from the backend's renewal task
/// assert_eq!(acquired.lost().reason(), Some("lease expired"));
/// ```
#[must_use = "dropping an Acquired releases the lock"]
pub struct Acquired {
    token: FencingToken,
    lost: LostSignal,
    handle: ReleasedOnDrop,
    tokens: u32,
}

/// The grant's lease handle, released when dropped unless taken: the drop
/// lives here, not on [`Acquired`], so that the guard's parts move out of
/// an `Acquired` without a `take` each and a drop of what is left.
struct ReleasedOnDrop(Option<Arc<dyn LeaseHandle>>);

impl Drop for ReleasedOnDrop {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            handle.release_on_drop();
        }
    }
}

impl Acquired {
    /// A grant with fencing token `token`, released through `handle`.
    ///
    /// The handle is an `Arc` so that a backend can keep one allocation per
    /// lock for its own state, the handle and the [`LostState`](crate::backend::LostState)
    /// its [`LostSignal`] points into.
    pub fn new(token: FencingToken, handle: Arc<dyn LeaseHandle>) -> Self {
        Acquired {
            token,
            lost: LostSignal::never(),
            handle: ReleasedOnDrop(Some(handle)),
            tokens: 1,
        }
    }

    /// Attaches the signal the backend fires if it loses the lock.
    pub fn with_lost(mut self, lost: LostSignal) -> Self {
        self.lost = lost;
        self
    }

    /// The fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The lost signal.
    pub fn lost(&self) -> &LostSignal {
        &self.lost
    }

    /// Says that the grant reserved `tokens` consecutive fencing tokens,
    /// [`token`](Self::token) the first (for a [`LockRequest::tokens`] above
    /// 1).
    pub fn with_tokens(mut self, tokens: u32) -> Self {
        self.tokens = tokens.max(1);
        self
    }

    /// How many consecutive fencing tokens the grant reserved, from
    /// [`token`](Self::token) on.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// Until when the lock is surely still held, if the backend knows
    /// ([`LeaseHandle::valid_until`]).
    pub fn valid_until(&self) -> Option<Instant> {
        self.handle.0.as_ref()?.valid_until()
    }

    pub(crate) fn into_parts(self) -> (FencingToken, LostSignal, Arc<dyn LeaseHandle>) {
        let Acquired {
            token,
            lost,
            mut handle,
            ..
        } = self;
        let handle = handle.0.take().expect("handle present until taken");
        (token, lost, handle)
    }
}

impl fmt::Debug for Acquired {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquired")
            .field("token", &self.token)
            .field("lost", &self.lost)
            .finish_non_exhaustive()
    }
}

/// A backend's hold on one granted lock.
///
/// The core calls [`release`](Self::release) when a guard is released and
/// [`release_on_drop`](Self::release_on_drop) when it is dropped, one of
/// them once.
///
/// # Examples
///
/// A handle whose release is asynchronous, as a remote backend's is:
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tokio::sync::oneshot;
/// use tower_lock::backend::{Acquired, BackendFuture, LeaseHandle};
/// use tower_lock::{FencingToken, LockError};
///
/// /// Stands in for a lock on a server: releasing it sends a message.
/// struct RemoteHold(Mutex<Option<oneshot::Sender<&'static str>>>);
///
/// impl LeaseHandle for RemoteHold {
///     fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
///         BackendFuture::new(async move {
///             // The round trip to the server goes here.
///             if let Some(server) = self.0.lock().unwrap().take() {
///                 let _ = server.send("released");
///             }
///             Ok(())
///         })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let (tx, server) = oneshot::channel();
/// let acquired = Acquired::new(FencingToken::new(1), Arc::new(RemoteHold(Mutex::new(Some(tx)))));
/// drop(acquired); // the default `release_on_drop` spawns the release
/// assert_eq!(server.await.unwrap(), "released");
/// # }
/// ```
pub trait LeaseHandle: Send + Sync + 'static {
    /// Releases the lock (and stops any renewal). Called at most once.
    ///
    /// # Cancel safety
    ///
    /// The caller may drop the future before it completes, having given up
    /// waiting for the answer; the lock must be released all the same, and
    /// only once. Start the release in this method, before the future is
    /// polled, or hand the same future to the background from its drop, as
    /// the remote backends do: never send a second release after one was
    /// sent, which could free a lock taken since (by name, on the same
    /// session) by someone else.
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>>;

    /// Until when the lock surely stays held if nothing more is heard from
    /// the server: the send time of the last acquire or renewal the server
    /// answered, plus the lease, less clock drift (for ZooKeeper, the
    /// session's). `None` for a lock that cannot expire (the memory backend).
    /// [`Cohort`] hands a lock to the next local holder only while this is
    /// comfortably ahead.
    fn valid_until(&self) -> Option<Instant> {
        None
    }

    /// Once [`release`](Self::release) has been answered: `None`, unless
    /// the server said waiters elsewhere (in other processes) heard of the
    /// release and will ask for the lock now; then possibly (the store
    /// decides: the lease table, only for a holder that
    /// [`may_hand_off`](Self::may_hand_off) was asked for and that
    /// answered `true`, a contended lock) a wait that
    /// ends once they have had their turn: when the lock has been released
    /// again (the next release is heard), or when they have had time to
    /// take it, or after a short grace if nobody took it.
    ///
    /// A server without a queue of waiters (Redis, a lease table) grants
    /// the first to ask, and this process's next waiter, asking the moment
    /// the answer comes, would win that race nearly every time: [`Cohort`]
    /// holds it back for this wait, so that processes take turns. Default
    /// `None`.
    fn hand_off(&self) -> Option<BackendFuture<()>> {
        None
    }

    /// Whether [`hand_off`](Self::hand_off) may ask for a wait after the
    /// release of a lock that no waiter in this process was queued for.
    /// Asked once, by [`Cohort`] on a server without a queue, as such a
    /// lock is let go, before the release is sent (a store may prepare
    /// for the hand-off then); if `true`, the cohort keeps this process's
    /// next acquisition of the key (one worker that locks it again at
    /// once, a request that comes meanwhile) until the release is answered
    /// and `hand_off`'s wait is over. Default `false`: only a waiter
    /// already queued when the lock was let go waits for the hand-off.
    fn may_hand_off(&self) -> bool {
        false
    }

    /// Releases the lock from a destructor, where nothing can be awaited.
    ///
    /// The default runs [`release`](Self::release) and, if it did not finish at
    /// once, spawns it on the current Tokio runtime. Outside a runtime the
    /// release is abandoned and the lease expires on its own (logged). The
    /// spawned task is not tracked: a backend whose releases can be left in
    /// flight this way overrides this method and [`Backend::flush`] so that
    /// `flush` waits for them.
    fn release_on_drop(self: Arc<Self>) {
        let mut fut = self.release();
        if let Some(result) = fut.take_ready() {
            if let Err(e) = result {
                tracing::warn!(error = %e, "lock release failed");
            }
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    if let Err(e) = fut.await {
                        tracing::warn!(error = %e, "lock release failed");
                    }
                });
            }
            Err(_) => tracing::warn!(
                "lock dropped outside a Tokio runtime; it is not released and will expire with its lease"
            ),
        }
    }
}
