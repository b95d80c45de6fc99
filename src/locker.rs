//! Taking locks from code: [`BackendExt::lock`] on any backend, and
//! [`Locker`], a cloneable handle with defaults (namespace, wait, lease).

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::admission::Admission;
use crate::backend::DEFAULT_LEASE;
use crate::error::LockError;
use crate::guard::{LockGuard, LockSet};
use crate::key::{KeyError, LockKey};
use crate::lock_future::LockFuture;
use crate::mode::{LockMode, Wait};
use crate::Backend;

/// Something that names a lock key: `&str`, `String` or [`LockKey`].
///
/// # Examples
///
/// ```
/// use tower_lock::{IntoLockKey, LockKey};
///
/// assert_eq!("42".into_lock_key("sku").unwrap().as_str(), "sku:42");
/// let key = LockKey::new("42").unwrap();
/// assert_eq!(key.into_lock_key("").unwrap().as_str(), "42");
/// assert!("a/b".into_lock_key("sku").is_err());
/// ```
pub trait IntoLockKey {
    /// Validates the key and prefixes `namespace` (when not empty) as
    /// `namespace:key`.
    ///
    /// # Errors
    ///
    /// [`KeyError`] if the result is not a valid key.
    fn into_lock_key(self, namespace: &str) -> Result<LockKey, KeyError>;
}

impl IntoLockKey for &str {
    fn into_lock_key(self, namespace: &str) -> Result<LockKey, KeyError> {
        LockKey::namespaced(namespace, self)
    }
}

impl IntoLockKey for String {
    fn into_lock_key(self, namespace: &str) -> Result<LockKey, KeyError> {
        if namespace.is_empty() {
            return LockKey::try_from(self);
        }
        LockKey::namespaced(namespace, &self)
    }
}

impl IntoLockKey for &String {
    fn into_lock_key(self, namespace: &str) -> Result<LockKey, KeyError> {
        LockKey::namespaced(namespace, self)
    }
}

impl IntoLockKey for LockKey {
    fn into_lock_key(self, namespace: &str) -> Result<LockKey, KeyError> {
        if namespace.is_empty() {
            return Ok(self);
        }
        LockKey::namespaced(namespace, self.as_str())
    }
}

impl IntoLockKey for &LockKey {
    fn into_lock_key(self, namespace: &str) -> Result<LockKey, KeyError> {
        self.clone().into_lock_key(namespace)
    }
}

/// `lock` and `lock_all` on every [`Backend`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let _guard = backend.lock("report:daily").wait(Duration::from_secs(2)).await?;
/// let _both = backend.lock_all(["acct:2", "acct:1"]).await?;
/// # Ok(()) }
/// ```
pub trait BackendExt: Backend {
    /// Starts building an acquisition of `key` (exclusive, default wait and
    /// lease); `.await` it.
    fn lock(&self, key: impl IntoLockKey) -> LockBuilder<'_, Self> {
        LockBuilder::new(
            self,
            key.into_lock_key(""),
            DEFAULT_LEASE,
            Wait::DEFAULT,
            None,
        )
    }

    /// Starts building an all-or-nothing acquisition of several keys; `.await`
    /// it.
    fn lock_all<K: IntoLockKey>(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> LockAllBuilder<'_, Self> {
        LockAllBuilder::new(self, keys, "", DEFAULT_LEASE, Wait::DEFAULT, None)
    }
}

impl<B: Backend + ?Sized> BackendExt for B {}

