//! The backend abstraction: what a lock store must do, and nothing more.
//!
//! A [`Backend`] acquires one key in one [`LockMode`]; everything else (keys
//! from requests, timeouts, several keys at once, tracing, HTTP) is built once,
//! on top, by [`Locker`](crate::Locker), [`BackendExt`](crate::BackendExt) and
//! [`LockLayer`](crate::LockLayer).
//!
//! # Why the trait is object safe
//!
//! Services pick their backend at run time (`--backend redis://...`), and the
//! layer, the extractors and the guards should have one type whichever store
//! is behind them: `LockLayer`, not `LockLayer<RedisBackend<...>>`. So
//! [`Backend::acquire`] returns a [`BackendFuture`]: a finished result when the
//! backend could decide at once (the memory backend's uncontended path, which
//! then allocates no future), a boxed future otherwise. A network round trip
//! costs a thousand times more than that box, so remote backends lose nothing.
//!
//! # Contract for implementors
//!
//! - `acquire` may start work eagerly; dropping the returned future, or the
//!   [`Acquired`] it produced, must undo everything: leave the wait queue, delete
//!   the half-made node, release the granted lock. The core relies on that for
//!   timeouts and for clients that go away.
//! - With [`Wait::FailFast`], answer
//!   [`LockError::Busy`] after one attempt. Otherwise wait until granted; the
//!   core enforces [`LockRequest::wait`] by dropping the future, and a backend
//!   may use it to bound its own re-checks.
//! - Every grant gets a [`FencingToken`] strictly greater than the previous
//!   grant's of the same key.
//! - A lease that the backend cannot keep fires the [`LostTrigger`](crate::LostTrigger)
//!   behind [`Acquired::with_lost`], promptly and before the lease would let
//!   anyone else in, where the store allows it.
//!
//! # How remote backends and cohorting plug in
//!
//! A remote backend (Redis, ZooKeeper, PostgreSQL) implements `acquire` with its
//! protocol, returns a [`LeaseHandle`] that stops the renewal task and deletes
//! the remote state, and fires the lost trigger from its renewal task. Because
//! release is asynchronous there, the default
//! [`LeaseHandle::release_on_drop`] hands the release to the Tokio runtime.
//!
//! Lock cohorting (one process's waiters queue locally, only the head contends
//! remotely, the remote lock passes between local waiters up to a bound) is a
//! `Backend` that wraps another `Backend`: its `acquire` queues locally, exactly
//! as the memory backend does, and its lease handle decides on release whether
//! to hand the inner [`Acquired`] to the next local waiter or release it. The
//! core and the layer do not change.

mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub mod redlock;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

#[cfg(feature = "redis")]
pub use self::redis::{RedisBackend, RedisOptions};
#[cfg(feature = "zookeeper")]
pub use self::zookeeper::{ZookeeperBackend, ZookeeperOptions};
pub use memory::MemoryBackend;
#[cfg(feature = "redis")]
pub use redlock::RedlockBackend;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::LostSignal;
use crate::mode::{LockMode, Wait};
use crate::token::FencingToken;

