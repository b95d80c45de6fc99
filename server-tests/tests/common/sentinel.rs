//! A Redis master, two replicas and three Sentinels on loopback (Debian's
//! `redis-server`, which runs as a Sentinel with `--sentinel`), started by
//! a test so that it can kill the master, and stop the replicas to cut
//! replication while clients still reach the master. (Not a proxy between
//! master and replicas: the Sentinels point replicas that replicate from
//! another address than the master's back at the master itself, some ten
//! seconds in.)

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tower_lock_servers::Server;

/// The name the Sentinels monitor the master under.
pub const MASTER: &str = tower_lock_servers::SENTINEL_MASTER;

/// How long the master may be silent before the Sentinels fail it over
/// while the group comes up: long, so that a loaded machine (a full
/// resynchronisation's fork, other suites' servers) cannot fail it over
/// before a test begins. Once ready, the group sets [`DOWN_AFTER_MS`].
const STARTING_DOWN_AFTER: Duration = Duration::from_secs(60);

/// How long the master may be silent before the Sentinels fail it over,
/// once the group is up: the tests wait for failovers.
const DOWN_AFTER_MS: u64 = 1_000;

/// The group (`tower_lock_servers`), in a directory of its own.
pub struct SentinelGroup {
    dir: PathBuf,
    /// The Redis servers' ports; server 0 starts as the master.
    pub redis: Vec<u16>,
    sentinels: Vec<u16>,
    /// The three Redis servers, then the three Sentinels.
    servers: Vec<Server>,
}

impl SentinelGroup {
    pub async fn start(test: &str) -> SentinelGroup {
        let dir =
            std::env::temp_dir().join(format!("tower-lock-sentinel-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let servers = Server::start_sentinel_group(&dir, STARTING_DOWN_AFTER)
            .unwrap_or_else(|e| {
                panic!("cannot start a Sentinel group ({e}); scripts/test-all.sh installs Debian's redis-server")
            });
        let ports: Vec<u16> = servers.iter().map(|s| s.addr.port()).collect();
        let group = SentinelGroup {
            dir,
            redis: ports[..3].to_vec(),
            sentinels: ports[3..].to_vec(),
            servers,
        };
        group.wait_ready().await;
        group
    }

    /// Starts Redis server `i` again (empty, no persistence): server 0 as
    /// the master it started as, the others as its replicas.
    pub fn spawn_redis(&mut self, i: usize) {
        self.servers[i]
            .restart()
            .unwrap_or_else(|e| panic!("restarting Redis server {i}: {e}"));
    }

    /// `redis+sentinel://...` for the group, with `query` after it.
    pub fn url(&self, query: &str) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{MASTER}{query}", hosts.join(","))
    }

    /// What the Sentinel `i` says about the master: its port.
    pub async fn master_port(&self, i: usize) -> Option<u16> {
        let addr: Vec<String> = self.ask_sentinel(i, "get-master-addr-by-name").await?;
        addr.get(1)?.parse().ok()
    }

    /// The config epoch under which Sentinel `i` names the master.
    pub async fn config_epoch(&self, i: usize) -> Option<u64> {
        let fields: std::collections::HashMap<String, String> =
            self.ask_sentinel(i, "master").await?;
        fields.get("config-epoch")?.parse().ok()
    }

    /// `SENTINEL <what> <MASTER>` to Sentinel `i`; `None` if it does not
    /// answer.
    async fn ask_sentinel<T: redis::FromRedisValue>(&self, i: usize, what: &str) -> Option<T> {
        self.sentinel_command(i, redis::cmd("SENTINEL").arg(what).arg(MASTER))
            .await
    }

    /// Whether Sentinel `i` has a client subscribed to a channel (the
    /// Sentinels keep none among themselves); `None` if it does not answer.
    pub async fn has_subscriber(&self, i: usize) -> Option<bool> {
        let list: String = self
            .sentinel_command(i, redis::cmd("CLIENT").arg("LIST"))
            .await?;
        Some(list.lines().any(|l| l.split(' ').any(|f| f == "sub=1")))
    }

    /// How many connections Sentinel `i` has accepted so far.
    pub async fn connections_received(&self, i: usize) -> u64 {
        let info: String = self
            .sentinel_command(i, redis::cmd("INFO").arg("stats"))
            .await
            .expect("the Sentinel answers INFO");
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|n| n.trim().parse().ok())
            .expect("INFO stats counts the connections received")
    }

    async fn sentinel_command<T: redis::FromRedisValue>(
        &self,
        i: usize,
        cmd: &redis::Cmd,
    ) -> Option<T> {
        let client =
            redis::Client::open(format!("redis://127.0.0.1:{}", self.sentinels[i])).ok()?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .ok()?;
        cmd.query_async(&mut conn).await.ok()
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) Sentinel `i`: stopped, it
    /// accepts connections (the kernel does) and answers nothing.
    pub fn signal_sentinel(&self, i: usize, signal: &str) {
        self.servers[3 + i].signal(signal);
    }

    /// A connection to Redis server `port`.
    pub async fn redis_conn(&self, port: u16) -> redis::aio::MultiplexedConnection {
        redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Every Sentinel knows the master and both replicas; then the
    /// Sentinels fail the master over after [`DOWN_AFTER_MS`] of silence.
    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut seen = Vec::new();
            for i in 0..3 {
                seen.push((self.master_port(i).await, self.replicas_known(i).await));
            }
            if seen.iter().all(|&s| s == (Some(self.redis[0]), 2)) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the Sentinels did not come up in 30 s: master {}, replicas {:?}; \
                 each Sentinel's (master port, replicas known): {seen:?}\n{}",
                self.redis[0],
                &self.redis[1..],
                super::log_tails(&self.dir)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for i in 0..3 {
            let set: Option<String> = self
                .sentinel_command(
                    i,
                    redis::cmd("SENTINEL")
                        .arg("SET")
                        .arg(MASTER)
                        .arg("down-after-milliseconds")
                        .arg(DOWN_AFTER_MS),
                )
                .await;
            assert_eq!(
                set.as_deref(),
                Some("OK"),
                "Sentinel {i} takes the down-after time"
            );
        }
    }

    async fn replicas_known(&self, i: usize) -> usize {
        let replicas: Option<Vec<redis::Value>> = self.ask_sentinel(i, "replicas").await;
        replicas.map_or(0, |r| r.len())
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) both first replicas: while
    /// stopped they receive nothing and acknowledge nothing.
    pub fn signal_replicas(&self, signal: &str) {
        for replica in &self.servers[1..3] {
            replica.signal(signal);
        }
    }

    /// `kill -9` of Redis server `i`.
    pub fn kill_redis(&mut self, i: usize) {
        self.servers[i].kill();
    }

    /// Waits until every Sentinel names a master other than `old`; returns
    /// its port.
    pub async fn failed_over_from(&self, old: u16) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut named = Vec::new();
            for i in 0..3 {
                named.push(self.master_port(i).await);
            }
            if let Some(Some(port)) = named.first().copied() {
                if port != old && named.iter().all(|n| *n == Some(port)) {
                    return port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no failover from port {old} within 30 s; each Sentinel's master: {named:?}\n{}",
                super::log_tails(&self.dir)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for SentinelGroup {
    fn drop(&mut self) {
        // Stopped first; their files kept for a failing test's messages.
        self.servers.clear();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