/// A cloneable handle on a backend, with defaults for every lock it takes.
///
/// With the `axum` feature, `Locker` is also an extractor, for a locker added
/// with `.layer(axum::Extension(locker))` (a clone per request costs one
/// reference count, so the [`LockLayer`](crate::LockLayer) does not add one
/// unasked). Hand handlers [`LockLayer::locker`](crate::LockLayer::locker):
/// it locks under the layer's namespace, wait and lease.
///
/// # Re-entrancy
///
/// Within one request served under a [`LockLayer`](crate::LockLayer), a
/// lock the request already holds (a layer's, nested layers included, or
/// one its handler took) is re-entered rather than waited for, when it is
/// asked for again through the same backend (or a clone of it), with
/// [`lock`](Self::lock),
/// [`lock_all`](Self::lock_all) or [`BackendExt::lock`]:
///
/// - in the same mode, or a read lock under a write lock: the acquisition
///   succeeds at once with a nested guard on the same lock, with the same
///   fencing token. A lock the handler took is released when the last of
///   its guards is. The layer's own lock is released by the layer when the
///   response is ready, whatever nested guards remain: do not move one out
///   of the request.
/// - in a mode that cannot share (a write lock under a read lock, a mutex
///   under a read/write lock, another permit count): it fails at once with
///   [`LockError::Reentry`] (a 500 from a handler), rather than wait for
///   itself until the wait runs out.
///
/// "The request" is the code the layer runs: the inner service's `call`,
/// the handler and what it awaits, including layers nested inside this one
/// (an inner layer on the same key re-enters this layer's lock, and holds it
/// only as long as this layer does) and sub-requests the handler serves in
/// process through a router (they see the request's locks, but the locks
/// their own layers take are theirs: two concurrent sub-requests on one key
/// still exclude each other). Concurrent branches of one handler
/// (`tokio::join!`) that lock the same key share it, as any re-entrant lock
/// would. A task the handler spawns is not part of the request, nor is
/// another request, even for the same key: those wait as usual, which is
/// the point of the lock. Make a task's lock future in the task: whether an
/// acquisition re-enters a lock of the request is decided where its future
/// is made, and one made in the handler on the request's own key, awaited
/// in a task, fails with [`LockError::Lost`] (the nested guard would hold
/// nothing of its own). Outside a request there is no re-entrancy: a
/// second `lock` of a held key waits.
///
/// ```
/// use axum::{extract::Path, routing::post, Extension, Router};
/// use tower_lock::{HeldLock, LockError, LockLayer, Locker, MemoryBackend, PathParam};
///
/// async fn restock(locker: Locker, held: HeldLock, Path(sku): Path<String>) -> Result<String, LockError> {
///     // The layer holds `sku:{sku}` for this request: this re-enters it.
///     let again = locker.lock(&sku).await?;
///     assert_eq!(again.token(), held.token());
///     Ok(format!("restocked {sku}"))
/// }
///
/// let layer = LockLayer::new(MemoryBackend::new(), PathParam("sku")).namespace("sku");
/// let locker = layer.locker().clone();
/// let app: Router = Router::new()
///     .route("/restock/{sku}", post(restock))
///     .route_layer(layer)
///     .layer(Extension(locker));
/// ```
///
/// # Admission control
///
/// A hot key (a flash sale on one SKU) queues every request behind it, and
/// each one waits its whole wait only to fail: the service then does no
/// useful work exactly when it matters. Two opt-in rules refuse such
/// requests at once, with [`LockError::Refused`] (423 with `Retry-After`
/// under the layer, gRPC `RESOURCE_EXHAUSTED`), before the backend is
/// asked:
///
/// - [`max_waiters(n)`](Self::max_waiters): when `n` acquisitions of this
///   process already wait for a key, the next is refused. `max_waiters(0)`
///   waits for nothing: the same as [`fail_fast`](Self::fail_fast).
/// - [`predict_waits(true)`](Self::predict_waits): the locker measures each
///   key's *turn*, the time between two of its grants while an exclusive
///   or write request waited through the whole of it (an exponentially
///   weighted mean, used once it has 8 samples), and refuses a request
///   whose expected wait (turns ahead of it, itself included, × the turn)
///   is longer than its own wait. The first in line is never refused on a
///   prediction: the key may be free, and its wait measures the key again,
///   so an estimate grown stale in a slowdown cannot shut a key. The
///   answer's `Retry-After` is the expected wait, at most a minute.
///
/// Both count this process's requests, through this locker and its clones
/// (and the [`LockLayer`](crate::LockLayer) it belongs to), so they work on
/// every backend, cohort or not; other replicas' requests show only as
/// longer turns. An acquisition counts as waiting from the moment it asks
/// until it is granted or gives up; on a remote backend that includes the
/// round trip of an uncontended lock. Memory stays bounded: a key has an
/// entry while requests wait for it (the map keeps the capacity of its
/// busiest moment), and the turns of up to 1,024 recent keys are kept in a
/// fixed table. Each acquisition takes one mutex of the locker twice. The
/// default is neither: requests wait as long as their wait.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use tower_lock::{LockError, Locker, MemoryBackend};
///
/// let locker = Locker::new(MemoryBackend::new()).max_waiters(1).wait(Duration::from_secs(5));
/// let held = locker.lock("sku-1").await.unwrap();
/// let waiting = tokio::spawn({
///     let locker = locker.clone();
///     async move { locker.lock("sku-1").await.map(|g| g.token()) }
/// });
/// tokio::task::yield_now().await; // the spawned one now waits
/// let refused = locker.lock("sku-1").await;
/// assert!(matches!(refused, Err(LockError::Refused { waiting: 1, .. })));
/// drop(held);
/// assert!(waiting.await.unwrap().is_ok());
/// # }
/// ```
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::{Locker, MemoryBackend};
///
/// let locker = Locker::new(MemoryBackend::new())
///     .namespace("acct")
///     .wait(Duration::from_secs(1));
/// let set = locker.lock_all(["7", "3"]).await?;
/// assert_eq!(set.guards()[0].key().as_str(), "acct:3");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    // One allocation, so that a clone per request is one reference count.
    inner: Arc<LockerInner>,
}

