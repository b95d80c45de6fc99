//! Where the layer finds a request's key: [`KeySource`] and the built-ins
//! [`PathParam`], [`Header`], [`QueryParam`], or any closure over the request
//! head.

use std::borrow::Cow;
use std::fmt;

use http::header::HeaderName;
use http::request::Parts;

use crate::key::{KeyError, LockKey};

/// Finds the lock key in a request head.
///
/// Implemented by [`PathParam`], [`Header`], [`QueryParam`] and by closures
/// `Fn(&Parts) -> Option<String>` (return `None` for a missing key).
///
/// # Examples
///
/// ```
/// use http::request::Parts;
/// use tower_lock::{LockLayer, MemoryBackend};
///
/// // Lock per tenant and order, from two headers.
/// let layer = LockLayer::new(MemoryBackend::new(), |parts: &Parts| {
///     let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
///     let order = parts.headers.get("x-order")?.to_str().ok()?;
///     Some(format!("{tenant}.{order}"))
/// });
/// ```
pub trait KeySource: Send + Sync + 'static {
    /// The key text, before namespacing and validation; `Ok(None)` if the
    /// request does not carry it.
    ///
    /// # Errors
    ///
    /// [`KeyError`] if the key is present but unusable (not UTF-8).
    fn extract<'p>(&self, parts: &'p mut Parts) -> Result<Option<Cow<'p, str>>, KeyError>;

    /// Where the key comes from, for error messages: ``path parameter `sku` ``.
    fn describe(&self) -> Cow<'static, str>;

    /// The validated key under `namespace`; `Ok(None)` if the request does
    /// not carry it. The default builds it from [`extract`](Self::extract);
    /// override it to skip an intermediate copy.
    ///
    /// # Errors
    ///
    /// [`KeyError`] if the key is present but invalid.
    fn lock_key(&self, parts: &mut Parts, namespace: &str) -> Result<Option<LockKey>, KeyError> {
        match self.extract(parts)? {
            Some(raw) => LockKey::namespaced(namespace, &raw).map(Some),
            None => Ok(None),
        }
    }
}

impl<F> KeySource for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn extract<'p>(&self, parts: &'p mut Parts) -> Result<Option<Cow<'p, str>>, KeyError> {
        Ok(self(parts).map(Cow::Owned))
    }

    fn describe(&self) -> Cow<'static, str> {
        Cow::Borrowed("key function")
    }
}

/// The key is a request header's value.
///
/// # Examples
///
/// ```
/// use tower_lock::{Header, LockLayer, MemoryBackend};
///
/// let layer = LockLayer::new(MemoryBackend::new(), Header::new("x-account-id"));
/// ```
#[derive(Clone, Debug)]
pub struct Header(pub HeaderName);

impl Header {
    /// The header `name`.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid lower-case header name, as
    /// [`HeaderName::from_static`].
    pub fn new(name: &'static str) -> Self {
        Header(HeaderName::from_static(name))
    }
}

impl From<HeaderName> for Header {
    fn from(name: HeaderName) -> Self {
        Header(name)
    }
}

impl KeySource for Header {
    fn extract<'p>(&self, parts: &'p mut Parts) -> Result<Option<Cow<'p, str>>, KeyError> {
        match parts.headers.get(&self.0) {
            None => Ok(None),
            Some(v) => std::str::from_utf8(v.as_bytes())
                .map(|s| Some(Cow::Borrowed(s)))
                .map_err(|_| KeyError::NotUtf8),
        }
    }

    fn describe(&self) -> Cow<'static, str> {
        Cow::Owned(format!("header `{}`", self.0))
    }
}

/// The key is a query-string parameter, percent-decoded.
///
/// # Examples
///
/// ```
/// use tower_lock::{LockLayer, MemoryBackend, QueryParam};
///
/// // POST /checkout?cart=c-19 locks "c-19".
/// let layer = LockLayer::new(MemoryBackend::new(), QueryParam("cart"));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct QueryParam(pub &'static str);

