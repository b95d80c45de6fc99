//! The URLs of Redis deployments with more than one server: Sentinel
//! (which Sentinels, which master) and Cluster (which nodes to start from),
//! each with how many replicas a write waits for. Following the master is
//! `master.rs`; the cluster connection is the `redis` crate's.

use std::time::Duration;

use redis::{ProtocolVersion, RedisConnectionInfo};

use super::replicas::Replicas;
use crate::error::LockError;

pub(super) const SENTINEL: &str = "redis+sentinel://";
pub(super) const CLUSTER: &str = "redis+cluster://";

/// A `redis+sentinel://` URL, taken apart.
#[derive(Debug)]
pub(super) struct SentinelUrl {
    /// The Sentinels' `host:port`s.
    pub(super) sentinels: Vec<String>,
    /// The name the Sentinels monitor the master under.
    pub(super) master: String,
    /// Database, user and password for the Redis servers (not for the
    /// Sentinels), and RESP3.
    pub(super) redis: RedisConnectionInfo,
    /// `?wait_replicas=N&wait_timeout_ms=T`.
    pub(super) wait: Option<Replicas>,
}

/// Parses `redis+sentinel://[user[:password]@]host:port[,host:port...]/master[/db][?wait_replicas=N[&wait_timeout_ms=T]]`.
pub(super) fn parse_sentinel(url: &str) -> Result<SentinelUrl, LockError> {
    let bad = |why: &str| {
        LockError::Config(format!(
            "{why}: a Sentinel URL looks like \
             redis+sentinel://[user[:password]@]host:port[,host:port...]/master[/db]\
             [?wait_replicas=N&wait_timeout_ms=T], not {url:?}"
        ))
    };
    let rest = url
        .strip_prefix(SENTINEL)
        .ok_or_else(|| bad("not a redis+sentinel:// URL"))?;
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = rest.split_once('/').ok_or_else(|| bad("no master name"))?;
    let (user_info, hosts) = authority
        .rsplit_once('@')
        .map_or((None, authority), |(u, h)| (Some(u), h));
    let sentinels = host_ports(hosts).ok_or_else(|| bad("each Sentinel is host:port"))?;
    let (master, db) = path.split_once('/').unwrap_or((path, ""));
    if master.is_empty() {
        return Err(bad("no master name"));
    }
    let mut redis = resp3();
    if !db.is_empty() {
        let db: i64 = db.parse().map_err(|_| bad("the database is a number"))?;
        redis = redis.set_db(db);
    }
    let redis = with_user(redis, user_info);
    let wait = wait_params(query, &bad)?;
    Ok(SentinelUrl {
        sentinels,
        master: master.to_owned(),
        redis,
        wait,
    })
}

/// A `redis+cluster://` URL, taken apart.
#[derive(Debug)]
pub(super) struct ClusterUrl {
    /// The `host:port`s of the nodes to learn the cluster from.
    pub(super) nodes: Vec<String>,
    /// User and password for every node, and RESP3.
    pub(super) redis: RedisConnectionInfo,
    /// `?wait_replicas=N&wait_timeout_ms=T`.
    pub(super) wait: Option<Replicas>,
}

/// Parses `redis+cluster://[user[:password]@]host:port[,host:port...][/][?wait_replicas=N[&wait_timeout_ms=T]]`.
pub(super) fn parse_cluster(url: &str) -> Result<ClusterUrl, LockError> {
    let bad = |why: &str| {
        LockError::Config(format!(
            "{why}: a Redis Cluster URL looks like \
             redis+cluster://[user[:password]@]host:port[,host:port...]\
             [?wait_replicas=N&wait_timeout_ms=T], not {url:?}"
        ))
    };
    let rest = url
        .strip_prefix(CLUSTER)
        .ok_or_else(|| bad("not a redis+cluster:// URL"))?;
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = match rest.split_once('/') {
        None | Some((_, "")) => rest.trim_end_matches('/'),
        Some(_) => return Err(bad("a cluster has no databases but 0, and no path")),
    };
    let (user_info, hosts) = authority
        .rsplit_once('@')
        .map_or((None, authority), |(u, h)| (Some(u), h));
    let nodes = host_ports(hosts).ok_or_else(|| bad("each node is host:port"))?;
    Ok(ClusterUrl {
        nodes,
        redis: with_user(resp3(), user_info),
        wait: wait_params(query, &bad)?,
    })
}

