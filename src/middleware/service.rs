use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::layer::{Config, OnMissingKey};
use super::{LockableBody, ResponseFuture};
use crate::guard::LockGuard;
use crate::locker::LockFuture;
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
        let (mut parts, body) = req.into_parts();
        let key = match config.source.lock_key(&mut parts, &config.namespace) {
            Ok(Some(key)) => key,
            Ok(None) if config.on_missing == OnMissingKey::PassThrough => {
                let future = self.inner.call(Request::from_parts(parts, body));
                return ResponseFuture::running(future, None, config);
            }
            Ok(None) => {
                let source = config.source.describe();
                return ResponseFuture::rejected(LockRejection::MissingKey { source }, config);
            }
            Err(error) => {
                let source = config.source.describe();
                return ResponseFuture::rejected(
                    LockRejection::InvalidKey { source, error },
                    config,
                );
            }
        };

        let mode = config.mode_for(&parts);
        let backend = &**config.locker.backend();
        let mut lock = LockFuture::start(backend, key, mode, config.wait, None, config.lease);
        match lock.try_ready() {
            // Granted at once (uncontended memory backend): `self.inner` was
            // made ready by `poll_ready`, so call it now.
            Some(Ok(guard)) => {
                let request = with_lock(Request::from_parts(parts, body), &guard);
                let future = self.inner.call(request);
                ResponseFuture::running(future, Some(guard), config)
            }
            Some(Err(e)) => ResponseFuture::rejected(LockRejection::Lock(e), config),
            None => {
                // The ready instance goes into the future, to be called once
                // the lock is held; a clone takes its place here.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::acquiring(
                    lock,
                    inner,
                    Request::from_parts(parts, body),
                    self.config.clone(),
                )
            }
        }
    }
}

/// Puts the held lock in the request extensions, for the `HeldLock`
/// extractor.
pub(crate) fn with_lock<B>(mut request: Request<B>, guard: &LockGuard) -> Request<B> {
    request.extensions_mut().insert(guard.held().clone());
    request
}
