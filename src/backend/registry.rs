//! Backends by URL scheme: one row each. A new backend adds its row here,
//! its folder under `backend/`, and its Cargo feature.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

#[cfg(all(doc, feature = "redis"))]
use super::redis::{redlock::RedlockBackend, RedisBackend};
use crate::error::LockError;
use crate::{Backend, MemoryBackend};

type Connected<'a> = Pin<Box<dyn Future<Output = Result<Arc<dyn Backend>, LockError>> + Send + 'a>>;

/// One URL scheme: the feature that builds its backend in, and how to
/// connect when it is built in.
struct Row {
    scheme: &'static str,
    feature: &'static str,
    connect: Option<for<'a> fn(&'a str) -> Connected<'a>>,
}

/// A row for `scheme`, connected by `$backend::connect(url)` when `feature`
/// is on.
macro_rules! row {
    ($scheme:literal, $feature:literal, $($backend:tt)::+) => {
        Row {
            scheme: $scheme,
            feature: $feature,
            #[cfg(feature = $feature)]
            connect: Some(|url| {
                Box::pin(async move {
                    let backend = $($backend)::+::connect(url).await?;
                    Ok(Arc::new(backend) as Arc<dyn Backend>)
                })
            }),
            #[cfg(not(feature = $feature))]
            connect: None,
        }
    };
}

/// Every scheme [`connect`] knows; `memory` is always there.
const REGISTRY: &[Row] = &[
    row!("redis", "redis", super::redis::RedisBackend),
    row!("rediss", "redis-tls", super::redis::RedisBackend),
    row!("redis+sentinel", "redis", super::redis::RedisBackend),
    row!("redis+cluster", "redis", super::redis::RedisBackend),
    row!("redlock", "redis", super::redis::redlock::RedlockBackend),
    row!(
        "redlocks",
        "redis-tls",
        super::redis::redlock::RedlockBackend
    ),
    row!("zk", "zookeeper", super::zookeeper::ZookeeperBackend),
    row!("postgres", "postgres", super::postgres::PostgresBackend),
    row!("postgresql", "postgres", super::postgres::PostgresBackend),
    row!("mysql", "mysql", super::mysql::MysqlBackend),
    row!("mariadb", "mysql", super::mysql::MysqlBackend),
    row!("etcd", "etcd", super::etcd::EtcdBackend),
];

/// Opens the backend a URL names, for services that take it from their
/// configuration.
///
/// | URL | backend |
/// |---|---|
/// | `memory` | [`MemoryBackend`] |
/// | `redis://host:port` | [`RedisBackend`], one instance (feature `redis`) |
/// | `rediss://host:port[/#insecure]` | [`RedisBackend`] over TLS (feature `redis-tls`) |
/// | `redis+sentinel://s1:p1,s2:p2,s3:p3/master` | [`RedisBackend`] on the master Sentinel names, following failovers (feature `redis`) |
/// | `redis+cluster://h1:p1,h2:p2,h3:p3` | [`RedisBackend`] on a Redis Cluster, each key on its slot's master (feature `redis`) |
/// | `redlock://h1:p1,h2:p2,h3:p3` | [`RedlockBackend`] (feature `redis`) |
/// | `redlocks://h1:p1,h2:p2,h3:p3[#insecure]` | [`RedlockBackend`] over TLS (feature `redis-tls`) |
/// | `zk://host:port[,host:port...][/root]` | ZooKeeper (feature `zookeeper`) |
/// | `postgres://user@host:port/db` (or `postgresql://`) | PostgreSQL advisory locks, or rows of a lease table with `?lease_table[=name]`; `?sequence=name` names the token sequence (feature `postgres`) |
/// | `mysql://user@host:port/db` (or `mariadb://`) | MariaDB `GET_LOCK`; `?sequence=name` names the token sequence (feature `mysql`) |
/// | `etcd://host:port[,host:port...][/root]` | etcd's lock protocol (feature `etcd`) |
///
/// # Errors
///
/// [`LockError::Config`] for a URL this build cannot open, saying why.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let backend = tower_lock::backend::connect("memory").await.unwrap();
/// assert_eq!(backend.name(), "memory");
/// assert!(tower_lock::backend::connect("carrier-pigeon://").await.is_err());
/// # }
/// ```
///
/// The backend goes wherever one is taken, the layer included:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::{LockLayer, Locker, PathParam};
///
/// let url = "memory"; // or "redis://127.0.0.1:6379", "zk://127.0.0.1:2181/locks", ...
/// let backend = tower_lock::backend::connect(url).await?;
/// let layer = LockLayer::new(backend.clone(), PathParam("sku"));
/// let locker = Locker::from_arc(backend);
/// # Ok(()) }
/// ```
// Without the feature, the backends' links go to docs.rs.
#[cfg_attr(
    not(feature = "redis"),
    doc = "",
    doc = "[`RedisBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/redis/type.RedisBackend.html",
    doc = "[`RedlockBackend`]: https://docs.rs/tower-lock/latest/tower_lock/backend/redis/redlock/type.RedlockBackend.html"
)]
pub async fn connect(url: &str) -> Result<Arc<dyn Backend>, LockError> {
    let scheme = url.split_once("://").map_or(url, |(scheme, _)| scheme);
    if scheme == "memory" {
        return Ok(Arc::new(MemoryBackend::new()));
    }
    match REGISTRY.iter().find(|row| row.scheme == scheme) {
        Some(Row {
            connect: Some(connect),
            ..
        }) => connect(url).await,
        Some(row) => Err(LockError::Config(format!(
            "the `{scheme}` backend needs tower-lock's `{}` feature",
            row.feature
        ))),
        None => {
            let known: Vec<String> = REGISTRY
                .iter()
                .map(|r| format!("`{}://`", r.scheme))
                .collect();
            Err(LockError::Config(format!(
                "unknown backend URL {url:?}: expected `memory` or one of {}",
                known.join(", ")
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn config_error(url: &str) -> String {
        match connect(url).await {
            Err(LockError::Config(message)) => message,
            Err(other) => panic!("expected a config error for {url}, got {other}"),
            Ok(_) => panic!("expected a config error for {url}"),
        }
    }

    #[tokio::test]
    async fn an_unknown_scheme_lists_the_known_ones_and_a_missing_feature_is_named() {
        let unknown = config_error("carrier-pigeon://coop").await;
        assert!(unknown.contains("`memory`"), "{unknown}");
        for row in REGISTRY {
            assert!(
                unknown.contains(&format!("`{}://`", row.scheme)),
                "{unknown}"
            );
            if row.connect.is_none() {
                let missing = config_error(&format!("{}://127.0.0.1:1", row.scheme)).await;
                assert!(
                    missing.contains(&format!("`{}` feature", row.feature)),
                    "{missing}"
                );
            }
        }
        assert_eq!(connect("memory").await.unwrap().name(), "memory");
    }
}