fn resp3() -> RedisConnectionInfo {
    RedisConnectionInfo::default().set_protocol(ProtocolVersion::RESP3)
}

/// `h1:p1,h2:p2...`, or `None` if one is not `host:port`.
fn host_ports(hosts: &str) -> Option<Vec<String>> {
    let all: Vec<String> = hosts.split(',').map(str::to_owned).collect();
    let valid = all.iter().all(|h| {
        h.rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
    });
    valid.then_some(all)
}

/// The `user:password` before the `@`, percent-decoded.
fn with_user(mut redis: RedisConnectionInfo, user_info: Option<&str>) -> RedisConnectionInfo {
    if let Some(user_info) = user_info {
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        let (user, password) = user_info.split_once(':').unwrap_or((user_info, ""));
        if !user.is_empty() {
            redis = redis.set_username(decode(user));
        }
        if !password.is_empty() {
            redis = redis.set_password(decode(password));
        }
    }
    redis
}

/// `wait_replicas=N&wait_timeout_ms=T` (100 ms unless given); 0 replicas is none.
fn wait_params(
    query: &str,
    bad: &dyn Fn(&str) -> LockError,
) -> Result<Option<Replicas>, LockError> {
    let (mut replicas, mut timeout) = (None, Duration::from_millis(100));
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("wait_replicas", n)) => {
                let n: u32 = n.parse().map_err(|_| bad("wait_replicas is a number"))?;
                replicas = Some(n);
            }
            Some(("wait_timeout_ms", ms)) => {
                let ms: u64 = ms.parse().map_err(|_| bad("wait_timeout_ms is a number"))?;
                timeout = Duration::from_millis(ms);
            }
            _ => return Err(bad(&format!("unknown parameter {pair:?}"))),
        }
    }
    Ok(replicas
        .filter(|n| *n > 0)
        .map(|count| Replicas { count, timeout }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_sentinels_the_master_and_the_options() {
        let u = parse_sentinel(
            "redis+sentinel://a:26379,b:26380/mymaster/2?wait_replicas=1&wait_timeout_ms=50",
        )
        .unwrap();
        assert_eq!(u.sentinels, ["a:26379", "b:26380"]);
        assert_eq!(u.master, "mymaster");
        assert_eq!(u.redis.db(), 2);
        let wait = Replicas {
            count: 1,
            timeout: Duration::from_millis(50),
        };
        assert_eq!(u.wait, Some(wait));
        let u = parse_sentinel("redis+sentinel://u:p%40ss@a:1/m").unwrap();
        assert_eq!(u.redis.username(), Some("u"));
        assert_eq!(u.redis.password(), Some("p@ss"));
        assert_eq!(u.wait, None);
        for bad in [
            "redis://a:1/m",
            "redis+sentinel://a:1",
            "redis+sentinel://a:1/",
            "redis+sentinel://a/m",
            "redis+sentinel://a:1/m/x",
            "redis+sentinel://a:1/m?wait_replicas=x",
            "redis+sentinel://a:1/m?colour=blue",
        ] {
            assert!(
                matches!(parse_sentinel(bad), Err(LockError::Config(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn cluster_urls_name_the_nodes_and_the_options() {
        let u = parse_cluster("redis+cluster://a:7000,b:7001?wait_replicas=1").unwrap();
        assert_eq!(u.nodes, ["a:7000", "b:7001"]);
        let wait = Replicas {
            count: 1,
            timeout: Duration::from_millis(100),
        };
        assert_eq!(u.wait, Some(wait));
        let u = parse_cluster("redis+cluster://:secret@a:7000/").unwrap();
        assert_eq!(u.redis.password(), Some("secret"));
        assert_eq!(u.redis.username(), None);
        for bad in [
            "redis://a:1",
            "redis+cluster://",
            "redis+cluster://a",
            "redis+cluster://a:1,b",
            "redis+cluster://a:1/0",
            "redis+cluster://a:1?wait_replicas=-1",
        ] {
            assert!(
                matches!(parse_cluster(bad), Err(LockError::Config(_))),
                "{bad}"
            );
        }
    }
}