impl KeySource for QueryParam {
    fn extract<'p>(&self, parts: &'p mut Parts) -> Result<Option<Cow<'p, str>>, KeyError> {
        let Some(query) = parts.uri.query() else {
            return Ok(None);
        };
        for pair in query.split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if decode_query(name).is_ok_and(|n| n == self.0) {
                return decode_query(value).map(Some);
            }
        }
        Ok(None)
    }

    fn describe(&self) -> Cow<'static, str> {
        Cow::Owned(format!("query parameter `{}`", self.0))
    }
}

/// Decodes one `application/x-www-form-urlencoded` component strictly:
/// `+` is a space, and percent-escapes must make UTF-8.
fn decode_query(raw: &str) -> Result<Cow<'_, str>, KeyError> {
    fn decode(s: &str) -> Result<Cow<'_, str>, KeyError> {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map_err(|_| KeyError::NotUtf8)
    }
    if raw.contains('+') {
        Ok(Cow::Owned(decode(&raw.replace('+', " "))?.into_owned()))
    } else {
        decode(raw)
    }
}

/// The key is a path parameter of the matched axum route, e.g. `sku` in
/// `/orders/{sku}`.
///
/// Add the layer inside the router, with `Router::route_layer`,
/// `Router::layer` or on the route itself: path parameters are known only
/// once a route has matched. Wrapped around the whole router, every request
/// gets a 500 that says so.
///
/// # Examples
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_lock::{LockLayer, MemoryBackend, PathParam};
///
/// let app: Router = Router::new()
///     .route("/orders/{sku}", post(|| async { "ok" }))
///     .route_layer(LockLayer::new(MemoryBackend::new(), PathParam("sku")));
/// ```
#[cfg(feature = "axum")]
#[derive(Clone, Copy, Debug)]
pub struct PathParam(pub &'static str);

#[cfg(feature = "axum")]
impl PathParam {
    /// Finds the parameter and hands its value to `f`.
    fn with_value<R>(
        &self,
        parts: &mut Parts,
        f: impl FnOnce(&str) -> Result<R, KeyError>,
    ) -> Result<Option<R>, KeyError> {
        use axum::extract::{rejection::RawPathParamsRejection, FromRequestParts, RawPathParams};
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        // The extractor reads the request extensions and never waits: one
        // poll finishes it.
        let mut fut = std::pin::pin!(RawPathParams::from_request_parts(parts, &()));
        let Poll::Ready(result) = fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) else {
            return Ok(None);
        };
        match result {
            Ok(params) => params
                .iter()
                .find(|(name, _)| *name == self.0)
                .map(|(_, value)| f(value))
                .transpose(),
            Err(RawPathParamsRejection::InvalidUtf8InPathParam(_)) => Err(KeyError::NotUtf8),
            // No route has matched yet: the layer wraps the router from
            // outside. Treating that as "no key" would, with pass-through,
            // lock nothing.
            Err(_) => Err(KeyError::Misconfigured(
                "no path parameters in this request: add the LockLayer inside the router, \
                 with `Router::route_layer` or `Router::layer`",
            )),
        }
    }
}

#[cfg(feature = "axum")]
impl KeySource for PathParam {
    fn extract<'p>(&self, parts: &'p mut Parts) -> Result<Option<Cow<'p, str>>, KeyError> {
        self.with_value(parts, |v| Ok(Cow::Owned(v.to_owned())))
    }

    fn describe(&self) -> Cow<'static, str> {
        Cow::Owned(format!("path parameter `{}`", self.0))
    }

    fn lock_key(&self, parts: &mut Parts, namespace: &str) -> Result<Option<LockKey>, KeyError> {
        self.with_value(parts, |v| LockKey::namespaced(namespace, v))
    }
}

impl fmt::Debug for dyn KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}
