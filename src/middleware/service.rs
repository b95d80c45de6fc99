use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::layer::{Config, OnMissingKey};
use super::{LockBody, ResponseFuture};
use crate::key::LockKey;
use crate::locker::LockFuture;
use crate::mode::Wait;
use crate::rejection::LockRejection;

/// The service [`LockLayer`](super::LockLayer) makes: locks each request's key
/// around the inner service.
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: Body<Data = Bytes>,
{
    type Response = Response<LockBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The inner service was made ready by `poll_ready`: that instance goes
        // into the future, to be called once the lock is held.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = &self.config;

        let (mut parts, body) = req.into_parts();
        let key = match config.source.extract(&mut parts) {
            Ok(Some(raw)) => LockKey::namespaced(&config.namespace, &raw).map_err(|error| {
                LockRejection::InvalidKey {
                    source: config.source.describe(),
                    error,
                }
            }),
            Ok(None) => Err(LockRejection::MissingKey {
                source: config.source.describe(),
            }),
            Err(error) => Err(LockRejection::InvalidKey {
                source: config.source.describe(),
                error,
            }),
        };
        let key = match key {
            Ok(key) => key,
            Err(LockRejection::MissingKey { .. })
                if config.on_missing == OnMissingKey::PassThrough =>
            {
                parts.extensions.insert(config.locker.clone());
                let future = inner.call(Request::from_parts(parts, body));
                return ResponseFuture::unlocked(future, self.config.clone());
            }
            Err(rejection) => return ResponseFuture::rejected(rejection, self.config.clone()),
        };

        let mode = config.mode_for(&parts);
        let started = Instant::now();
        let deadline = match config.wait {
            Wait::Timeout(d) => started.checked_add(d),
            Wait::FailFast | Wait::Forever => None,
        };
        let lock = LockFuture::start(
            &**config.locker.backend(),
            key,
            mode,
            config.wait,
            deadline,
            config.lease,
            started,
        );
        ResponseFuture::acquiring(
            lock,
            inner,
            Request::from_parts(parts, body),
            self.config.clone(),
        )
    }
}
