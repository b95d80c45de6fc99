//! A Redis Cluster on loopback: three masters and a replica of each
//! (Debian's `redis-server`, joined by `redis-cli --cluster create`), that
//! a test starts so that it can kill and pause nodes and move slots.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tower_lock_servers::Server;

/// A node as `CLUSTER NODES` describes it.
#[derive(Clone, Debug)]
pub struct Node {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// A replica's master's id.
    pub of: Option<String>,
    /// A master's slot ranges.
    pub slots: Vec<(u16, u16)>,
}

/// The cluster (`tower_lock_servers`), in a directory of its own.
pub struct RedisCluster {
    dir: PathBuf,
    pub ports: Vec<u16>,
    nodes: Vec<Server>,
}

impl RedisCluster {
    /// Six nodes: three masters, three replicas, a node timeout of 2 s (a
    /// failover some 2–3 s after a master stops answering).
    pub async fn start(test: &str) -> RedisCluster {
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-redis-cluster-{test}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let nodes = Server::start_redis_cluster(&dir).unwrap_or_else(|e| {
            panic!(
                "cannot start a Redis Cluster ({e}); scripts/test-all.sh installs Debian's \
                 redis-server and redis-tools"
            )
        });
        let cluster = RedisCluster {
            dir,
            ports: nodes.iter().map(|n| n.addr.port()).collect(),
            nodes,
        };
        cluster.wait_settled().await;
        // Each master's replica known to every node, and streaming.
        for &port in &cluster.ports {
            cluster
                .wait_until(
                    &format!("node {port} knows three replicas"),
                    || async move {
                        nodes_of(port)
                            .await
                            .is_some_and(|n| n.iter().filter(|n| n.of.is_some()).count() == 3)
                    },
                )
                .await;
            cluster
                .wait_until(
                    &format!("node {port} is a master or in sync"),
                    || async move {
                        replication(port).await.is_some_and(|info| {
                            info.contains("role:master") || info.contains("master_link_status:up")
                        })
                    },
                )
                .await;
        }
        cluster
    }

