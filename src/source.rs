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
/// Implemented by `PathParam` (feature `axum`), [`Header`], [`QueryParam`], by closures
/// `Fn(&Parts) -> Option<String>` (return `None` for a missing key), and by
/// [`KeyFn`], a closure that can say why a request has no usable key.
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

/// A key source from a closure that says why a request has no usable key:
/// return [`KeyError::missing`] (handled as a missing key: 400, or no lock
/// with [`OnMissingKey::PassThrough`](crate::OnMissingKey::PassThrough)) or
/// [`KeyError::refused`] (400); the reason is the client's answer.
///
/// # Examples
///
/// ```
/// use http::request::Parts;
/// use tower_lock::{KeyError, KeyFn, LockLayer, MemoryBackend};
///
/// let source = KeyFn::new("headers `x-tenant` and `x-order`", |parts: &Parts| {
///     let header = |name| parts.headers.get(name).and_then(|v| v.to_str().ok());
///     let tenant = header("x-tenant").ok_or(KeyError::missing("no x-tenant header"))?;
///     let order = header("x-order").ok_or(KeyError::missing("no x-order header"))?;
///     if !order.bytes().all(|b| b.is_ascii_digit()) {
///         return Err(KeyError::refused(format!("order {order:?} is not a number")));
///     }
///     Ok(format!("{tenant}.{order}"))
/// });
/// let layer = LockLayer::new(MemoryBackend::new(), source);
/// ```
pub struct KeyFn<F> {
    describe: Cow<'static, str>,
    f: F,
}

impl<F> KeyFn<F>
where
    F: Fn(&Parts) -> Result<String, KeyError> + Send + Sync + 'static,
{
    /// A key source calling `f`; `describe` says where it looks, for error
    /// messages (e.g. ``header `x-tenant` ``).
    pub fn new(describe: impl Into<Cow<'static, str>>, f: F) -> Self {
        KeyFn {
            describe: describe.into(),
            f,
        }
    }
}

impl<F> KeySource for KeyFn<F>
where
    F: Fn(&Parts) -> Result<String, KeyError> + Send + Sync + 'static,
{
    fn extract<'p>(&self, parts: &'p mut Parts) -> Result<Option<Cow<'p, str>>, KeyError> {
        match (self.f)(parts) {
            Ok(key) => Ok(Some(Cow::Owned(key))),
            Err(e) => Err(e),
        }
    }

    fn describe(&self) -> Cow<'static, str> {
        self.describe.clone()
    }
}

impl<F> fmt::Debug for KeyFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeyFn").field(&self.describe).finish()
    }
}

/// The key is a request header's value.
///
/// A request that repeats the header with different values is refused (400):
/// two replicas behind different proxies could otherwise lock different keys.
///
/// # Examples
///
/// ```
/// use tower_lock::{Header, LockLayer, MemoryBackend};
///
/// let layer = LockLayer::new(MemoryBackend::new(), Header::new("X-Account-Id"));
/// ```
#[derive(Clone, Debug)]
pub struct Header(pub HeaderName);

impl Header {
    /// The header `name`, in any case (header names are case-insensitive).
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name (empty, or with a space or other
    /// character HTTP does not allow): it is fixed when the service is built,
    /// so the mistake shows at start-up. [`Header::try_new`] returns the
    /// error instead.
    pub fn new(name: &str) -> Self {
        match Self::try_new(name) {
            Ok(header) => header,
            Err(e) => panic!("invalid header name {name:?} for a lock key: {e}"),
        }
    }

    /// The header `name`, in any case.
    ///
    /// # Errors
    ///
    /// If `name` is not a valid header name.
    pub fn try_new(name: &str) -> Result<Self, http::header::InvalidHeaderName> {
        HeaderName::from_bytes(name.as_bytes()).map(Header)
    }
}

impl From<HeaderName> for Header {
    fn from(name: HeaderName) -> Self {
        Header(name)
    }
}

impl KeySource for Header {
    fn extract<'p>(&self, parts: &'p mut Parts) -> Result<Option<Cow<'p, str>>, KeyError> {
        let all = parts.headers.get_all(&self.0);
        let mut values = all.iter();
        let Some(v) = values.next() else {
            return Ok(None);
        };
        if values.any(|other| other != v) {
            let count = all.iter().count();
            return Err(KeyError::Repeated { count });
        }
        std::str::from_utf8(v.as_bytes())
            .map(|s| Some(Cow::Borrowed(s)))
            .map_err(|_| KeyError::NotUtf8)
    }

    fn describe(&self) -> Cow<'static, str> {
        Cow::Owned(format!("header `{}`", self.0))
    }
}

