use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::Response;
use tower_layer::Layer;

use super::config::{Config, ModeSelector, OnLost, OnMissingKey};
use super::{Deadline, LockService};
use crate::locker::Locker;
use crate::mode::{LockMode, Wait};
use crate::rejection::LockRejection;
use crate::source::KeySource;
use crate::Backend;

/// Holds a lock on a key taken from each request while the inner service
/// serves it.
///
/// The key comes from a [`KeySource`] (`PathParam` with the `axum` feature,
/// [`Header`](crate::Header), [`QueryParam`](crate::QueryParam), a closure or
/// a [`KeyFn`](crate::KeyFn)),
/// prefixed by an optional namespace. Requests for the same key are served one
/// at a time (or as the [mode](Self::mode) allows), across every replica that
/// shares the backend. The lock is released exactly once, when the response
/// is ready, the service fails or panics, or the client goes away.
///
/// A request that cannot be locked gets a response from the layer instead;
/// [`LockRejection`] lists the statuses, and [`on_rejection`](Self::on_rejection)
/// replaces them.
///
/// Handlers find the lock it holds with the [`HeldLock`](crate::HeldLock)
/// extractor, or [`HeldLock::current`](crate::HeldLock::current) without
/// axum. To take more locks inside a handler, give it the
/// layer's [`Locker`] with `.layer(axum::Extension(layer.locker().clone()))`:
/// it locks under the layer's namespace, wait and lease, so
/// `locker.lock("A1")` in a handler and a request for `A1` exclude each
/// other. A handler that locks its own request's key again
/// [re-enters](crate::Locker#re-entrancy) the layer's lock rather than wait
/// for itself.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use tower_lock::{HeldLock, LockLayer, MemoryBackend, PathParam};
///
/// async fn create_order(held: HeldLock) -> String {
///     format!("order for {} under token {}", held.key(), held.token())
/// }
///
/// let app: Router = Router::new()
///     .route("/orders/{sku}", post(create_order))
///     .route_layer(
///         LockLayer::new(MemoryBackend::new(), PathParam("sku"))
///             .namespace("sku")
///             .wait(Duration::from_secs(5)),
///     );
/// ```
///
/// # Where to mount it
///
/// Inside the router, where axum has matched the route and found its path
/// parameters: over the routes with `Router::route_layer` (every route added
/// before it), or on one handler with `Handler::layer`. Either way the layer
/// reads the same path parameters. On the handler it costs less: under
/// `route_layer` axum boxes a route and its future once more, for any layer
/// (some 750 instructions per request, about a fifth of the layer's cost on
/// the memory backend).
///
/// ```
/// use axum::{handler::Handler, routing::post, Router};
/// use tower_lock::{HeldLock, LockLayer, MemoryBackend, PathParam};
///
/// async fn create_order(held: HeldLock) -> String {
///     format!("order for {}", held.key())
/// }
///
/// let lock = LockLayer::new(MemoryBackend::new(), PathParam("sku")).namespace("sku");
/// let app: Router = Router::new()
///     .route("/orders/{sku}", post(create_order.layer(lock)));
/// ```
#[derive(Clone)]
pub struct LockLayer {
    pub(crate) config: Arc<Config>,
}

impl LockLayer {
    /// Locks the key `source` finds in each request, on `backend`: exclusive,
    /// waiting up to 10 s, 10 s lease, 400 for a request without a key.
    pub fn new(backend: impl Backend, source: impl KeySource) -> Self {
        Self::with_locker(Locker::new(backend), source)
    }

