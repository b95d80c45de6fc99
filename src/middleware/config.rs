//! What the layer was configured with, shared by the service and its
//! response futures: the layer builds it, the service reads it, the
//! futures keep the part they need ([`Policy`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Method, Response};

use super::Deadline;
use crate::locker::Locker;
use crate::mode::LockMode;
use crate::rejection::LockRejection;
use crate::source::KeySource;

/// What the layer does with a request that carries no key.
///
/// # Examples
///
/// ```
/// use tower_lock::{Header, LockLayer, MemoryBackend, OnMissingKey};
///
/// // Lock per tenant when the header is there; serve anonymous requests unlocked.
/// let layer = LockLayer::new(MemoryBackend::new(), Header::new("x-tenant"))
///     .on_missing_key(OnMissingKey::PassThrough);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnMissingKey {
    /// Answer 400 naming the missing key. The default.
    #[default]
    Reject,
    /// Serve the request without a lock.
    PassThrough,
}

/// What the layer does when a held lock is lost while the request runs.
///
/// # Examples
///
/// ```
/// use tower_lock::{LockLayer, MemoryBackend, OnLost, QueryParam};
///
/// // The handler checks `HeldLock::is_lost` itself before committing.
/// let layer = LockLayer::new(MemoryBackend::new(), QueryParam("order"))
///     .on_lost(OnLost::Continue);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnLost {
    /// Drop the inner future and answer 503, so no work goes on without the
    /// lock. The default. With
    /// [`hold_until_body_sent`](crate::LockLayer::hold_until_body_sent), a body still
    /// streaming ends in an error instead.
    ///
    /// The abort is prompt but not instantaneous: the signal wakes the
    /// request's task, which drops the handler at its next poll, while the
    /// lock may already have a new holder. Code that must never overlap
    /// passes the [fencing token](crate::FencingToken) to its storage.
    #[default]
    Abort,
    /// Let the request finish; the handler can still check
    /// [`HeldLock::is_lost`](crate::HeldLock::is_lost).
    Continue,
}

pub(crate) type RejectFn = dyn Fn(&LockRejection) -> Response<Bytes> + Send + Sync;
type ModeFn = dyn Fn(&Parts) -> LockMode + Send + Sync;

#[derive(Clone)]
pub(crate) enum ModeSelector {
    Fixed(LockMode),
    ByMethod,
    Custom(Arc<ModeFn>),
}

#[derive(Clone)]
pub(crate) struct Config {
    /// Holds the namespace, wait and lease too, so that the locker handed to
    /// handlers locks exactly what the layer locks.
    pub(crate) locker: Locker,
    pub(crate) source: Arc<dyn KeySource>,
    pub(crate) mode: ModeSelector,
    pub(crate) on_missing: OnMissingKey,
    pub(crate) on_lost: OnLost,
    pub(crate) hold_body: bool,
    /// Whether the request extensions get a copy of the `HeldLock`.
    pub(crate) held_lock_extension: bool,
    pub(crate) retry_after: Duration,
    /// Where requests say how long their callers will still wait.
    pub(crate) deadline: Option<Deadline>,
    pub(crate) grpc: bool,
    /// Whether default answers show the error's details.
    pub(crate) details: bool,
    pub(crate) reject: Option<Arc<RejectFn>>,
}

/// What a response future needs of the config after `call`.
#[derive(Clone)]
pub(crate) struct Policy {
    pub(crate) on_lost: OnLost,
    pub(crate) hold_body: bool,
    retry_after: Duration,
    grpc: bool,
    details: bool,
    reject: Option<Arc<RejectFn>>,
}

impl Policy {
    pub(crate) fn reject(&self, rejection: &LockRejection) -> Response<Bytes> {
        match &self.reject {
            Some(f) => f(rejection),
            None if self.grpc => rejection.grpc_response(self.retry_after, self.details),
            None => rejection.response(self.retry_after, self.details),
        }
    }
}

impl Config {
    pub(crate) fn policy(&self) -> Policy {
        Policy {
            on_lost: self.on_lost,
            hold_body: self.hold_body,
            retry_after: self.retry_after,
            grpc: self.grpc,
            details: self.details,
            reject: self.reject.clone(),
        }
    }

    pub(crate) fn mode_for(&self, parts: &Parts) -> LockMode {
        match &self.mode {
            ModeSelector::Fixed(m) => *m,
            ModeSelector::ByMethod => {
                if parts.method == Method::GET
                    || parts.method == Method::HEAD
                    || parts.method == Method::OPTIONS
                {
                    LockMode::Read
                } else {
                    LockMode::Write
                }
            }
            ModeSelector::Custom(f) => f(parts),
        }
    }

    pub(crate) fn reject(&self, rejection: &LockRejection) -> Response<Bytes> {
        self.policy().reject(rejection)
    }
}
