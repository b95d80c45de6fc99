//! The Tower middleware: [`LockLayer`] wraps a service in [`LockService`],
//! whose [`ResponseFuture`] acquires the request's lock, runs the inner
//! service while holding it, and releases it when the response is ready (or
//! its body sent, with [`LockLayer::hold_until_body_sent`]).

mod body;
mod config;
mod deadline;
mod future;
mod layer;
mod service;

pub use body::{LockBody, LockableBody};
pub use config::{OnLost, OnMissingKey};
pub use deadline::Deadline;
pub use future::ResponseFuture;
pub use layer::LockLayer;
pub use service::LockService;