#[derive(Clone)]
struct LockerInner {
    backend: Arc<dyn Backend>,
    namespace: Arc<str>,
    wait: Wait,
    lease: Duration,
    /// Admission control; `None` when off (the default).
    admission: Option<Arc<Admission>>,
}

impl Locker {
    /// A locker on `backend` with no namespace, the default wait (10 s) and
    /// lease (10 s).
    pub fn new(backend: impl Backend) -> Self {
        Self::from_arc(Arc::new(backend))
    }

    /// A locker on a shared backend.
    pub fn from_arc(backend: Arc<dyn Backend>) -> Self {
        Locker {
            inner: Arc::new(LockerInner {
                backend,
                namespace: Arc::from(""),
                wait: Wait::DEFAULT,
                lease: DEFAULT_LEASE,
                admission: None,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut LockerInner)) -> Self {
        f(Arc::make_mut(&mut self.inner));
        self
    }

    /// Prefixes every key with `namespace:`.
    ///
    /// # Panics
    ///
    /// If `namespace` breaks the [`LockKey`] rules or leaves no room for a
    /// key.
    pub fn namespace(self, namespace: &str) -> Self {
        crate::key::assert_namespace(namespace);
        self.edit(|l| l.namespace = Arc::from(namespace))
    }

    /// The default wait: a [`Duration`] or a [`Wait`].
    pub fn wait(self, wait: impl Into<Wait>) -> Self {
        let wait = wait.into();
        self.edit(|l| l.wait = wait)
    }

    /// Fail at once when a key is held, by default.
    pub fn fail_fast(self) -> Self {
        self.wait(Wait::FailFast)
    }

    /// The default lease of remote locks.
    pub fn lease(self, lease: Duration) -> Self {
        self.edit(|l| l.lease = lease)
    }

    /// Refuses an acquisition at once when `n` acquisitions of this
    /// process already wait for its key; `0` waits for nothing (as
    /// [`fail_fast`](Self::fail_fast)). See [admission
    /// control](Self#admission-control). Default: no cap.
    pub fn max_waiters(self, n: u32) -> Self {
        let predict = self.inner.admission.as_ref().is_some_and(|a| a.predicts());
        self.edit(|l| l.admission = Admission::new(Some(n), predict))
    }

    /// Refuses an acquisition at once when the turns of those waiting
    /// ahead of it are expected to outlast its wait. See [admission
    /// control](Self#admission-control). Default: off.
    pub fn predict_waits(self, predict: bool) -> Self {
        let max = self.inner.admission.as_ref().and_then(|a| a.max_waiters());
        self.edit(|l| l.admission = Admission::new(max, predict))
    }

    pub(crate) fn admission(&self) -> Option<&Arc<Admission>> {
        self.inner.admission.as_ref()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// The namespace prefixed to every key; empty for none.
    pub fn namespace_prefix(&self) -> &str {
        &self.inner.namespace
    }

    /// The default wait of an acquisition.
    pub fn default_wait(&self) -> Wait {
        self.inner.wait
    }

    /// The default lease of a remote lock.
    pub fn default_lease(&self) -> Duration {
        self.inner.lease
    }

    /// Starts building an acquisition of `key`; `.await` it.
    pub fn lock(&self, key: impl IntoLockKey) -> LockBuilder<'_, dyn Backend> {
        let l = &*self.inner;
        LockBuilder::new(
            &*l.backend,
            key.into_lock_key(&l.namespace),
            l.lease,
            l.wait,
            l.admission.as_ref(),
        )
    }

    /// Starts building an all-or-nothing acquisition of several keys, taken
    /// in sorted order so that two callers cannot deadlock; `.await` it.
    pub fn lock_all<K: IntoLockKey>(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> LockAllBuilder<'_, dyn Backend> {
        let l = &*self.inner;
        let admission = l.admission.as_ref();
        LockAllBuilder::new(&*l.backend, keys, &l.namespace, l.lease, l.wait, admission)
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &*self.inner;
        f.debug_struct("Locker")
            .field("backend", &l.backend.name())
            .field("namespace", &l.namespace)
            .field("wait", &l.wait)
            .field("lease", &l.lease)
            .field(
                "max_waiters",
                &l.admission.as_ref().and_then(|a| a.max_waiters()),
            )
            .field(
                "predict_waits",
                &l.admission.as_ref().is_some_and(|a| a.predicts()),
            )
            .finish()
    }
}

/// An acquisition being set up; `.await` it for a [`LockGuard`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::{BackendExt, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let report = backend
///     .lock("report:daily")
///     .read()
///     .wait(Duration::from_millis(500))
///     .lease(Duration::from_secs(30))
///     .await?;
/// assert_eq!(report.mode().as_str(), "read");
/// # Ok(()) }
/// ```
#[must_use = "a lock builder does nothing until awaited"]
pub struct LockBuilder<'a, B: ?Sized> {
    backend: &'a B,
    key: Result<LockKey, KeyError>,
    mode: LockMode,
    wait: Wait,
    lease: Duration,
    admission: Option<&'a Arc<Admission>>,
}

impl<'a, B: Backend + ?Sized> LockBuilder<'a, B> {
    fn new(
        backend: &'a B,
        key: Result<LockKey, KeyError>,
        lease: Duration,
        wait: Wait,
        admission: Option<&'a Arc<Admission>>,
    ) -> Self {
        LockBuilder {
            backend,
            key,
            mode: LockMode::Exclusive,
            wait,
            lease,
            admission,
        }
    }

