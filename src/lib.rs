#![doc = include_str!("lib.md")]
// docs.rs (built with `--cfg docsrs`) shows the feature each backend needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
// Links to items behind features: to the item when it is built, to docs.rs
// otherwise (docs.rs builds with every feature).
#![doc = ""]
#![cfg_attr(
    feature = "redis",
    doc = "[`RedisBackend`]: backend::redis::RedisBackend",
    doc = "[`RedlockBackend`]: backend::redis::redlock::RedlockBackend"
)]
#![cfg_attr(
    not(feature = "redis"),
    doc = "[`RedisBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/redis/type.RedisBackend.html",
    doc = "[`RedlockBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/redis/redlock/type.RedlockBackend.html",
    doc = "[`backend::redis`]: https://docs.rs/tower-lock/latest/tower_lock/backend/redis/index.html",
    doc = "[`backend::redis::redlock`]: https://docs.rs/tower-lock/latest/tower_lock/backend/redis/redlock/index.html"
)]
#![cfg_attr(
    feature = "zookeeper",
    doc = "[`ZookeeperBackend`]: backend::zookeeper::ZookeeperBackend"
)]
#![cfg_attr(
    not(feature = "zookeeper"),
    doc = "[`ZookeeperBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/zookeeper/type.ZookeeperBackend.html",
    doc = "[`backend::zookeeper`]: https://docs.rs/tower-lock/latest/tower_lock/backend/zookeeper/index.html"
)]
#![cfg_attr(feature = "etcd", doc = "[`EtcdBackend`]: backend::etcd::EtcdBackend")]
#![cfg_attr(
    not(feature = "etcd"),
    doc = "[`EtcdBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/etcd/type.EtcdBackend.html"
)]
#![cfg_attr(
    feature = "mysql",
    doc = "[`MysqlBackend`]: backend::mysql::MysqlBackend"
)]
#![cfg_attr(
    not(feature = "mysql"),
    doc = "[`MysqlBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/mysql/type.MysqlBackend.html",
    doc = "[`backend::mysql`]: https://docs.rs/tower-lock/latest/tower_lock/backend/mysql/index.html"
)]
#![cfg_attr(
    feature = "postgres",
    doc = "[`PostgresBackend`]: backend::postgres::PostgresBackend"
)]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "[`PostgresBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/postgres/type.PostgresBackend.html",
    doc = "[`backend::postgres`]: https://docs.rs/tower-lock/latest/tower_lock/backend/postgres/index.html"
)]
#![cfg_attr(
    not(feature = "axum"),
    doc = "[`PathParam`]: https://docs.rs/tower-lock/latest/tower_lock/struct.PathParam.html",
    doc = "[`extract`]: https://docs.rs/tower-lock/latest/tower_lock/extract/index.html"
)]
#![warn(missing_docs)]
#![deny(unsafe_code)]

// The README's examples are compiled and run with the doctests too.
/// Items that only remote stores use: compiled with any of their features.
macro_rules! cfg_remote {
    ($($item:item)*) => {$(
        #[cfg(any(
            feature = "redis",
            feature = "zookeeper",
            feature = "postgres",
            feature = "mysql",
            feature = "etcd"
        ))]
        $item
    )*};
}

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod admin;
mod admission;
pub mod backend;
mod error;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod extract;
mod guard;
mod json;
mod key;
mod lock_future;
mod locker;
mod loom;
// The loom models, run by the `tower-lock-loom` member (src/loom/mod.rs).
#[cfg(loom)]
#[doc(hidden)]
pub use crate::loom::models as loom_models;
mod lost;
mod metrics;
mod middleware;
mod mode;
mod redact;
mod reentry;
mod rejection;
mod source;
mod sync;
mod token;

pub use backend::contract::Backend;
pub use backend::memory::MemoryBackend;
pub use error::{BoxError, LockError};
pub use guard::{HeldLock, LockGuard, LockSet};
pub use key::{KeyError, LockKey, MAX_KEY_LEN};
pub use lock_future::LockFuture;
pub use locker::{BackendExt, IntoLockKey, LockAllBuilder, LockBuilder, Locker};
pub use lost::{Lost, LostSignal};
pub use middleware::{
    Deadline, LockBody, LockLayer, LockService, LockableBody, OnLost, OnMissingKey, ResponseFuture,
};
pub use mode::{LockMode, Wait};
pub use rejection::LockRejection;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use source::PathParam;
pub use source::{Header, KeyFn, KeySource, QueryParam};
pub use token::FencingToken;
