use std::fmt;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;

use crate::guard::HeldLock;

/// Rejection of the [`HeldLock`] and [`Locker`](crate::Locker) extractors when
/// the request holds no lock from a [`LockLayer`](crate::LockLayer) (it did
/// not pass through one, or the layer let it through unlocked: use
/// `Option<HeldLock>` there) or, for `Locker`, when no
/// `axum::Extension(locker)` was added: a server misconfiguration, answered
/// 500 with a body that says how to fix it.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use axum::body::Body;
/// use axum::http::{Request, StatusCode};
/// use axum::{routing::post, Router};
/// use tower::ServiceExt;
/// use tower_lock::HeldLock;
///
/// async fn create_order(held: HeldLock) -> String {
///     held.key().to_string()
/// }
///
/// // The route forgot its `route_layer(LockLayer::new(...))`:
/// let app = Router::new().route("/orders/{sku}", post(create_order));
/// let request = Request::post("/orders/sku-1").body(Body::empty()).unwrap();
/// let response = app.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
/// let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
/// assert_eq!(body, "no HeldLock in this request: add LockLayer to the route with `route_layer`\n");
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingLockExtension {
    pub(crate) what: &'static str,
}

impl fmt::Display for MissingLockExtension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.what {
            "HeldLock" => f.write_str(
                "no HeldLock in this request: add LockLayer to the route with `route_layer`",
            ),
            what => write!(
                f,
                "no {what} in this request: add one with `.layer(axum::Extension(locker))`"
            ),
        }
    }
}

impl std::error::Error for MissingLockExtension {}

impl IntoResponse for MissingLockExtension {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, format!("{self}\n")).into_response()
    }
}

/// Extracts the lock the [`LockLayer`](crate::LockLayer) holds for this
/// request.
///
/// # Examples
///
/// ```
/// use tower_lock::HeldLock;
///
/// async fn deduct_stock(held: HeldLock) -> String {
///     // Pass the fencing token to storage so a stale holder's write is refused.
///     format!("UPDATE stock SET n = n - 1, fence = {} WHERE fence < {}", held.token(), held.token())
/// }
/// ```
impl<S: Send + Sync> FromRequestParts<S> for HeldLock {
    type Rejection = MissingLockExtension;

    async fn from_request_parts(_parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        HeldLock::current().ok_or(MissingLockExtension { what: "HeldLock" })
    }
}

/// `Option<HeldLock>`: `None` on a route (or request) the layer did not lock,
/// e.g. with [`OnMissingKey::PassThrough`](crate::OnMissingKey::PassThrough).
///
/// # Examples
///
/// ```
/// use tower_lock::HeldLock;
///
/// async fn show_cart(held: Option<HeldLock>) -> String {
///     match held {
///         Some(held) => format!("cart {} (locked)", held.key()),
///         None => "no cart named: served unlocked".to_owned(),
///     }
/// }
/// ```
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for HeldLock {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        _parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(HeldLock::current())
    }
}
