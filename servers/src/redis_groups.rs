//! Redis deployments of several servers, as the nemesis sees them: which
//! server is master, whether a failover has happened, and when the group
//! has settled (until then two servers may both serve as master).

use std::net::SocketAddr;
use std::time::Duration;

/// A group of Redis servers that fails over on its own: the nemesis stops
/// or kills its master and waits for the group to replace it.
pub enum Failover {
    /// Servers watched by Sentinels (clients are given the Sentinels).
    Sentinel {
        sentinels: Vec<SocketAddr>,
        data: Vec<SocketAddr>,
    },
    /// A Redis Cluster's nodes, masters and replicas.
    Cluster { nodes: Vec<SocketAddr> },
}

impl Failover {
    /// Who fails over, for messages.
    pub fn who(&self) -> &'static str {
        match self {
            Failover::Sentinel { .. } => "the Sentinels",
            Failover::Cluster { .. } => "the cluster",
        }
    }

    /// The index of a master among the data servers (with several, as
    /// Cluster has, the `pick`-th modulo their number).
    pub async fn master(&self, pick: u64) -> Option<usize> {
        match self {
            Failover::Sentinel { sentinels, data } => sentinel_master(sentinels, data).await,
            Failover::Cluster { nodes } => cluster_master(nodes, pick).await,
        }
    }

    /// Waits (up to `within`) until the data server `old` is no longer
    /// named master; whether that happened.
    pub async fn failed_over(&self, old: usize, within: Duration) -> bool {
        match self {
            Failover::Sentinel { sentinels, data } => {
                failed_over(sentinels, data[old], within).await
            }
            Failover::Cluster { nodes } => cluster_failed_over(nodes, nodes[old], within).await,
        }
    }

    /// Waits (up to `within`) until every server agrees on who is master:
    /// until then a replaced master may still serve.
    pub async fn settled(&self, within: Duration) {
        match self {
            Failover::Sentinel { sentinels, data } => settled(sentinels, data, within).await,
            Failover::Cluster { nodes } => cluster_settled(nodes, within).await,
        }
    }
}

/// Which of the Redis servers `data` the Sentinels (any of `sentinels`)
/// name as the master.
async fn sentinel_master(sentinels: &[SocketAddr], data: &[SocketAddr]) -> Option<usize> {
    for s in sentinels {
        let Ok(client) = redis::Client::open(format!("redis://{s}")) else {
            continue;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let addr: Result<Vec<String>, _> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(crate::SENTINEL_MASTER)
            .query_async(&mut conn)
            .await;
        let port = addr.ok().and_then(|a| a.get(1)?.parse::<u16>().ok());
        if let Some(i) = data.iter().position(|d| Some(d.port()) == port) {
            return Some(i);
        }
    }
    None
}

/// Waits (up to `within`) until the Sentinels name a master other than
/// `old`; whether they do.
async fn failed_over(sentinels: &[SocketAddr], old: SocketAddr, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut named = Vec::new();
        for s in sentinels {
            named.push(sentinel_master(&[*s], &[old]).await);
        }
        if named.iter().all(Option::is_none) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to `within`) until the Sentinel group has settled: every
/// Sentinel names the same master, which says it is master, and every
/// other Redis server of `data` says it is a replica of it. Until then two
/// servers may both serve as master (one the Sentinels have replaced but
/// not yet converted).
async fn settled(sentinels: &[SocketAddr], data: &[SocketAddr], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        let mut named = Vec::new();
        for s in sentinels {
            named.push(sentinel_master(&[*s], data).await);
        }
        if let Some(master) = named[0].filter(|_| named.iter().all(|n| *n == named[0])) {
            let mut agree = true;
            for (i, addr) in data.iter().enumerate() {
                let role = role(*addr).await;
                agree &= match role.as_slice() {
                    [redis::Value::BulkString(r), ..] if i == master => r == b"master",
                    [redis::Value::BulkString(r), _, port, ..] if i != master => {
                        r == b"slave"
                            && redis::from_redis_value::<u16>(port.clone()).ok()
                                == Some(data[master].port())
                    }
                    _ => false,
                };
            }
            if agree {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("harness: the Sentinel group did not settle within {within:?}");
}

/// What `ROLE` says on the Redis server `addr`; empty if it cannot be
/// asked.
async fn role(addr: SocketAddr) -> Vec<redis::Value> {
    let Ok(client) = redis::Client::open(format!("redis://{addr}")) else {
        return Vec::new();
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return Vec::new();
    };
    redis::cmd("ROLE")
        .query_async(&mut conn)
        .await
        .unwrap_or_default()
}

/// `CLUSTER NODES` as the node `addr` sees it: each master that serves
/// slots (and is not flagged failing), as its port and its slot ranges,
/// sorted; `None` if it cannot be asked.
async fn cluster_view(addr: SocketAddr) -> Option<Vec<(u16, String)>> {
    let client = redis::Client::open(format!("redis://{addr}")).ok()?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_millis(500)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .ok()?;
    let text: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn)
        .await
        .ok()?;
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async(&mut conn)
        .await
        .ok()?;
    let ok = info.contains("cluster_state:ok");
    let mut masters: Vec<(u16, String)> = text
        .lines()
        .filter_map(|line| {
            // id ip:port@bus flags master ping pong epoch link slots...
            let f: Vec<&str> = line.split_whitespace().collect();
            let port = f
                .get(1)?
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            let flags = f.get(2)?;
            let slots = f.get(8..)?.join(" ");
            (flags.contains("master") && !flags.contains("fail") && !slots.is_empty())
                .then_some((port, slots))
        })
        .collect();
    masters.sort();
    // A node that says the cluster is not ok has no view worth agreeing on.
    ok.then_some(masters)
}

/// The index in `nodes` of one of the masters that serve slots (the
/// `pick`-th, modulo their number), as the first node that answers names
/// them.
async fn cluster_master(nodes: &[SocketAddr], pick: u64) -> Option<usize> {
    for addr in nodes {
        if let Some(view) = cluster_view(*addr).await {
            let (port, _) = view.get(pick as usize % view.len().max(1))?;
            return nodes.iter().position(|n| n.port() == *port);
        }
    }
    None
}

/// Waits (up to `within`) until no live node of `nodes` names `old` as a
/// master serving slots; whether that happened.
async fn cluster_failed_over(nodes: &[SocketAddr], old: SocketAddr, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut named = false;
        for addr in nodes.iter().filter(|a| **a != old) {
            named |= cluster_view(*addr)
                .await
                .is_none_or(|v| v.iter().any(|(port, _)| *port == old.port()));
        }
        if !named {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to `within`) until every node of `nodes` answers, says the
/// cluster is ok, and agrees with the others on which master serves which
/// slots. Until then a master the others have replaced may still serve.
async fn cluster_settled(nodes: &[SocketAddr], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        let mut views = Vec::new();
        for addr in nodes {
            views.push(cluster_view(*addr).await);
        }
        if views[0].is_some() && views.iter().all(|v| *v == views[0]) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("harness: the Redis Cluster did not settle within {within:?}");
}
