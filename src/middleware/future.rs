use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::task::futures::TaskLocalFuture;
use tower_service::Service;

use super::config::{Config, OnLost, Policy};
use super::LockableBody;
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::lock_future::LockFuture;
use crate::lost::LostSignal;
use crate::reentry::{self, RequestLocks};
use crate::rejection::{FromLockError, LockRejection};

pin_project! {
    /// Response future of [`LockService`](super::LockService): acquires the
    /// lock, runs the inner service, releases.
    ///
    /// Dropping it at any point (the client went away) withdraws the
    /// acquisition or releases the held lock.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use axum::{body::Body, routing::post, Router};
    /// use http::Request;
    /// use tower::{Layer, Service, ServiceExt};
    /// use tower_lock::{middleware::ResponseFuture, LockLayer, MemoryBackend, QueryParam};
    ///
    /// let mut service = LockLayer::new(MemoryBackend::new(), QueryParam("cart"))
    ///     .layer(Router::new().route("/checkout", post(|| async { "paid" })));
    /// let ready = ServiceExt::<Request<Body>>::ready(&mut service).await.unwrap();
    /// let future: ResponseFuture<Router, Body> =
    ///     ready.call(Request::post("/checkout?cart=9").body(Body::empty()).unwrap());
    /// assert_eq!(future.await.unwrap().status(), 200);
    /// # }
    /// ```
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
        // Copied out of the layer's config: an `Arc` clone per request would
        // bounce its reference count between cores.
        policy: Policy,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Rejected {
            response: Option<Response<Bytes>>,
        },
        // Boxed: only a request that has to wait comes here, and keeping the
        // request and a service clone inline would make every future large.
        Acquiring {
            pending: Box<Pending<S, ReqBody>>,
        },
        Running {
            // Run in the request's re-entrancy scope: the handler's locks on
            // its own key re-enter the layer's.
            #[pin]
            future: TaskLocalFuture<RefCell<RequestLocks>, S::Future>,
            // Dropped after `future`: fields drop in order, so a handler that
            // is cancelled stops before its lock is released.
            guard: Option<LockGuard>,
            lost: LostSignal,
        },
    }
}

impl<S, ReqBody> State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// The inner service's `future` running under `guard` (none when the
    /// request passed through unlocked), in the request's re-entrancy scope.
    fn running(future: S::Future, guard: Option<LockGuard>, config: &Config) -> Self {
        let lost = guard
            .as_ref()
            .map_or_else(LostSignal::never, |g| g.held().lost_signal().clone());
        let layer_lock = guard
            .as_ref()
            .map(|g| (config.locker.backend().instance_id(), g.held().clone()));
        State::Running {
            future: reentry::scope(layer_lock, future),
            guard,
            lost,
        }
    }
}

struct Pending<S, ReqBody> {
    config: Arc<Config>,
    lock: LockFuture,
    service: Option<S>,
    request: Option<Request<ReqBody>>,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn rejected(rejection: LockRejection, config: &Config) -> Self {
        ResponseFuture {
            state: State::Rejected {
                response: Some(config.reject(&rejection)),
            },
            policy: config.policy(),
        }
    }

    pub(crate) fn running(future: S::Future, guard: Option<LockGuard>, config: &Config) -> Self {
        ResponseFuture {
            state: State::running(future, guard, config),
            policy: config.policy(),
        }
    }

    pub(crate) fn acquiring(
        lock: LockFuture,
        service: S,
        request: Request<ReqBody>,
        config: Arc<Config>,
    ) -> Self {
        ResponseFuture {
            policy: config.policy(),
            state: State::Acquiring {
                pending: Box::new(Pending {
                    config,
                    lock,
                    service: Some(service),
                    request: Some(request),
                }),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: LockableBody,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Rejected { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(response.map(ResBody::from_text)));
                }
                StateProj::Acquiring { pending } => {
                    match ready!(Pin::new(&mut pending.lock).poll(cx)) {
                        Ok(guard) => {
                            let request = pending.request.take().expect("request present");
                            let mut service = pending.service.take().expect("service present");
                            let future = service.call(with_lock(request, &guard));
                            let running = State::running(future, Some(guard), &pending.config);
                            this.state.set(running);
                        }
                        Err(e) => {
                            let response = pending.config.reject(&LockRejection::Lock(e));
                            this.state.set(State::Rejected {
                                response: Some(response),
                            });
                        }
                    }
                }
                StateProj::Running {
                    future,
                    guard,
                    lost,
                } => {
                    let abort = this.policy.on_lost == OnLost::Abort;
                    // One atomic load before the handler runs; a waker is
                    // registered only if the handler has to wait.
                    let result = if abort && lost.is_lost() {
                        None
                    } else {
                        match future.poll(cx) {
                            Poll::Ready(result) => Some(result),
                            Poll::Pending if abort && lost.poll_lost(cx).is_ready() => None,
                            Poll::Pending => return Poll::Pending,
                        }
                    };
                    let guard = guard.take();
                    let Some(result) = result else {
                        let reason = lost.reason().unwrap_or("lock lost").to_owned();
                        tracing::warn!(
                            key = guard.as_ref().map(|g| g.key().as_str()),
                            reason,
                            "lock lost while the request ran; aborting it"
                        );
                        // Stop the handler first, then release.
                        this.state.set(State::Rejected { response: None });
                        drop(guard);
                        let rejection = LockRejection::Lock(LockError::Lost(reason));
                        let response = this.policy.reject(&rejection);
                        return Poll::Ready(Ok(response.map(ResBody::from_text)));
                    };
                    // Done: a further poll finds no future to resume.
                    this.state.set(State::Rejected { response: None });
                    let abort = this.policy.on_lost == OnLost::Abort;
                    return Poll::Ready(result.map(|mut response| {
                        // A handler answered with a `LockError` (`?` on a
                        // `Locker` call): answer as the layer would.
                        if let Some(e) = response.extensions_mut().remove::<FromLockError>() {
                            let rejection = this.policy.reject(e.rejection());
                            response = rejection.map(ResBody::from_text);
                        }
                        match guard {
                            Some(guard) if this.policy.hold_body => {
                                response.map(|body| body.holding(guard, abort))
                            }
                            // Released here, as soon as the response is ready.
                            _ => response,
                        }
                    }));
                }
            }
        }
    }
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// Puts the held lock in the request extensions, for the `HeldLock`
/// extractor.
pub(super) fn with_lock<B>(mut request: Request<B>, guard: &LockGuard) -> Request<B> {
    request.extensions_mut().insert(guard.held().clone());
    request
}
