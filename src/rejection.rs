//! Turning a request that could not be locked into a response.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::error::LockError;
use crate::key::KeyError;

/// Why the [`LockLayer`](crate::LockLayer) answered instead of the service.
///
/// | case | status |
/// |---|---|
/// | key missing from the request | 400 Bad Request |
/// | key present but invalid (too long, `/`, `..`, control characters, not UTF-8) | 400 Bad Request |
/// | key busy ([`Wait::FailFast`](crate::Wait::FailFast)) or still held when the wait ran out | 423 Locked, with `Retry-After` |
/// | backend unreachable or failing | 503 Service Unavailable |
/// | lock lost while the request ran (lease or session gone) | 503 Service Unavailable |
/// | invalid mode (a semaphore of zero permits), backend configuration, or a key source that cannot work where it is installed (`PathParam` outside `route_layer`) | 500 Internal Server Error |
///
/// Bodies are plain text saying what went wrong. Replace any of them with
/// [`LockLayer::on_rejection`](crate::LockLayer::on_rejection).
#[derive(Debug)]
#[non_exhaustive]
pub enum LockRejection {
    /// The request did not carry the key.
    MissingKey {
        /// Where the key was looked for, e.g. ``path parameter `sku` ``.
        source: Cow<'static, str>,
    },
    /// The key in the request is not a valid lock key.
    InvalidKey {
        /// Where the key came from.
        source: Cow<'static, str>,
        /// What is wrong with it.
        error: KeyError,
    },
    /// Acquiring (or keeping) the lock failed.
    Lock(LockError),
}

impl LockRejection {
    /// The response status.
    pub fn status(&self) -> StatusCode {
        match self {
            LockRejection::InvalidKey {
                error: KeyError::Misconfigured(_),
                ..
            } => StatusCode::INTERNAL_SERVER_ERROR,
            LockRejection::MissingKey { .. } | LockRejection::InvalidKey { .. } => {
                StatusCode::BAD_REQUEST
            }
            LockRejection::Lock(e) => match e {
                LockError::InvalidKey(_) => StatusCode::BAD_REQUEST,
                LockError::Busy | LockError::Timeout { .. } => StatusCode::LOCKED,
                LockError::Lost(_) | LockError::Backend { .. } => StatusCode::SERVICE_UNAVAILABLE,
                LockError::InvalidMode(_) | LockError::Config(_) => {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            },
        }
    }

    /// The default response: [`status`](Self::status), a plain-text body
    /// of this rejection's message, and `Retry-After` (whole seconds, at least
    /// one) when trying again may help.
    pub fn to_response(&self, retry_after: Duration) -> Response<Bytes> {
        let mut res = Response::new(Bytes::from(format!("{self}\n")));
        *res.status_mut() = self.status();
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        let retryable = matches!(self, LockRejection::Lock(e) if e.is_retryable());
        if retryable {
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

impl fmt::Display for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockRejection::MissingKey { source } => {
                write!(f, "missing lock key: the request has no {source}")
            }
            LockRejection::InvalidKey { source, error } => {
                write!(f, "invalid lock key in {source}: {error}")
            }
            LockRejection::Lock(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl std::error::Error for LockRejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LockRejection::MissingKey { .. } => None,
            LockRejection::InvalidKey { error, .. } => Some(error),
            LockRejection::Lock(e) => Some(e),
        }
    }
}

impl From<LockError> for LockRejection {
    fn from(e: LockError) -> Self {
        LockRejection::Lock(e)
    }
}

/// Retry-After of rejections made outside the layer (extractors, `?` on a
/// [`LockError`] in a handler).
#[cfg(feature = "axum")]
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for LockRejection {
    fn into_response(self) -> axum::response::Response {
        self.to_response(DEFAULT_RETRY_AFTER)
            .map(axum::body::Body::from)
    }
}

/// A handler can `?` a [`LockError`]: the response is the one the layer gives
/// for the same failure.
#[cfg(feature = "axum")]
impl axum::response::IntoResponse for LockError {
    fn into_response(self) -> axum::response::Response {
        LockRejection::Lock(self).into_response()
    }
}