    /// Like [`new`](Self::new), sharing `locker`'s backend and starting from
    /// its namespace, wait and lease.
    pub fn with_locker(locker: Locker, source: impl KeySource) -> Self {
        LockLayer {
            config: Arc::new(Config {
                locker,
                source: Arc::new(source),
                mode: ModeSelector::Fixed(LockMode::Exclusive),
                on_missing: OnMissingKey::Reject,
                on_lost: OnLost::Abort,
                hold_body: false,
                held_lock_extension: false,
                retry_after: Duration::from_secs(1),
                deadline: None,
                grpc: false,
                details: false,
                reject: None,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// Takes keys from `source` instead.
    pub fn key(self, source: impl KeySource) -> Self {
        self.edit(|c| c.source = Arc::new(source))
    }

    /// Prefixes every key with `namespace:` (e.g. `sku:42`), so that routes
    /// locking different kinds of entity cannot collide.
    ///
    /// # Panics
    ///
    /// If `namespace` breaks the [`LockKey`](crate::LockKey) rules or leaves
    /// no room for a key.
    pub fn namespace(self, namespace: &str) -> Self {
        self.edit(|c| c.locker = c.locker.clone().namespace(namespace))
    }

    /// Locks every request in `mode`.
    pub fn mode(self, mode: LockMode) -> Self {
        self.edit(|c| c.mode = ModeSelector::Fixed(mode))
    }

    /// Read lock for `GET`, `HEAD` and `OPTIONS`, write lock for every other
    /// method: reads of one entity run together, a write runs alone.
    pub fn read_write_by_method(self) -> Self {
        self.edit(|c| c.mode = ModeSelector::ByMethod)
    }

    /// Chooses the mode per request.
    pub fn mode_fn(self, f: impl Fn(&Parts) -> LockMode + Send + Sync + 'static) -> Self {
        self.edit(|c| c.mode = ModeSelector::Custom(Arc::new(f)))
    }

    /// How long a request waits for its key: a [`Duration`] or a [`Wait`].
    /// Default: 10 seconds.
    pub fn wait(self, wait: impl Into<Wait>) -> Self {
        let wait = wait.into();
        self.edit(|c| c.locker = c.locker.clone().wait(wait))
    }

    /// Answer 423 at once when the key is held (`ABORTED` with
    /// [`grpc_rejections`](Self::grpc_rejections)).
    pub fn fail_fast(self) -> Self {
        self.wait(Wait::FailFast)
    }

    /// Refuses a request at once, with 423 (gRPC `RESOURCE_EXHAUSTED`),
    /// when `n` requests of this process already wait for its key; `0`
    /// waits for nothing (as [`fail_fast`](Self::fail_fast)). Shared with
    /// the layer's [`locker`](Self::locker); see [admission
    /// control](crate::Locker#admission-control). Default: no cap.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_lock::{LockLayer, MemoryBackend, PathParam};
    ///
    /// // A flash sale: at most 32 requests queue per SKU, and one that
    /// // would not get its turn within its 2 s is answered at once.
    /// let layer = LockLayer::new(MemoryBackend::new(), PathParam("sku"))
    ///     .wait(Duration::from_secs(2))
    ///     .max_waiters(32)
    ///     .predict_waits(true);
    /// ```
    pub fn max_waiters(self, n: u32) -> Self {
        self.edit(|c| c.locker = c.locker.clone().max_waiters(n))
    }

    /// Refuses a request at once, with 423 and a `Retry-After` of its
    /// expected wait, when the turns of the requests waiting ahead of it
    /// are expected to outlast its wait. See [admission
    /// control](crate::Locker#admission-control). Default: off.
    pub fn predict_waits(self, predict: bool) -> Self {
        self.edit(|c| c.locker = c.locker.clone().predict_waits(predict))
    }

    /// Waits for a request's lock no longer than its caller will still
    /// wait, as the request says ([`Deadline`]): the wait is the lesser of
    /// the layer's and the time left. A request with no time left is
    /// answered at once, without asking the backend, and one whose
    /// deadline passes while it waits as soon as it does: 504 Gateway
    /// Timeout (the status a proxy gives when the server behind it did not
    /// answer in time), gRPC `DEADLINE_EXCEEDED` under
    /// [`grpc_rejections`](Self::grpc_rejections). A fail-fast layer stays
    /// fail-fast, though a request with no time left is refused all the
    /// same: its caller has gone. Default: none; the layer's wait alone.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_lock::{Deadline, LockLayer, MemoryBackend, QueryParam};
    ///
    /// let layer = LockLayer::new(MemoryBackend::new(), QueryParam("order"))
    ///     .deadline(Deadline::header_millis("x-request-timeout-ms"));
    /// ```
    pub fn deadline(self, deadline: Deadline) -> Self {
        self.edit(|c| c.deadline = Some(deadline))
    }

    /// The lease of a remote lock, renewed while the request runs. Default:
    /// [`DEFAULT_LEASE`](crate::backend::DEFAULT_LEASE), 10 seconds.
    pub fn lease(self, lease: Duration) -> Self {
        self.edit(|c| c.locker = c.locker.clone().lease(lease))
    }

    /// What to do with a request that carries no key.
    pub fn on_missing_key(self, policy: OnMissingKey) -> Self {
        self.edit(|c| c.on_missing = policy)
    }

    /// What to do when the lock is lost while the request runs.
    pub fn on_lost(self, policy: OnLost) -> Self {
        self.edit(|c| c.on_lost = policy)
    }

    /// Keeps the lock until the response body has been sent (or dropped),
    /// not just until the response head is ready. Use it when the body is
    /// streamed from the locked state.
    pub fn hold_until_body_sent(self, hold: bool) -> Self {
        self.edit(|c| c.hold_body = hold)
    }

    /// Also puts a copy of the [`HeldLock`](crate::HeldLock) in the request
    /// extensions, for inner services that read it where
    /// [`HeldLock::current`](crate::HeldLock::current) cannot: on another
    /// task (behind a `tower::buffer::Buffer`, or a handler that hands the
    /// request to a spawned task). Off by default: it costs every request
    /// an allocation.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tower_lock::{HeldLock, LockBody, LockLayer, MemoryBackend, QueryParam};
    ///
    /// let service = ServiceBuilder::new()
    ///     .layer(LockLayer::new(MemoryBackend::new(), QueryParam("job")).held_lock_extension(true))
    ///     .service_fn(|req: Request<()>| async move {
    ///         // Handled on another task: no `HeldLock::current()` there.
    ///         let key = tokio::spawn(async move {
    ///             let held = req.extensions().get::<HeldLock>().expect("put there by the layer");
    ///             held.key().to_string()
    ///         });
    ///         let body = LockBody::wrap(Full::new(Bytes::from(key.await.unwrap())));
    ///         Ok::<_, std::convert::Infallible>(Response::new(body))
    ///     });
    /// let res = service.oneshot(Request::post("/?job=9").body(()).unwrap()).await.unwrap();
    /// assert_eq!(res.status(), 200);
    /// # }
    /// ```
    pub fn held_lock_extension(self, insert: bool) -> Self {
        self.edit(|c| c.held_lock_extension = insert)
    }

    /// The `Retry-After` of a 423 or 503 answer, rounded up to whole seconds.
    /// Default: 1 second.
    pub fn retry_after(self, after: Duration) -> Self {
        self.edit(|c| c.retry_after = after)
    }

    /// Answers requests it could not lock as gRPC does: HTTP 200 with
    /// `grpc-status` and `grpc-message` (see
    /// [`LockRejection::to_grpc_response`] for the codes), so that gRPC
    /// clients see `INVALID_ARGUMENT`, `ABORTED` or `UNAVAILABLE` rather than
    /// `Unknown`. For a layer in front of a gRPC server (tonic).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_lock::{Header, LockLayer, MemoryBackend};
    ///
    /// // Locks per the `x-account-id` request metadata of each call.
    /// let layer = LockLayer::new(MemoryBackend::new(), Header::new("x-account-id"))
    ///     .grpc_rejections();
    /// ```
    pub fn grpc_rejections(self) -> Self {
        self.edit(|c| c.grpc = true)
    }

    /// Shows the whole error in the layer's default answers (the body, or
    /// `grpc-message`): hosts, ports and driver text, for a service whose
    /// clients are its own operators. Off by default: the answers then say
    /// what happened in words ([`LockRejection::summary`]), and the details
    /// stay in logs. A URL's user and password are never shown.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_lock::{LockLayer, MemoryBackend, PathParam};
    ///
    /// let layer = LockLayer::new(MemoryBackend::new(), PathParam("sku")).error_details(true);
    /// ```
    pub fn error_details(self, show: bool) -> Self {
        self.edit(|c| c.details = show)
    }

    /// Replaces the layer's responses to requests it could not lock.
    ///
    /// # Examples
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use tower_lock::{LockLayer, LockRejection, MemoryBackend, QueryParam};
    ///
    /// let layer = LockLayer::new(MemoryBackend::new(), QueryParam("cart"))
    ///     .on_rejection(|rejection: &LockRejection| {
    ///         let mut res = Response::new(Bytes::from(format!("{{\"error\":\"{rejection}\"}}")));
    ///         *res.status_mut() = match rejection.status() {
    ///             StatusCode::LOCKED => StatusCode::CONFLICT,
    ///             other => other,
    ///         };
    ///         res
    ///     });
    /// ```
    pub fn on_rejection(
        self,
        f: impl Fn(&LockRejection) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.reject = Some(Arc::new(f)))
    }

    /// A handle on this layer's backend with the layer's namespace, wait and
    /// lease: `layer.locker().lock(k)` locks the very key a request for `k`
    /// locks, and waits as long. Hand it to handlers that take more locks.
    ///
    /// Call it after setting the namespace, wait and lease: the locker is a
    /// snapshot of the layer as it is.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
    /// use std::time::Duration;
    /// use tower_lock::{LockLayer, MemoryBackend, PathParam};
    ///
    /// let layer = LockLayer::new(MemoryBackend::new(), PathParam("sku"))
    ///     .namespace("sku")
    ///     .wait(Duration::from_secs(3));
    /// let locker = layer.locker().clone();
    /// let guard = locker.lock("A1").await?;
    /// assert_eq!(guard.key().as_str(), "sku:A1");
    /// assert_eq!(locker.default_wait(), Duration::from_secs(3).into());
    /// // Add it for handlers: `.layer(axum::Extension(locker))`.
    /// # Ok(()) }
    /// ```
    pub fn locker(&self) -> &Locker {
        &self.config.locker
    }
}

impl<S> Layer<S> for LockLayer {
    type Service = LockService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::new(inner, self.config.clone())
    }
}

impl fmt::Debug for LockLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("LockLayer")
            .field("backend", &c.locker.backend().name())
            .field("source", &c.source.describe())
            .field("namespace", &c.locker.namespace_prefix())
            .field("wait", &c.locker.default_wait())
            .field("lease", &c.locker.default_lease())
            .field("on_missing", &c.on_missing)
            .field("on_lost", &c.on_lost)
            .field("hold_body", &c.hold_body)
            .field("held_lock_extension", &c.held_lock_extension)
            .field("deadline", &c.deadline)
            .finish_non_exhaustive()
    }
}
