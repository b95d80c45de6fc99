use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::{Config, OnLost};
use super::LockBody;
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::locker::LockFuture;
use crate::lost::LostSignal;
use crate::rejection::LockRejection;

pin_project! {
    /// Response future of [`LockService`](super::LockService): acquires the
    /// lock, runs the inner service, releases.
    ///
    /// Dropping it at any point (the client went away) withdraws the
    /// acquisition or releases the held lock.
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
        config: Arc<Config>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Rejected {
            rejection: Option<LockRejection>,
        },
        Acquiring {
            #[pin]
            lock: LockFuture,
            service: Option<S>,
            request: Option<Request<ReqBody>>,
        },
        Running {
            #[pin]
            future: S::Future,
            // Dropped after `future`: fields drop in order, so a handler that
            // is cancelled stops before its lock is released.
            guard: Option<LockGuard>,
            lost: LostSignal,
        },
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn rejected(rejection: LockRejection, config: Arc<Config>) -> Self {
        ResponseFuture {
            state: State::Rejected {
                rejection: Some(rejection),
            },
            config,
        }
    }

    pub(crate) fn unlocked(future: S::Future, config: Arc<Config>) -> Self {
        ResponseFuture {
            state: State::Running {
                future,
                guard: None,
                lost: LostSignal::never(),
            },
            config,
        }
    }

    pub(crate) fn acquiring(
        lock: LockFuture,
        service: S,
        request: Request<ReqBody>,
        config: Arc<Config>,
    ) -> Self {
        ResponseFuture {
            state: State::Acquiring {
                lock,
                service: Some(service),
                request: Some(request),
            },
            config,
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<LockBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Rejected { rejection } => {
                    let rejection = rejection
                        .take()
                        .expect("ResponseFuture polled after completion");
                    let response = this.config.reject(&rejection);
                    return Poll::Ready(Ok(response.map(LockBody::rejection)));
                }
                StateProj::Acquiring {
                    lock,
                    service,
                    request,
                } => match ready!(lock.poll(cx)) {
                    Ok(guard) => {
                        let mut request = request.take().expect("request present");
                        let mut service = service.take().expect("service present");
                        let lost = guard.held().lost_signal().clone();
                        request.extensions_mut().insert(guard.held().clone());
                        request.extensions_mut().insert(this.config.locker.clone());
                        let future = service.call(request);
                        this.state.set(State::Running {
                            future,
                            guard: Some(guard),
                            lost,
                        });
                    }
                    Err(e) => this.state.set(State::Rejected {
                        rejection: Some(LockRejection::Lock(e)),
                    }),
                },
                StateProj::Running {
                    future,
                    guard,
                    lost,
                } => {
                    if this.config.on_lost == OnLost::Abort && lost.poll_lost(cx).is_ready() {
                        let reason = lost.reason().unwrap_or("lock lost").to_owned();
                        let guard = guard.take();
                        tracing::warn!(
                            key = guard.as_ref().map(|g| g.key().as_str()),
                            reason,
                            "lock lost while the request ran; aborting it"
                        );
                        // Stop the handler first, then release.
                        this.state.set(State::Rejected {
                            rejection: Some(LockRejection::Lock(LockError::Lost(reason))),
                        });
                        drop(guard);
                        continue;
                    }
                    let result = ready!(future.poll(cx));
                    let guard = guard.take();
                    return Poll::Ready(result.map(|response| {
                        let guard = if this.config.hold_body { guard } else { None };
                        response.map(|body| LockBody::new(body, guard))
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
