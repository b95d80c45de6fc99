//! Taking locks from code: [`BackendExt::lock`] on any backend, and
//! [`Locker`], a cloneable handle with defaults (namespace, wait, lease).

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use tokio::time::Sleep;
use tracing::field::Empty;

use crate::backend::{Acquired, Backend, BackendFuture, LockRequest, DEFAULT_LEASE};
use crate::error::LockError;
use crate::guard::{HeldLock, LockGuard, LockSet};
use crate::key::{KeyError, LockKey};
use crate::mode::{LockMode, Wait};

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
        LockBuilder::new(self, key.into_lock_key(""), DEFAULT_LEASE, Wait::DEFAULT)
    }

    /// Starts building an all-or-nothing acquisition of several keys; `.await`
    /// it.
    fn lock_all<K: IntoLockKey>(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> LockAllBuilder<'_, Self> {
        LockAllBuilder::new(self, keys, "", DEFAULT_LEASE, Wait::DEFAULT)
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
/// lock the request already holds (the layer's, or one its handler took) is
/// re-entered rather than waited for, when it is asked for again through the
/// same backend (or a clone of it), with [`lock`](Self::lock),
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
/// "The request" is the code the layer's response future runs: the handler
/// and what it awaits. A task the handler spawns is not part of it, nor is
/// another request, even for the same key: those wait as usual, which is
/// the point of the lock. Outside a request there is no re-entrancy: a
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
        )
    }

    /// Starts building an all-or-nothing acquisition of several keys, taken
    /// in sorted order so that two callers cannot deadlock; `.await` it.
    pub fn lock_all<K: IntoLockKey>(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> LockAllBuilder<'_, dyn Backend> {
        let l = &*self.inner;
        LockAllBuilder::new(&*l.backend, keys, &l.namespace, l.lease, l.wait)
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
}

impl<'a, B: Backend + ?Sized> LockBuilder<'a, B> {
    fn new(backend: &'a B, key: Result<LockKey, KeyError>, lease: Duration, wait: Wait) -> Self {
        LockBuilder {
            backend,
            key,
            mode: LockMode::Exclusive,
            wait,
            lease,
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
            Ok(key) => LockFuture::start(self.backend, key, self.mode, self.wait, None, self.lease),
            Err(e) => LockFuture::failed(LockError::InvalidKey(e)),
        }
    }
}

/// Future of one acquisition: waits at most until its deadline, and leaves
/// the backend's queue if dropped.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::future::IntoFuture;
/// use std::time::Duration;
/// use tower_lock::{BackendExt, LockFuture, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let _held = backend.lock("k").await?;
/// // A nameable future, e.g. to race against shutdown.
/// let waiting: LockFuture = backend.lock("k").into_future();
/// tokio::select! {
///     guard = waiting => println!("got it: {:?}", guard.map(|g| g.token())),
///     _ = tokio::time::sleep(Duration::from_millis(10)) => println!("gave up; the request is withdrawn"),
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// Cancel safe: dropping it before it completes withdraws the request, and a
/// lock granted in the meantime is released.
#[must_use = "futures do nothing unless polled"]
pub struct LockFuture {
    state: Option<Acquiring>,
    // Boxed: only a waiting acquisition with a timeout needs a timer, and an
    // unboxed `Sleep` would make every `LockFuture` large and `!Unpin`.
    sleep: Option<Pin<Box<Sleep>>>,
    /// A nested guard on a lock the request already holds.
    reentered: Option<LockGuard>,
}

struct Acquiring {
    acquire: Result<BackendFuture<Result<Acquired, LockError>>, LockError>,
    key: Option<LockKey>,
    mode: LockMode,
    backend: &'static str,
    /// [`Backend::instance_id`], for re-entrancy.
    backend_id: usize,
    wait: Wait,
    /// A deadline shared with other acquisitions (`lock_all`); otherwise one
    /// is set from `wait` when the acquisition first has to wait, so that an
    /// uncontended lock reads no clock.
    deadline: Option<Instant>,
    /// When the acquisition first had to wait; `None` while it never did.
    waiting_since: Option<Instant>,
    span: tracing::Span,
}

impl LockFuture {
    /// Starts acquiring `key`. `deadline` overrides the one `wait` implies
    /// (a multi-key acquisition shares one).
    pub(crate) fn start<B: Backend + ?Sized>(
        backend: &B,
        key: LockKey,
        mode: LockMode,
        wait: Wait,
        deadline: Option<Instant>,
        lease: Duration,
    ) -> Self {
        if let LockMode::Semaphore { permits: 0 } = mode {
            return Self::failed(LockError::InvalidMode(
                "a semaphore needs at least one permit".into(),
            ));
        }
        let backend_id = backend.instance_id();
        // A request that already holds the key must not wait for itself.
        match crate::reentry::reenter(backend_id, &key, mode) {
            None => {}
            Some(Ok(guard)) => return Self::reentered(guard),
            Some(Err(e)) => return Self::failed(e),
        }
        // The backend counts a shared deadline's remainder as its wait.
        let backend_wait = match (deadline, wait) {
            (Some(d), Wait::Timeout(_)) => {
                Wait::Timeout(d.saturating_duration_since(Instant::now()))
            }
            _ => wait,
        };
        let name = backend.name();
        let span = tracing::debug_span!(
            "lock",
            key = %key,
            backend = name,
            mode = mode.as_str(),
            wait_us = Empty,
            hold_us = Empty,
            outcome = Empty,
        );
        let request = LockRequest {
            key: key.clone(),
            mode,
            wait: backend_wait,
            lease,
        };
        let acquire = span.in_scope(|| backend.acquire(request));
        // Queued from now, whenever the future is first polled.
        let waiting_since = (!acquire.is_ready()).then(Instant::now);
        LockFuture {
            state: Some(Acquiring {
                acquire: Ok(acquire),
                key: Some(key),
                mode,
                backend: name,
                backend_id,
                wait,
                deadline,
                waiting_since,
                span,
            }),
            sleep: None,
            reentered: None,
        }
    }

