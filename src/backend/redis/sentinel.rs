//! Redis Sentinel URLs: which Sentinels, which master, how many replicas
//! a write waits for. Following the master is `master.rs`.

use std::time::Duration;

use redis::{ProtocolVersion, RedisConnectionInfo};

use super::replicas::Replicas;
use crate::error::LockError;

pub(super) const SCHEME: &str = "redis+sentinel://";

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
pub(super) fn parse_url(url: &str) -> Result<SentinelUrl, LockError> {
    let bad = |why: &str| {
        LockError::Config(format!(
            "{why}: a Sentinel URL looks like \
             redis+sentinel://[user[:password]@]host:port[,host:port...]/master[/db]\
             [?wait_replicas=N&wait_timeout_ms=T], not {url:?}"
        ))
    };
    let rest = url
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad("not a redis+sentinel:// URL"))?;
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = rest.split_once('/').ok_or_else(|| bad("no master name"))?;
    let (user_info, hosts) = match authority.rsplit_once('@') {
        Some((user_info, hosts)) => (Some(user_info), hosts),
        None => (None, authority),
    };
    let sentinels: Vec<String> = hosts.split(',').map(str::to_owned).collect();
    if sentinels.iter().any(|h| {
        h.rsplit_once(':')
            .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
    }) {
        return Err(bad("each Sentinel is host:port"));
    }
    let (master, db) = path.split_once('/').unwrap_or((path, ""));
    if master.is_empty() {
        return Err(bad("no master name"));
    }
    let mut redis = RedisConnectionInfo::default().set_protocol(ProtocolVersion::RESP3);
    if !db.is_empty() {
        let db: i64 = db.parse().map_err(|_| bad("the database is a number"))?;
        redis = redis.set_db(db);
    }
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
    Ok(SentinelUrl {
        sentinels,
        master: master.to_owned(),
        redis,
        wait: replicas
            .filter(|n| *n > 0)
            .map(|count| Replicas { count, timeout }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_sentinels_the_master_and_the_options() {
        let u = parse_url(
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
        let u = parse_url("redis+sentinel://u:p%40ss@a:1/m").unwrap();
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
            assert!(matches!(parse_url(bad), Err(LockError::Config(_))), "{bad}");
        }
    }
}
