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
/// | key present but invalid (see [`LockKey`](crate::LockKey): too long, `/`, control or invisible characters, blank, not UTF-8) or given twice with different values | 400 Bad Request |
/// | key busy ([`Wait::FailFast`](crate::Wait::FailFast)) or still held when the wait ran out | 423 Locked, with `Retry-After` |
/// | refused by admission control ([`LockError::Refused`]: too many waiters, or a predicted wait longer than the request's) | 423 Locked, with `Retry-After` from the expected wait |
/// | the request's deadline ([`LockLayer::deadline`](crate::LockLayer::deadline)) left no time to wait, or passed while it waited | 504 Gateway Timeout |
/// | the request's deadline header is malformed | 400 Bad Request |
/// | backend unreachable or failing | 503 Service Unavailable |
/// | lock lost while the request ran (lease or session gone) | 503 Service Unavailable |
/// | invalid mode (a semaphore of zero permits), backend configuration, a key source that cannot work where it is installed (`PathParam` outside the router), or a handler re-entering its request's lock in a mode that cannot share ([`LockError::Reentry`]) | 500 Internal Server Error |
///
/// Bodies are plain text saying what went wrong in words
/// ([`summary`](Self::summary)): "lock backend unavailable", "timed out
/// after 3000 ms waiting for the lock". Hosts, ports and driver text stay in
/// the [`LockError`] (its `Display` and source chain, for logs), unless the
/// layer is told to show them with
/// [`LockLayer::error_details`](crate::LockLayer::error_details); a URL's
/// user and password are never shown. Replace any of them with
/// [`LockLayer::on_rejection`](crate::LockLayer::on_rejection), or answer
/// as gRPC does with
/// [`LockLayer::grpc_rejections`](crate::LockLayer::grpc_rejections).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{LockError, LockRejection};
///
/// let rejection = LockRejection::Lock(LockError::Timeout { waited: Duration::from_secs(3) });
/// assert_eq!(rejection.status(), 423);
/// let response = rejection.to_response(Duration::from_secs(2));
/// assert_eq!(response.headers()["retry-after"], "2");
/// assert_eq!(response.body(), "timed out after 3000 ms waiting for the lock\n");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum LockRejection {
    /// The request did not carry the key.
    MissingKey {
        /// Where the key was looked for, e.g. ``path parameter `sku` ``.
        source: Cow<'static, str>,
        /// Why, when a [`KeyFn`](crate::KeyFn) said.
        reason: Option<Cow<'static, str>>,
    },
    /// The key in the request is not a valid lock key.
    InvalidKey {
        /// Where the key came from.
        source: Cow<'static, str>,
        /// What is wrong with it.
        error: KeyError,
        /// The key as the request gave it (before the namespace), when it
        /// could be read; at most 64 characters.
        value: Option<String>,
    },
    /// Acquiring (or keeping) the lock failed.
    Lock(LockError),
    /// The caller's deadline ([`LockLayer::deadline`](crate::LockLayer::deadline))
    /// left no time to wait for the lock, or passed while it waited.
    DeadlineExceeded {
        /// How long the request waited: zero when it was refused without
        /// asking the backend.
        waited: Duration,
    },
    /// The request's deadline could not be read.
    InvalidDeadline {
        /// Where the deadline was looked for, e.g. `` header `grpc-timeout` ``.
        source: Cow<'static, str>,
        /// What is wrong with it.
        reason: Cow<'static, str>,
    },
}