    /// Sets the mode.
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// Shared read lock.
    pub fn read(self) -> Self {
        self.mode(LockMode::Read)
    }

    /// Exclusive write lock (of a read/write lock).
    pub fn write(self) -> Self {
        self.mode(LockMode::Write)
    }

    /// One of `permits` permits.
    pub fn semaphore(self, permits: u32) -> Self {
        self.mode(LockMode::Semaphore { permits })
    }

    /// How long to wait: a [`Duration`] or a [`Wait`].
    pub fn wait(mut self, wait: impl Into<Wait>) -> Self {
        self.wait = wait.into();
        self
    }

    /// Fail with [`LockError::Busy`] at once if the key is held.
    pub fn fail_fast(self) -> Self {
        self.wait(Wait::FailFast)
    }

    /// The lease of a remote lock.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
}

impl<B: Backend + ?Sized> IntoFuture for LockBuilder<'_, B> {
    type Output = Result<LockGuard, LockError>;
    type IntoFuture = LockFuture;

    fn into_future(self) -> LockFuture {
        match self.key {
            Ok(key) => LockFuture::start(
                self.backend,
                key,
                self.mode,
                self.wait,
                None,
                self.lease,
                self.admission,
            ),
            Err(e) => LockFuture::failed(LockError::InvalidKey(e)),
        }
    }
}