    pub(crate) fn failed(error: LockError) -> Self {
        LockFuture {
            state: Some(Acquiring {
                acquire: Err(error),
                key: None,
                mode: LockMode::Exclusive,
                backend: "",
                backend_id: 0,
                wait: Wait::FailFast,
                deadline: None,
                waiting_since: None,
                span: tracing::Span::none(),
            }),
            sleep: None,
            reentered: None,
        }
    }

    fn reentered(guard: LockGuard) -> Self {
        LockFuture {
            state: None,
            sleep: None,
            reentered: Some(guard),
        }
    }

    /// The result, if the backend decided without waiting (the memory
    /// backend's uncontended path, an invalid key). The layer uses it to call
    /// the inner service at once instead of through a second state.
    pub(crate) fn try_ready(&mut self) -> Option<Result<LockGuard, LockError>> {
        if let Some(guard) = self.reentered.take() {
            return Some(Ok(guard));
        }
        let state = self.state.as_mut()?;
        let result = match &mut state.acquire {
            Ok(f) => f.take_ready()?,
            Err(_) => match self.state.take()?.acquire {
                Err(e) => return Some(Err(e)),
                Ok(_) => unreachable!("matched Err above"),
            },
        };
        Some(finish(self.state.take()?, result))
    }
}

/// Turns the backend's answer into a guard or an error, and traces it.
fn finish(state: Acquiring, result: Result<Acquired, LockError>) -> Result<LockGuard, LockError> {
    let waited = state.waiting_since.map_or(Duration::ZERO, |t| t.elapsed());
    state.span.record("wait_us", waited.as_micros() as u64);
    // A grant that was revoked before anyone saw it is no grant.
    let result = match result {
        Ok(acquired) if acquired.lost().is_lost() => {
            let reason = acquired.lost().reason().unwrap_or("lock lost").to_owned();
            drop(acquired);
            Err(LockError::Lost(reason))
        }
        other => other,
    };
    let outcome = match &result {
        Ok(_) => "acquired",
        Err(LockError::Busy) => "busy",
        Err(LockError::Timeout { .. }) => "timeout",
        Err(LockError::Lost(_)) => "lost",
        Err(_) => "error",
    };
    state.span.record("outcome", outcome);
    crate::metrics::acquisition(state.backend, outcome, waited);
    match result {
        Ok(acquired) => {
            let (token, lost, handle) = acquired.into_parts();
            tracing::debug!(parent: &state.span, token = token.get(), "lock acquired");
            let held = HeldLock {
                key: state.key.expect("key present when acquiring"),
                mode: state.mode,
                token,
                waited,
                backend: state.backend,
                lost,
            };
            let mut guard = LockGuard::new(held, handle, state.span);
            crate::reentry::record(&mut guard, state.backend_id);
            Ok(guard)
        }
        Err(e) => {
            tracing::debug!(parent: &state.span, error = %e, "lock not acquired");
            Err(e)
        }
    }
}

impl Future for LockFuture {
    type Output = Result<LockGuard, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(ready) = this.try_ready() {
            return Poll::Ready(ready);
        }
        let state = this
            .state
            .as_mut()
            .expect("LockFuture polled after completion");
        let Ok(acquire) = &mut state.acquire else {
            unreachable!("an error is ready");
        };
        let result = match Pin::new(&mut *acquire).poll(cx) {
            Poll::Ready(r) => r,
            Poll::Pending => {
                let since = *state.waiting_since.get_or_insert_with(Instant::now);
                let deadline = match (state.deadline, state.wait) {
                    (Some(d), _) => d,
                    (None, Wait::Timeout(d)) => match since.checked_add(d) {
                        Some(deadline) => *state.deadline.insert(deadline),
                        // Too far to represent: as good as forever.
                        None => return Poll::Pending,
                    },
                    (None, Wait::FailFast | Wait::Forever) => return Poll::Pending,
                };
                if this.sleep.is_none() {
                    if tokio::runtime::Handle::try_current().is_err() {
                        let e = LockError::Config(
                            "waiting for a lock with a timeout needs a Tokio runtime with timers"
                                .into(),
                        );
                        return Poll::Ready(finish(this.state.take().expect("state"), Err(e)));
                    }
                    this.sleep = Some(Box::pin(tokio::time::sleep_until(deadline)));
                }
                let sleep = this.sleep.as_mut().expect("set above");
                ready!(sleep.as_mut().poll(cx));
                // A grant may have landed between the two polls: take it
                // rather than report a timeout and release it.
                match Pin::new(acquire).poll(cx) {
                    Poll::Ready(r) => r,
                    Poll::Pending => Err(LockError::Timeout {
                        waited: since.elapsed(),
                    }),
                }
            }
        };
        // Dropping the state drops a pending backend future: that withdraws
        // the request (the backend contract).
        Poll::Ready(finish(this.state.take().expect("state present"), result))
    }
}

impl fmt::Debug for LockFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockFuture")
            .field("key", &self.state.as_ref().and_then(|s| s.key.as_ref()))
            .finish_non_exhaustive()
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
}

impl<'a, B: Backend + ?Sized> LockAllBuilder<'a, B> {
    fn new<K: IntoLockKey>(
        backend: &'a B,
        keys: impl IntoIterator<Item = K>,
        namespace: &str,
        lease: Duration,
        wait: Wait,
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