impl LockRejection {
    /// The response status.
    pub fn status(&self) -> StatusCode {
        match self {
            LockRejection::InvalidKey {
                error: KeyError::Misconfigured(_),
                ..
            } => StatusCode::INTERNAL_SERVER_ERROR,
            LockRejection::MissingKey { .. }
            | LockRejection::InvalidKey { .. }
            | LockRejection::InvalidDeadline { .. } => StatusCode::BAD_REQUEST,
            LockRejection::DeadlineExceeded { .. } => StatusCode::GATEWAY_TIMEOUT,
            LockRejection::Lock(e) => match e {
                LockError::InvalidKey(_) => StatusCode::BAD_REQUEST,
                LockError::Busy | LockError::Timeout { .. } | LockError::Refused { .. } => {
                    StatusCode::LOCKED
                }
                LockError::Lost(_) | LockError::Backend { .. } => StatusCode::SERVICE_UNAVAILABLE,
                LockError::InvalidMode(_)
                | LockError::Config(_)
                | LockError::Unsupported(_)
                | LockError::Reentry { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }

    /// Whether trying again later may help (the key was busy, the backend
    /// down, the lock lost), so that the answer says when.
    fn is_retryable(&self) -> bool {
        matches!(self, LockRejection::Lock(e) if e.is_retryable())
    }

    /// When to try again: the wait admission control expected (at most a
    /// minute: an estimate is no promise), or the layer's `retry_after`.
    fn retry_after(&self, configured: Duration) -> Duration {
        const MOST: Duration = Duration::from_secs(60);
        match self {
            LockRejection::Lock(LockError::Refused {
                expected_wait: Some(expected),
                ..
            }) => (*expected).min(MOST.max(configured)),
            _ => configured,
        }
    }

    /// The gRPC status code that stands for this rejection, as
    /// [`LockLayer::grpc_rejections`](crate::LockLayer::grpc_rejections)
    /// answers it:
    ///
    /// | HTTP status | gRPC status |
    /// |---|---|
    /// | 400 (key missing or invalid) | 3 `INVALID_ARGUMENT` |
    /// | 423 (key busy, wait ran out) | 10 `ABORTED`: a concurrency conflict; retry the call |
    /// | 423 (refused by admission control) | 8 `RESOURCE_EXHAUSTED` |
    /// | 504 (the call's deadline left no time, or passed) | 4 `DEADLINE_EXCEEDED` |
    /// | 503 (backend down, lock lost) | 14 `UNAVAILABLE` |
    /// | 500 (server misconfigured) | 13 `INTERNAL` |
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_lock::{LockError, LockRejection};
    ///
    /// assert_eq!(LockRejection::Lock(LockError::Busy).grpc_code(), 10);
    /// ```
    pub fn grpc_code(&self) -> u8 {
        if let LockRejection::Lock(LockError::Refused { .. }) = self {
            return 8;
        }
        match self.status() {
            StatusCode::GATEWAY_TIMEOUT => 4,
            StatusCode::BAD_REQUEST => 3,
            StatusCode::LOCKED => 10,
            StatusCode::SERVICE_UNAVAILABLE => 14,
            _ => 13,
        }
    }

    /// What happened, in words fit for any client: the whole message for
    /// what the request itself got wrong or must wait for (a missing or
    /// invalid key, a busy key, a wait that ran out), and no more than
    /// "lock backend unavailable", "lock lost while the request was served"
    /// or "lock backend misconfigured" for what went wrong behind the
    /// server, whose details (hosts, ports, driver text) are in
    /// [`Display`](fmt::Display).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_lock::{LockError, LockRejection};
    ///
    /// let down = LockError::backend("redis", "connecting to 10.0.0.7:6379", None);
    /// let rejection = LockRejection::Lock(down);
    /// assert_eq!(rejection.summary(), "lock backend unavailable");
    /// assert!(rejection.to_string().contains("10.0.0.7"));
    /// ```
    pub fn summary(&self) -> Cow<'_, str> {
        match self {
            LockRejection::Lock(LockError::Backend { .. }) => "lock backend unavailable".into(),
            LockRejection::Lock(LockError::Lost(_)) => {
                "lock lost while the request was served".into()
            }
            LockRejection::Lock(LockError::Config(_) | LockError::Unsupported(_)) => {
                "lock backend misconfigured".into()
            }
            LockRejection::Lock(LockError::InvalidMode(_)) => "invalid lock mode".into(),
            other => other.to_string().into(),
        }
    }

    /// The message a response carries: the [`summary`](Self::summary), or
    /// with `details` the whole (redacted) message.
    fn message(&self, details: bool) -> Cow<'_, str> {
        if details {
            self.to_string().into()
        } else {
            self.summary()
        }
    }

    /// This rejection as a gRPC "trailers-only" response: HTTP 200,
    /// `content-type: application/grpc`, `grpc-status` ([`grpc_code`](Self::grpc_code)),
    /// `grpc-message` (this rejection's [`summary`](Self::summary),
    /// percent-encoded as the gRPC spec asks), and, when trying again may help, `grpc-retry-pushback-ms`
    /// (`retry_after`, which gRPC clients with a retry policy honour). The
    /// body is empty.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_lock::{LockError, LockRejection};
    ///
    /// let res = LockRejection::Lock(LockError::Busy).to_grpc_response(Duration::from_secs(1));
    /// assert_eq!(res.status(), 200);
    /// assert_eq!(res.headers()["grpc-status"], "10");
    /// assert_eq!(res.headers()["grpc-message"], "lock is held by someone else");
    /// assert_eq!(res.headers()["grpc-retry-pushback-ms"], "1000");
    /// ```
    pub fn to_grpc_response(&self, retry_after: Duration) -> Response<Bytes> {
        self.grpc_response(retry_after, false)
    }

    pub(crate) fn grpc_response(&self, retry_after: Duration, details: bool) -> Response<Bytes> {
        use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
        // The spec: percent-encode everything outside printable ASCII, and `%`.
        const GRPC_MESSAGE: &AsciiSet = &CONTROLS.add(b'%');
        let mut res = Response::new(Bytes::new());
        let headers = res.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(
            "grpc-status",
            HeaderValue::from(u16::from(self.grpc_code())),
        );
        let message = utf8_percent_encode(&self.message(details), GRPC_MESSAGE).to_string();
        if let Ok(message) = HeaderValue::from_str(&message) {
            headers.insert("grpc-message", message);
        }
        if self.is_retryable() {
            let retry_after = self.retry_after(retry_after);
            let ms = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from(ms));
        }
        res
    }