    /// `redis+cluster://` for the cluster (every node), with `query`.
    pub fn url(&self, query: &str) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}{query}", nodes.join(","))
    }

    /// A connection to node `port`.
    pub async fn conn(&self, port: u16) -> redis::aio::MultiplexedConnection {
        conn(port).await.expect("the node answers")
    }

    /// The cluster as node `port` sees it.
    pub async fn nodes(&self, port: u16) -> Vec<Node> {
        let text: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut self.conn(port).await)
            .await
            .unwrap();
        parse_nodes(&text)
    }

    /// The slot of a Redis key.
    pub async fn slot(&self, key: &str) -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut self.conn(self.live_port()).await)
            .await
            .unwrap()
    }

    /// The master serving `slot`, and its replica, as a live node sees them.
    pub async fn master_of(&self, slot: u16) -> (Node, Option<Node>) {
        let nodes = self.nodes(self.live_port()).await;
        let master = nodes
            .iter()
            .find(|n| n.master && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .expect("every slot has a master")
            .clone();
        let replica = nodes
            .iter()
            .find(|n| n.of.as_deref() == Some(master.id.as_str()))
            .cloned();
        (master, replica)
    }

    /// A master that does not serve `slot`.
    pub async fn other_master(&self, slot: u16) -> Node {
        let (master, _) = self.master_of(slot).await;
        self.nodes(self.live_port())
            .await
            .into_iter()
            .find(|n| n.master && n.id != master.id && !n.slots.is_empty())
            .expect("three masters")
    }

    /// The lock keys (fencing counters aside) on node `port`.
    pub async fn lock_keys(&self, port: u16) -> Vec<String> {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("lock:*")
            .query_async(&mut self.conn(port).await)
            .await
            .unwrap();
        // Fencing counters, and the config epoch each slot's scripts keep
        // (`lock:{{~n}:epoch`), outlive the locks.
        keys.into_iter()
            .filter(|k| !k.ends_with(":fence") && !k.ends_with(":epoch"))
            .collect()
    }

    /// The lock keys on every live master.
    pub async fn all_lock_keys(&self) -> Vec<String> {
        let mut all = Vec::new();
        for n in self.nodes(self.live_port()).await {
            if n.master && ping(n.port).await {
                all.extend(self.lock_keys(n.port).await);
            }
        }
        all
    }

    /// Moves `slot` and its keys to the master `to`, the way `redis-cli
    /// --cluster reshard` does: the target importing and the source
    /// migrating (clients are sent on with `ASK`), `before_keys` run, the
    /// keys moved by `MIGRATE`, then the slot assigned on every master.
    pub async fn move_slot<T, F: std::future::Future<Output = T>>(
        &self,
        slot: u16,
        to: &Node,
        before_keys: impl FnOnce() -> F,
    ) -> T {
        let (from, _) = self.master_of(slot).await;
        let setslot = |port: u16, how: &'static str, id: String| async move {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(how)
                .arg(id)
                .query_async(&mut conn(port).await.unwrap())
                .await
                .unwrap();
        };
        setslot(to.port, "IMPORTING", from.id.clone()).await;
        setslot(from.port, "MIGRATING", to.id.clone()).await;
        let before = before_keys().await;
        let mut source = self.conn(from.port).await;
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query_async(&mut source)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: () = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to.port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query_async(&mut source)
                .await
                .unwrap();
        }
        for n in self.nodes(self.live_port()).await {
            if n.master && ping(n.port).await {
                setslot(n.port, "NODE", to.id.clone()).await;
            }
        }
        self.wait_settled().await;
        before
    }

    /// Waits until the node on `port` counts `n` sharded subscribers of
    /// `channel`.
    pub async fn wait_subscribed(&self, port: u16, channel: &str, n: i64) {
        let what = format!("{n} subscribers of {channel} on node {port}");
        self.wait_until(&what, || async move {
            let Some(mut c) = conn(port).await else {
                return false;
            };
            let counts: Result<(String, i64), _> = redis::cmd("PUBSUB")
                .arg("SHARDNUMSUB")
                .arg(channel)
                .query_async(&mut c)
                .await;
            counts.is_ok_and(|(_, count)| count == n)
        })
        .await;
    }

    /// `kill -9` of the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).unwrap();
        self.nodes[i].kill();
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) the node on `port`.
    pub fn signal(&self, port: u16, signal: &str) {
        let i = self.ports.iter().position(|p| *p == port).unwrap();
        assert!(self.nodes[i].is_running(), "the node on {port} runs");
        self.nodes[i].signal(signal);
    }

    /// Waits until `port` is a master serving `slot`, as every live node
    /// sees it, and the cluster is ok again.
    pub async fn wait_promoted(&self, port: u16, slot: u16) {
        self.wait_until(&format!("node {port} serves slot {slot}"), || async move {
            let mut live = 0;
            for &p in &self.ports {
                if !ping(p).await {
                    continue;
                }
                live += 1;
                let Some(nodes) = nodes_of(p).await else {
                    return false;
                };
                let serves = nodes.iter().any(|n| {
                    n.port == port
                        && n.master
                        && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
                });
                if !serves || !cluster_ok(p).await {
                    return false;
                }
            }
            live > 0
        })
        .await;
    }

    /// Every live node says the cluster is ok and agrees on every slot's
    /// master.
    pub async fn wait_settled(&self) {
        self.wait_until("the cluster settles", || async move {
            let mut views = Vec::new();
            for &p in &self.ports {
                if !ping(p).await {
                    continue;
                }
                if !cluster_ok(p).await {
                    return false;
                }
                let Some(nodes) = nodes_of(p).await else {
                    return false;
                };
                let mut masters: Vec<(Vec<(u16, u16)>, u16)> = nodes
                    .into_iter()
                    .filter(|n| n.master && !n.slots.is_empty())
                    .map(|n| (n.slots, n.port))
                    .collect();
                masters.sort();
                views.push(masters);
            }
            !views.is_empty() && views.windows(2).all(|w| w[0] == w[1])
        })
        .await;
    }

    async fn wait_until<F: std::future::Future<Output = bool>>(
        &self,
        what: &str,
        mut cond: impl FnMut() -> F,
    ) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cond().await {
            assert!(
                Instant::now() < deadline,
                "{what}: not within 30 s\n{}",
                super::log_tails(&self.dir)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A node that runs and answers.
    fn live_port(&self) -> u16 {
        self.nodes
            .iter()
            .find(|n| n.is_running())
            .map(|n| n.addr.port())
            .expect("a node runs")
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        // Stopped first; their files kept for a failing test's messages.
        self.nodes.clear();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

async fn conn(port: u16) -> Option<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_millis(500)));
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .ok()?
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .ok()
}

async fn ping(port: u16) -> bool {
    match conn(port).await {
        Some(mut c) => redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .is_ok(),
        None => false,
    }
}

async fn nodes_of(port: u16) -> Option<Vec<Node>> {
    let text: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn(port).await?)
        .await
        .ok()?;
    Some(parse_nodes(&text))
}

async fn replication(port: u16) -> Option<String> {
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn(port).await?)
        .await
        .ok()
}

async fn cluster_ok(port: u16) -> bool {
    let Some(mut c) = conn(port).await else {
        return false;
    };
    let info: Result<String, _> = redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await;
    info.is_ok_and(|i| i.contains("cluster_state:ok"))
}

/// `CLUSTER NODES`: `id ip:port@bus flags master-id ping pong epoch link slots...`.
fn parse_nodes(text: &str) -> Vec<Node> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags = f[2];
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|a| (a, a)),
                })
                .collect();
            Some(Node {
                id: f[0].to_owned(),
                port,
                master: flags.contains("master") && !flags.contains("fail"),
                of: (f[3] != "-").then(|| f[3].to_owned()),
                slots,
            })
        })
        .collect()
}