/// An all-or-nothing acquisition of several keys being set up; `.await` it
/// for a [`LockSet`].
///
/// Keys are de-duplicated and taken in sorted order under one total wait, so
/// two requests that lock the same keys in different orders cannot deadlock.
/// If one key cannot be had, the ones already taken are released.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::{Locker, MemoryBackend};
///
/// let locker = Locker::new(MemoryBackend::new()).namespace("acct");
/// let both = locker.lock_all(["7", "3", "7"]).wait(Duration::from_secs(1)).await?;
/// assert_eq!(both.len(), 2, "duplicates are taken once");
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// Dropping the future before it completes withdraws the acquisition under
/// way and releases the keys already taken, as dropping their guards does:
/// at once on the memory backend, in the background on remote ones (see
/// [`Backend::flush`]). No key is left held.
#[must_use = "a lock builder does nothing until awaited"]
pub struct LockAllBuilder<'a, B: ?Sized> {
    backend: &'a B,
    keys: Result<Vec<LockKey>, KeyError>,
    mode: LockMode,
    wait: Wait,
    lease: Duration,
    admission: Option<&'a Arc<Admission>>,
}

impl<'a, B: Backend + ?Sized> LockAllBuilder<'a, B> {
    fn new<K: IntoLockKey>(
        backend: &'a B,
        keys: impl IntoIterator<Item = K>,
        namespace: &str,
        lease: Duration,
        wait: Wait,
        admission: Option<&'a Arc<Admission>>,
    ) -> Self {
        let keys = keys
            .into_iter()
            .map(|k| k.into_lock_key(namespace))
            .collect::<Result<Vec<_>, _>>()
            .map(|mut keys| {
                keys.sort_unstable();
                keys.dedup();
                keys
            });
        LockAllBuilder {
            backend,
            keys,
            mode: LockMode::Exclusive,
            wait,
            lease,
            admission,
        }
    }

    /// Sets the mode of every key.
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// The total wait for all keys: a [`Duration`] or a [`Wait`].
    pub fn wait(mut self, wait: impl Into<Wait>) -> Self {
        self.wait = wait.into();
        self
    }

    /// Fail with [`LockError::Busy`] at once if any key is held.
    pub fn fail_fast(self) -> Self {
        self.wait(Wait::FailFast)
    }

    /// The lease of remote locks.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
}

impl<'a, B: Backend + ?Sized> IntoFuture for LockAllBuilder<'a, B> {
    type Output = Result<LockSet, LockError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<LockSet, LockError>> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            let keys = self.keys?;
            let started = Instant::now();
            let deadline = match self.wait {
                Wait::Timeout(d) => started.checked_add(d),
                Wait::FailFast | Wait::Forever => None,
            };
            let mut set = LockSet {
                guards: Vec::with_capacity(keys.len()),
            };
            for key in keys {
                let guard = LockFuture::start(
                    self.backend,
                    key,
                    self.mode,
                    self.wait,
                    deadline,
                    self.lease,
                    self.admission,
                )
                .await;
                match guard {
                    Ok(g) => set.guards.push(g),
                    Err(e) => {
                        // Keep the error the caller cares about; release what
                        // was taken before reporting it.
                        let e = match e {
                            LockError::Timeout { .. } => LockError::Timeout {
                                waited: started.elapsed(),
                            },
                            e => e,
                        };
                        let _ = set.release().await;
                        return Err(e);
                    }
                }
            }
            // A key taken first may have been lost while a later one was
            // awaited: all or nothing.
            if let Some(g) = set.guards.iter().find(|g| g.is_lost()) {
                let reason = g
                    .held()
                    .lost_signal()
                    .reason()
                    .unwrap_or("lock lost")
                    .to_owned();
                let _ = set.release().await;
                return Err(LockError::Lost(reason));
            }
            Ok(set)
        })
    }
}
