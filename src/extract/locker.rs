use axum::extract::FromRequestParts;
use http::request::Parts;

use super::MissingLockExtension;
use crate::locker::Locker;

/// Extracts the [`Locker`] added with `.layer(axum::Extension(locker))`.
///
/// # Examples
///
/// ```
/// use axum::extract::Path;
/// use tower_lock::{LockError, Locker};
///
/// async fn transfer(locker: Locker, Path((from, to)): Path<(u64, u64)>) -> Result<String, LockError> {
///     let _both = locker.lock_all([format!("acct:{from}"), format!("acct:{to}")]).await?;
///     Ok(format!("moved money from {from} to {to}"))
/// }
/// ```
impl<S: Send + Sync> FromRequestParts<S> for Locker {
    type Rejection = MissingLockExtension;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Locker>()
            .cloned()
            .ok_or(MissingLockExtension { what: "Locker" })
    }
}