/// Opens the backend a URL names, for services that take it from their
/// configuration.
///
/// | URL | backend |
/// |---|---|
/// | `memory` | [`MemoryBackend`] |
/// | `redis://host:port` | [`RedisBackend`], one instance (feature `redis`) |
/// | `redlock://h1:p1,h2:p2,h3:p3` | [`RedlockBackend`] (feature `redis`) |
/// | `zk://host:port[,host:port...][/root]` | ZooKeeper (feature `zookeeper`) |
///
/// # Errors
///
/// [`LockError::Config`] for a URL this build cannot open, saying why.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let backend = tower_lock::backend::connect("memory").await.unwrap();
/// assert_eq!(backend.name(), "memory");
/// assert!(tower_lock::backend::connect("carrier-pigeon://").await.is_err());
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn Backend>, LockError> {
    let scheme = url.split_once("://").map_or(url, |(scheme, _)| scheme);
    match scheme {
        "memory" => Ok(Arc::new(MemoryBackend::new())),
        #[cfg(feature = "redis")]
        "redis" => Ok(Arc::new(RedisBackend::connect(url).await?)),
        #[cfg(feature = "redis")]
        "redlock" => Ok(Arc::new(RedlockBackend::connect(url).await?)),
        #[cfg(not(feature = "redis"))]
        "redis" | "redlock" => Err(LockError::Config(format!(
            "the `{scheme}` backend needs tower-lock's `redis` feature"
        ))),
        #[cfg(feature = "zookeeper")]
        "zk" => Ok(Arc::new(ZookeeperBackend::connect(url).await?)),
        #[cfg(not(feature = "zookeeper"))]
        "zk" => Err(LockError::Config(
            "the `zk` backend needs tower-lock's `zookeeper` feature".into(),
        )),
        _ => Err(LockError::Config(format!(
            "unknown backend URL {url:?}: expected `memory`, `redis://host:port`, \
                 `redlock://h1:p1,h2:p2,...` or `zk://host:port`"
        ))),
    }
}

/// A lock store.
///
/// See the [module documentation](self) for the contract. Users do not call
/// these methods directly: they use [`BackendExt::lock`](crate::BackendExt::lock),
/// a [`Locker`](crate::Locker) or the [`LockLayer`](crate::LockLayer).
pub trait Backend: Send + Sync + 'static {
    /// A short name for traces and errors: `memory`, `redis`, `zookeeper`.
    fn name(&self) -> &'static str;

    /// Acquires `request.key` in `request.mode`.
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
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
    /// use tower_lock::{Backend, BackendExt, MemoryBackend};
    ///
    /// let backend = MemoryBackend::new();
    /// backend.lock("sku-1").await?.release().await?;
    /// backend.flush().await;
    /// # Ok(()) }
    /// ```
    fn flush(&self) -> BackendFuture<()> {
        BackendFuture::ready(())
    }
}

impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        (**self).acquire(request)
    }
    fn flush(&self) -> BackendFuture<()> {
        (**self).flush()
    }
}

impl<B: Backend + ?Sized> Backend for Box<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        (**self).acquire(request)
    }
    fn flush(&self) -> BackendFuture<()> {
        (**self).flush()
    }
}

/// One acquisition asked of a [`Backend`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LockRequest {
    /// The key, validated.
    pub key: LockKey,
    /// The mode, validated (a semaphore has at least one permit).
    pub mode: LockMode,
    /// The wait policy: how long, from this call, the core lets it wait.
    pub wait: Wait,
    /// How long a remote lock lives without renewal. Backends renew it while
    /// held; the memory backend has no use for it.
    pub lease: Duration,
}

impl LockRequest {
    /// A request for `key` in `mode` with the default wait and lease, for
    /// backend tests.
    pub fn new(key: LockKey, mode: LockMode) -> Self {
        LockRequest {
            key,
            mode,
            wait: Wait::DEFAULT,
            lease: DEFAULT_LEASE,
        }
    }

    /// Sets the wait policy.
    pub fn with_wait(mut self, wait: Wait) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the lease.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
}

/// The default lease of a remote lock: 10 seconds, renewed every third of it
/// while held.
///
/// The lease bounds how long a crashed holder keeps its key from everyone
/// else (the torture harness measures it as `kill_recovery_ms`: about one
/// lease), so it is no longer than the default wait: a request that arrives
/// as a replica crashes still gets the key within its wait. Longer leases
/// only help holders that stall (a pause, an unanswered renewal) for more
/// than two thirds of one; they then lose the lock and are told.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// What a backend hands back for a granted lock.
///
/// Dropping it without turning it into a guard releases the lock.
#[must_use = "dropping an Acquired releases the lock"]
pub struct Acquired {
    token: FencingToken,
    lost: LostSignal,
    handle: Option<Arc<dyn LeaseHandle>>,
}

