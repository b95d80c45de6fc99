//! [`Deadline`]: how long the caller will still wait, read from the request,
//! so that the layer does not wait for a lock past it.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::request::Parts;

type DeadlineFn = dyn Fn(&Parts) -> Result<Option<Duration>, Cow<'static, str>> + Send + Sync;

/// Where a request says how long its caller will still wait, for
/// [`LockLayer::deadline`](crate::LockLayer::deadline): the layer then waits
/// for the lock no longer than that, less a [reserve](Self::reserve) kept
/// for the handler, and refuses at once a request with no time left.
///
/// | source | the request says | without it |
/// |---|---|---|
/// | [`grpc_timeout`](Self::grpc_timeout) | `grpc-timeout: 500m` (gRPC's format: up to 8 digits and a unit, `H` `M` `S` `m` `u` `n`) | the layer's wait |
/// | [`header_millis`](Self::header_millis) | e.g. `x-request-timeout-ms: 1500` (whole milliseconds, as Envoy's `x-envoy-expected-rq-timeout-ms`) | the layer's wait |
/// | [`from_fn`](Self::from_fn) | whatever the closure reads | the layer's wait when it returns `None` |
///
/// A value that cannot be read is answered 400 (gRPC `INVALID_ARGUMENT`),
/// saying which header and why: a caller that sends a deadline means it,
/// and a typo silently ignored would wait the layer's whole wait.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{Deadline, Header, LockLayer, MemoryBackend};
///
/// // A gRPC service: wait no longer than the call's deadline, keeping
/// // 50 ms of it for the handler.
/// let layer = LockLayer::new(MemoryBackend::new(), Header::new("x-account-id"))
///     .grpc_rejections()
///     .deadline(Deadline::grpc_timeout().reserve(Duration::from_millis(50)));
/// ```
#[derive(Clone)]
pub struct Deadline {
    source: Source,
    reserve: Duration,
}

#[derive(Clone)]
enum Source {
    GrpcTimeout,
    HeaderMillis(HeaderName),
    Fn(Arc<DeadlineFn>),
}

impl Deadline {
    /// The `grpc-timeout` request header, as gRPC clients send it.
    pub fn grpc_timeout() -> Self {
        Self::new(Source::GrpcTimeout)
    }

    /// A header holding the time left in whole milliseconds; its name in
    /// any case.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name.
    pub fn header_millis(name: &str) -> Self {
        let name = HeaderName::from_bytes(name.as_bytes())
            .unwrap_or_else(|_| panic!("{name:?} is not a valid header name"));
        Self::new(Source::HeaderMillis(name))
    }

    /// The time left as a closure reads it from the request: `Ok(None)` for
    /// no deadline, `Err(why)` for a value that cannot be read (answered
    /// 400).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, SystemTime, UNIX_EPOCH};
    /// use tower_lock::{Deadline, LockLayer, MemoryBackend, QueryParam};
    ///
    /// // An absolute deadline in Unix milliseconds.
    /// let deadline = Deadline::from_fn(|parts| {
    ///     let Some(v) = parts.headers.get("x-deadline-unix-ms") else { return Ok(None) };
    ///     let at: u64 = v.to_str().ok().and_then(|v| v.parse().ok()).ok_or("not a number")?;
    ///     let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    ///     Ok(Some(Duration::from_millis(at).saturating_sub(now)))
    /// });
    /// let layer = LockLayer::new(MemoryBackend::new(), QueryParam("cart")).deadline(deadline);
    /// ```
    pub fn from_fn(
        f: impl Fn(&Parts) -> Result<Option<Duration>, Cow<'static, str>> + Send + Sync + 'static,
    ) -> Self {
        Self::new(Source::Fn(Arc::new(f)))
    }

    fn new(source: Source) -> Self {
        Deadline {
            source,
            reserve: Duration::ZERO,
        }
    }

    /// Keeps `reserve` of the caller's time for the handler: the wait ends
    /// that much before the deadline, and a request with no more than
    /// `reserve` left is refused at once. Default: none.
    pub fn reserve(mut self, reserve: Duration) -> Self {
        self.reserve = reserve;
        self
    }

    /// Where the deadline is read, for messages.
    pub(crate) fn describe(&self) -> Cow<'static, str> {
        match &self.source {
            Source::GrpcTimeout => "header `grpc-timeout`".into(),
            Source::HeaderMillis(name) => format!("header `{name}`").into(),
            Source::Fn(_) => "the request".into(),
        }
    }

    /// How long the lock may be waited for: `None` when the request sets
    /// no deadline, zero when it leaves no time.
    pub(crate) fn wait_left(&self, parts: &Parts) -> Result<Option<Duration>, Cow<'static, str>> {
        let left = match &self.source {
            Source::GrpcTimeout => match parts.headers.get("grpc-timeout") {
                None => None,
                Some(v) => Some(parse_grpc_timeout(v.as_bytes())?),
            },
            Source::HeaderMillis(name) => match parts.headers.get(name) {
                None => None,
                Some(v) => Some(parse_millis(v.as_bytes())?),
            },
            Source::Fn(f) => f(parts)?,
        };
        Ok(left.map(|left| left.saturating_sub(self.reserve)))
    }
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deadline")
            .field("source", &self.describe())
            .field("reserve", &self.reserve)
            .finish()
    }
}

/// gRPC's `TimeoutValue TimeoutUnit`: 1 to 8 ASCII digits, then one of
/// `H` `M` `S` `m` `u` `n`.
fn parse_grpc_timeout(v: &[u8]) -> Result<Duration, Cow<'static, str>> {
    const FORMAT: &str = "expected 1 to 8 digits and a unit (H, M, S, m, u or n), e.g. `500m`";
    let Some((&unit, digits)) = v.split_last() else {
        return Err(FORMAT.into());
    };
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(FORMAT.into());
    }
    let n = digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Ok(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return Err(FORMAT.into()),
    })
}

/// Whole milliseconds, ASCII digits only.
fn parse_millis(v: &[u8]) -> Result<Duration, Cow<'static, str>> {
    const FORMAT: &str = "expected whole milliseconds, e.g. `1500`";
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return Err(FORMAT.into());
    }
    let n = v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Ok(Duration::from_millis(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_as_grpc_writes_them() {
        let ok = [
            ("1H", Duration::from_secs(3600)),
            ("2M", Duration::from_secs(120)),
            ("3S", Duration::from_secs(3)),
            ("500m", Duration::from_millis(500)),
            ("99999999u", Duration::from_micros(99_999_999)),
            ("0n", Duration::ZERO),
        ];
        for (text, want) in ok {
            assert_eq!(parse_grpc_timeout(text.as_bytes()), Ok(want), "{text}");
        }
        for bad in [
            "",
            "m",
            "500",
            "123456789m",
            "5x",
            "-5m",
            "5 m",
            "５m",
            "1.5S",
        ] {
            assert!(parse_grpc_timeout(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn millisecond_headers_take_digits_only() {
        assert_eq!(parse_millis(b"1500"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_millis(b"0"), Ok(Duration::ZERO));
        for bad in ["", "1.5", "-1", "1e3", " 10", "99999999999999999999"] {
            assert!(parse_millis(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }
}