/// The key is a query-string parameter, percent-decoded.
///
/// A query that repeats the parameter with different values is refused
/// (400), rather than lock the first and serve a handler that reads another.
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
        let mut values = query.split('&').filter_map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            decode_query(name)
                .is_ok_and(|n| n == self.0)
                .then_some(value)
        });
        let Some(first) = values.next() else {
            return Ok(None);
        };
        let key = decode_query(first)?;
        let mut count = 1;
        let mut differ = false;
        for other in values {
            count += 1;
            differ |= decode_query(other).map_or(true, |o| o != key);
        }
        if differ {
            return Err(KeyError::Repeated { count });
        }
        Ok(Some(key))
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
/// `Router::layer`, on the route itself or on its handler
/// (`Handler::layer`): path parameters are known only
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
        use axum::extract::path::ErrorKind;
        use axum::extract::rejection::PathRejection;
        use axum::extract::{FromRequestParts, Path};
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        path_value::WANTED.set(self.0);
        // The extractor reads the request extensions and never waits: one
        // poll finishes it.
        let mut fut = std::pin::pin!(Path::<path_value::Found>::from_request_parts(parts, &()));
        let Poll::Ready(result) = fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) else {
            return Ok(None);
        };
        match result {
            Ok(Path(found)) => found.as_str().map(f).transpose(),
            Err(PathRejection::FailedToDeserializePathParams(e))
                if matches!(e.kind(), ErrorKind::InvalidUtf8InPathParam { .. }) =>
            {
                Err(KeyError::NotUtf8)
            }
            // No route has matched yet: the layer wraps the router from
            // outside. Treating that as "no key" would, with pass-through,
            // lock nothing.
            Err(_) => Err(KeyError::Misconfigured(
                "no path parameters in this request: add the LockLayer inside the router, \
                 with `Router::route_layer`, `Router::layer` or `Handler::layer`",
            )),
        }
    }
}

/// One path parameter's value, read through axum's `Path` extractor, which
/// lends the parameters to a deserializer. `RawPathParams`, the plain way,
/// copies them all into a `Vec` first: an allocation and two reference
/// counts per parameter, on every request.
#[cfg(feature = "axum")]
mod path_value {
    use std::cell::Cell;
    use std::fmt;

    use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

    use crate::key::KeyText;

    thread_local! {
        /// The parameter the read on this thread looks for. `Path<T>` takes
        /// no seed, so the name comes this way; it is set just before the
        /// read, which runs at once on the same thread.
        pub(super) static WANTED: Cell<&'static str> = const { Cell::new("") };
    }

    /// The wanted parameter's value, if the route has it.
    pub(super) struct Found(Option<KeyText>);

    impl Found {
        pub(super) fn as_str(&self) -> Option<&str> {
            self.0.as_ref().map(KeyText::as_str)
        }
    }

    impl<'de> de::Deserialize<'de> for Found {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            deserializer.deserialize_map(FoundVisitor(WANTED.get()))
        }
    }

    struct FoundVisitor(&'static str);

    impl<'de> Visitor<'de> for FoundVisitor {
        type Value = Found;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("path parameters")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
            // The first parameter of that name, as `RawPathParams` would
            // find; the rest are not read (axum asks for no end of the map).
            while let Some(wanted) = map.next_key_seed(IsNamed(self.0))? {
                if wanted {
                    return Ok(Found(Some(KeyText::of(map.next_value::<&str>()?))));
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(Found(None))
        }
    }

    /// A parameter's name, read as whether it is the one wanted.
    struct IsNamed(&'static str);

    impl<'de> DeserializeSeed<'de> for IsNamed {
        type Value = bool;

        fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
            deserializer.deserialize_str(self)
        }
    }

    impl Visitor<'_> for IsNamed {
        type Value = bool;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a path parameter's name")
        }

        fn visit_str<E: de::Error>(self, name: &str) -> Result<bool, E> {
            Ok(name == self.0)
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
