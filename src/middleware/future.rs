use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::config::{Config, OnLost, Policy};
use super::LockableBody;
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::lock_future::LockFuture;
use crate::reentry::RequestLocks;
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
    /// use tower_lock::{LockLayer, MemoryBackend, QueryParam, ResponseFuture};
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
            // Polled in the request's re-entrancy scope, `locks`: the
            // handler's locks on its own key re-enter the layer's.
            #[pin]
            future: S::Future,
            // Holds the layer's guard. Dropped after `future`: fields drop
            // in order, so a handler that is cancelled stops before its lock
            // is released.
            locks: RequestLocks,
        },
    }
}

impl<S, ReqBody> State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// Calls `service` with `request`, under the layer's `guard` (none when
    /// the request passes through unlocked), in the request's scope.
    fn call(
        service: &mut S,
        mut request: Request<ReqBody>,
        guard: Option<LockGuard>,
        config: &Config,
    ) -> Self {
        if let Some(guard) = guard.as_ref().filter(|_| config.held_lock_extension) {
            request.extensions_mut().insert(guard.held().clone());
        }
        let backend_id = config.locker.backend().instance_id();
        let locks = RequestLocks::new(guard.map(|g| (backend_id, g)));
        let future = locks.enter(|| service.call(request));
        State::Running { future, locks }
    }
}

struct Pending<S, ReqBody> {
    config: Arc<Config>,
    /// Whether the caller's deadline set the wait.
    by_deadline: bool,
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

    /// Calls `service` with `request` under `guard` (see [`State::call`]).
    pub(crate) fn call(
        service: &mut S,
        request: Request<ReqBody>,
        guard: Option<LockGuard>,
        config: &Config,
    ) -> Self {
        ResponseFuture {
            state: State::call(service, request, guard, config),
            policy: config.policy(),
        }
    }

    pub(crate) fn acquiring(
        lock: LockFuture,
        service: S,
        request: Request<ReqBody>,
        config: Arc<Config>,
        by_deadline: bool,
    ) -> Self {
        ResponseFuture {
            policy: config.policy(),
            state: State::Acquiring {
                pending: Box::new(Pending {
                    config,
                    by_deadline,
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
                            let running =
                                State::call(&mut service, request, Some(guard), &pending.config);
                            this.state.set(running);
                        }
                        Err(e) => {
                            let rejection = super::service::rejection(e, pending.by_deadline);
                            let response = pending.config.reject(&rejection);
                            this.state.set(State::Rejected {
                                response: Some(response),
                            });
                        }
                    }
                }
                StateProj::Running { future, locks } => {
                    let abort = this.policy.on_lost == OnLost::Abort;
                    let lost = locks.layer_lost().filter(|_| abort);
                    // One atomic load before the handler runs; a waker is
                    // registered only if the handler has to wait.
                    let result = 'run: {
                        if !lost.is_some_and(|l| l.is_lost()) {
                            match locks.enter(|| future.poll(cx)) {
                                Poll::Ready(result) => break 'run result,
                                Poll::Pending
                                    if lost.is_some_and(|l| l.poll_lost(cx).is_ready()) => {}
                                Poll::Pending => return Poll::Pending,
                            }
                        }
                        let guard = locks.take_layer();
                        let reason = guard.as_ref().and_then(|g| g.held().lost_signal().reason());
                        let reason = reason.unwrap_or("lock lost").to_owned();
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
                    // Kept for the body, or else released in place below:
                    // the guard is not moved out only to be dropped.
                    let guard = this.policy.hold_body.then(|| locks.take_layer()).flatten();
                    // Done: a further poll finds no future to resume. This
                    // drops the handler's future, then (fields drop in
                    // order) releases the lock the body does not hold, as
                    // soon as the response is ready.
                    this.state.set(State::Rejected { response: None });
                    let mut response = match result {
                        Ok(response) => response,
                        Err(e) => return Poll::Ready(Err(e)),
                    };
                    // A handler answered with a `LockError` (`?` on a
                    // `Locker` call): answer as the layer would.
                    if let Some(e) = response.extensions_mut().remove::<FromLockError>() {
                        let rejection = this.policy.reject(e.rejection());
                        response = rejection.map(ResBody::from_text);
                    }
                    return Poll::Ready(Ok(match guard {
                        Some(guard) => response.map(|body| body.holding(guard, abort)),
                        None => response,
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