impl Acquired {
    /// A grant with fencing token `token`, released through `handle`.
    ///
    /// The handle is an `Arc` so that a backend can keep one allocation per
    /// lock for its own state, the handle and the [`LostState`](crate::LostState)
    /// its [`LostSignal`] points into.
    pub fn new(token: FencingToken, handle: Arc<dyn LeaseHandle>) -> Self {
        Acquired {
            token,
            lost: LostSignal::never(),
            handle: Some(handle),
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

    pub(crate) fn into_parts(mut self) -> (FencingToken, LostSignal, Arc<dyn LeaseHandle>) {
        let handle = self.handle.take().expect("handle present until taken");
        (self.token, std::mem::take(&mut self.lost), handle)
    }
}

impl Drop for Acquired {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.release_on_drop();
        }
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

/// Releases sent and not yet answered, for [`Backend::flush`].
#[cfg(any(feature = "redis", feature = "zookeeper"))]
#[derive(Default)]
pub(crate) struct InFlight {
    count: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

#[cfg(any(feature = "redis", feature = "zookeeper"))]
impl InFlight {
    /// Runs `release` to its end on `rt`, counted until then.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        release: impl Future<Output = ()> + Send + 'static,
    ) {
        use std::sync::atomic::Ordering;

        /// Uncounts the release also when its task is dropped unfinished.
        struct Done(Arc<InFlight>);
        impl Drop for Done {
            fn drop(&mut self) {
                if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.0.idle.notify_waiters();
                }
            }
        }

        self.count.fetch_add(1, Ordering::AcqRel);
        let done = Done(self.clone());
        rt.spawn(async move {
            let _done = done;
            release.await;
        });
    }

    /// Completes once no release is in flight.
    pub(crate) async fn idle(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // Armed before the check, so a release ending in between is seen.
            idle.as_mut().enable();
            if self.count.load(std::sync::atomic::Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// A backend's hold on one granted lock.
pub trait LeaseHandle: Send + Sync + 'static {
    /// Releases the lock (and stops any renewal). Called at most once.
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>>;

    /// Releases the lock from a destructor, where nothing can be awaited.
    ///
    /// The default runs [`release`](Self::release) and, if it did not finish at
    /// once, spawns it on the current Tokio runtime. Outside a runtime the
    /// release is abandoned and the lease expires on its own (logged).
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

/// The future a backend returns: a result known at once, or a boxed future.
///
/// The ready form lets a backend that can decide synchronously (the memory
/// backend, uncontended) skip a heap allocation per call.
#[must_use = "futures do nothing unless polled"]
pub struct BackendFuture<T>(Repr<T>);

enum Repr<T> {
    Ready(Option<T>),
    Boxed(Pin<Box<dyn Future<Output = T> + Send>>),
}

impl<T> BackendFuture<T> {
    /// A future that is already finished.
    pub fn ready(value: T) -> Self {
        BackendFuture(Repr::Ready(Some(value)))
    }

    /// Boxes `fut`.
    pub fn new(fut: impl Future<Output = T> + Send + 'static) -> Self {
        BackendFuture(Repr::Boxed(Box::pin(fut)))
    }

    /// Whether the future was made finished (and not yet taken).
    pub fn is_ready(&self) -> bool {
        matches!(self.0, Repr::Ready(Some(_)))
    }

    /// The value, if the future was made finished.
    pub fn take_ready(&mut self) -> Option<T> {
        match &mut self.0 {
            Repr::Ready(v) => v.take(),
            Repr::Boxed(_) => None,
        }
    }
}

// Never pins `T`: the ready value is moved out, the boxed future is pinned by
// its box.
impl<T> Unpin for BackendFuture<T> {}

impl<T> Future for BackendFuture<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.0 {
            Repr::Ready(v) => Poll::Ready(v.take().expect("BackendFuture polled after completion")),
            Repr::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl<T> fmt::Debug for BackendFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Repr::Ready(_) => "BackendFuture::Ready",
            Repr::Boxed(_) => "BackendFuture::Boxed",
        })
    }
}
