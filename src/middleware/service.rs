use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{Request, Response};
use tower_service::Service;

use super::config::{Config, OnMissingKey};
use super::{LockableBody, ResponseFuture};
use crate::error::LockError;
use crate::key::KeyError;
use crate::lock_future::{LockFuture, Started};
use crate::mode::Wait;
use crate::rejection::LockRejection;
use crate::source::KeySource;

/// The service [`LockLayer`](super::LockLayer) makes: locks each request's key
/// around the inner service.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use bytes::Bytes;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_lock::{HeldLock, LockBody, LockLayer, MemoryBackend, QueryParam};
///
/// // A plain tower service: no axum.
/// let debit = tower::service_fn(|req: Request<()>| async move {
///     let held = HeldLock::current().expect("under the layer");
///     Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(format!("debited {}", held.key())))))
/// });
/// let service = ServiceBuilder::new()
///     .layer(LockLayer::new(MemoryBackend::new(), QueryParam("account")).namespace("acct"))
///     // The layer answers rejections in the inner service's body type:
///     // `LockBody` wraps any body so that it can.
///     .map_response(|res: Response<Full<Bytes>>| res.map(LockBody::wrap))
///     .service(debit);
///
/// let res = service.clone().oneshot(Request::post("/debit?account=7").body(()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), 200);
/// let res = service.oneshot(Request::post("/debit").body(()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), 400, "no key");
/// # }
/// ```
pub struct LockService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> LockService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        LockService { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone> Clone for LockService<S> {
    fn clone(&self) -> Self {
        LockService {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for LockService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> LockService<S> {
    /// A request that carries no key (`reason`, when the key source gave
    /// one): served unlocked or rejected, as the layer says.
    fn without_key<ReqBody>(
        &mut self,
        request: Request<ReqBody>,
        reason: Option<Cow<'static, str>>,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        let config = &self.config;
        if config.on_missing == OnMissingKey::PassThrough {
            return ResponseFuture::call(&mut self.inner, request, None, config);
        }
        let source = config.source.describe();
        ResponseFuture::rejected(LockRejection::MissingKey { source, reason }, config)
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: LockableBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        let locker = &config.locker;
        let (mut parts, body) = req.into_parts();
        let key = match config
            .source
            .lock_key(&mut parts, locker.namespace_prefix())
        {
            Ok(Some(key)) => key,
            Ok(None) => return self.without_key(Request::from_parts(parts, body), None),
            Err(KeyError::Missing(reason)) => {
                return self.without_key(Request::from_parts(parts, body), Some(reason));
            }
            Err(error) => {
                let rejection = invalid_key(&*config.source, &mut parts, error);
                return ResponseFuture::rejected(rejection, config);
            }
        };

        let mode = config.mode_for(&parts);
        let backend = &**locker.backend();
        let (mut wait, lease) = (locker.default_wait(), locker.default_lease());
        // Whether the caller's deadline, not the layer, set the wait.
        let mut by_deadline = false;
        if let Some(deadline) = &config.deadline {
            match deadline.wait_left(&parts) {
                Ok(None) => {}
                Ok(Some(left)) if left.is_zero() => {
                    crate::metrics::refused(backend.name(), "deadline");
                    let waited = Duration::ZERO;
                    return ResponseFuture::rejected(
                        LockRejection::DeadlineExceeded { waited },
                        config,
                    );
                }
                Ok(Some(left)) => {
                    if let Wait::Forever = wait {
                        (wait, by_deadline) = (Wait::Timeout(left), true);
                    } else if let Wait::Timeout(w) = wait {
                        (wait, by_deadline) = (Wait::Timeout(w.min(left)), left < w);
                    }
                }
                Err(reason) => {
                    let source = deadline.describe();
                    return ResponseFuture::rejected(
                        LockRejection::InvalidDeadline { source, reason },
                        config,
                    );
                }
            }
        }
        let admission = locker.admission();
        match LockFuture::begin_unrecorded(backend, key, mode, wait, lease, admission) {
            // Granted at once (uncontended memory backend): `self.inner` was
            // made ready by `poll_ready`, so call it now.
            Started::Now(Ok(guard)) => {
                let request = Request::from_parts(parts, body);
                ResponseFuture::call(&mut self.inner, request, Some(guard), config)
            }
            Started::Now(Err(e)) => ResponseFuture::rejected(rejection(e, by_deadline), config),
            Started::Later(lock) => {
                // The ready instance goes into the future, to be called once
                // the lock is held; a clone takes its place here.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::acquiring(
                    lock,
                    inner,
                    Request::from_parts(parts, body),
                    self.config.clone(),
                    by_deadline,
                )
            }
        }
    }
}

/// The rejection of a request whose lock was not acquired: a wait the
/// caller's deadline set that ran out is that deadline passing.
pub(super) fn rejection(e: LockError, by_deadline: bool) -> LockRejection {
    match e {
        LockError::Timeout { waited } if by_deadline => LockRejection::DeadlineExceeded { waited },
        e => LockRejection::Lock(e),
    }
}

/// The rejection of an invalid key, quoting what the request gave (read
/// again: only this error path pays for the copy).
fn invalid_key(source: &dyn KeySource, parts: &mut Parts, error: KeyError) -> LockRejection {
    const SHOWN: usize = 64;
    let value = match &error {
        KeyError::Empty
        | KeyError::Misconfigured(_)
        | KeyError::NotUtf8
        | KeyError::Repeated { .. } => None,
        _ => source.extract(parts).ok().flatten().map(|raw| {
            let mut shown: String = raw.chars().take(SHOWN).collect();
            if raw.chars().nth(SHOWN).is_some() {
                shown.push('…');
            }
            shown
        }),
    };
    LockRejection::InvalidKey {
        source: source.describe(),
        error,
        value,
    }
}