    /// The default response: [`status`](Self::status), a plain-text body
    /// of this rejection's [`summary`](Self::summary), and `Retry-After`
    /// (whole seconds, at least one) when trying again may help.
    pub fn to_response(&self, retry_after: Duration) -> Response<Bytes> {
        self.response(retry_after, false)
    }

    pub(crate) fn response(&self, retry_after: Duration, details: bool) -> Response<Bytes> {
        let mut res = Response::new(Bytes::from(format!("{}\n", self.message(details))));
        *res.status_mut() = self.status();
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        if self.is_retryable() {
            let secs = self.retry_after(retry_after).as_secs_f64().ceil().max(1.0) as u64;
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

impl fmt::Display for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockRejection::MissingKey {
                source,
                reason: None,
            } => write!(f, "missing lock key: the request has no {source}"),
            LockRejection::MissingKey {
                source,
                reason: Some(why),
            } => write!(f, "missing lock key ({source}): {why}"),
            LockRejection::InvalidKey {
                source,
                error,
                value: Some(value),
            } => write!(f, "invalid lock key {value:?} in {source}: {error}"),
            LockRejection::InvalidKey {
                source,
                error,
                value: None,
            } => write!(f, "invalid lock key in {source}: {error}"),
            LockRejection::Lock(e) => fmt::Display::fmt(e, f),
            LockRejection::DeadlineExceeded { waited } if waited.is_zero() => {
                f.write_str("the request's deadline left no time to wait for the lock")
            }
            LockRejection::DeadlineExceeded { waited } => write!(
                f,
                "the request's deadline passed after {} ms waiting for the lock",
                waited.as_millis()
            ),
            LockRejection::InvalidDeadline { source, reason } => {
                write!(f, "invalid request deadline in {source}: {reason}")
            }
        }
    }
}

impl std::error::Error for LockRejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LockRejection::MissingKey { .. }
            | LockRejection::DeadlineExceeded { .. }
            | LockRejection::InvalidDeadline { .. } => None,
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

/// Marks a response made from a [`LockRejection`] outside the layer (a
/// handler's `?` on a [`LockError`], an extractor), so that a
/// [`LockLayer`](crate::LockLayer) around the handler answers it with its own
/// policy ([`on_rejection`](crate::LockLayer::on_rejection),
/// [`retry_after`](crate::LockLayer::retry_after), gRPC statuses).
#[derive(Clone)]
pub(crate) struct FromLockError(std::sync::Arc<LockRejection>);

impl FromLockError {
    pub(crate) fn rejection(&self) -> &LockRejection {
        &self.0
    }
}

/// Retry-After of rejections made outside the layer (extractors, `?` on a
/// [`LockError`] in a handler).
#[cfg(feature = "axum")]
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for LockRejection {
    fn into_response(self) -> axum::response::Response {
        let mut response = self
            .to_response(DEFAULT_RETRY_AFTER)
            .map(axum::body::Body::from);
        response
            .extensions_mut()
            .insert(FromLockError(std::sync::Arc::new(self)));
        response
    }
}

/// A handler can `?` a [`LockError`]: the response is the one the layer gives
/// for the same failure. Under a [`LockLayer`](crate::LockLayer), the layer's
/// [`on_rejection`](crate::LockLayer::on_rejection) and
/// [`retry_after`](crate::LockLayer::retry_after) apply to it too.
#[cfg(feature = "axum")]
impl axum::response::IntoResponse for LockError {
    fn into_response(self) -> axum::response::Response {
        LockRejection::Lock(self).into_response()
    }
}
