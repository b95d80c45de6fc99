#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod backend;
mod error;
#[cfg(feature = "axum")]
pub mod extract;
mod guard;
mod key;
mod locker;
mod lost;
pub mod middleware;
mod mode;
mod rejection;
mod source;
mod token;

pub use backend::{Backend, MemoryBackend};
pub use error::{BoxError, LockError};
pub use guard::{HeldLock, LockGuard, LockSet};
pub use key::{KeyError, LockKey, MAX_KEY_LEN};
pub use locker::{BackendExt, IntoLockKey, LockAllBuilder, LockBuilder, LockFuture, Locker};
pub use lost::{HasLostState, Lost, LostSignal, LostState, LostTrigger};
pub use middleware::{LockBody, LockLayer, LockService, LockableBody, OnLost, OnMissingKey};
pub use mode::{LockMode, Wait};
pub use rejection::LockRejection;
#[cfg(feature = "axum")]
pub use source::PathParam;
pub use source::{Header, KeySource, QueryParam};
pub use token::FencingToken;
