//! Three-server clusters the multi-server tests start on loopback (Debian's
//! `etcd` and `zookeeper`, as `scripts/test-all.sh` installs them), so that
//! they can kill, restart and pause members; and the behaviour every such
//! backend is checked for.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_lock::{Backend, BackendExt, LockError};
use tower_lock_servers::{Kind, Server};

/// Which server a cluster runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Engine {
    Etcd,
    ZooKeeper,
}

/// A three-server cluster (`tower_lock_servers`) in a directory of its
/// own, stopped on drop.
pub struct Cluster {
    engine: Engine,
    dir: PathBuf,
    members: Vec<Server>,
}

impl Cluster {
    pub async fn start(engine: Engine, test: &str) -> Cluster {
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-{engine:?}-{test}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let kind = match engine {
            Engine::Etcd => Kind::Etcd,
            Engine::ZooKeeper => Kind::ZooKeeper,
        };
        let members = Server::start_cluster(kind, &dir, 3).unwrap_or_else(|e| {
            panic!(
                "cannot start a {engine:?} cluster ({e}); scripts/test-all.sh installs \
                 Debian's etcd-server and zookeeper"
            )
        });
        let cluster = Cluster {
            engine,
            dir,
            members,
        };
        cluster.wait_healthy().await;
        cluster
    }

    /// Starts member `i` again, on its ports and data.
    pub fn spawn(&mut self, i: usize) {
        self.members[i]
            .restart()
            .unwrap_or_else(|e| panic!("restarting {:?} member {i}: {e}", self.engine));
    }

    /// `host:port` of member `i`'s client port.
    pub fn host(&self, i: usize) -> String {
        self.members[i].addr.to_string()
    }

    /// Every member's `host:port`, comma-separated.
    pub fn hosts(&self) -> String {
        (0..3).map(|i| self.host(i)).collect::<Vec<_>>().join(",")
    }

    /// The same without member `i`.
    pub fn hosts_except(&self, i: usize) -> String {
        (0..3)
            .filter(|&j| j != i)
            .map(|j| self.host(j))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A member that is not the leader.
    pub async fn follower(&self) -> usize {
        (self.leader().await.expect("a leader") + 1) % 3
    }

    /// Every running member answers, and they agree on a leader.
    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while self.leader().await.is_none() {
            assert!(
                Instant::now() < deadline,
                "the {:?} cluster did not come up\n{}",
                self.engine,
                super::log_tails(&self.dir)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn running(&self) -> Vec<usize> {
        (0..3).filter(|&i| self.members[i].is_running()).collect()
    }

    /// The leader, once every running member is serving and they agree.
    pub async fn leader(&self) -> Option<usize> {
        match self.engine {
            Engine::Etcd => self.etcd_leader().await,
            Engine::ZooKeeper => {
                let mut leader = None;
                for i in self.running() {
                    let host = self.host(i);
                    let mode = tokio::task::spawn_blocking(move || four_letter(&host, "srvr"))
                        .await
                        .ok()?;
                    if mode.contains("Mode: leader") {
                        leader = Some(i);
                    } else if !mode.contains("Mode: follower") {
                        return None;
                    }
                }
                leader
            }
        }
    }

    async fn etcd_leader(&self) -> Option<usize> {
        let mut leader = None;
        let mut ids = Vec::new();
        for i in self.running() {
            let mut c = etcd_client::Client::connect([self.host(i)], None)
                .await
                .ok()?;
            let status = tokio::time::timeout(Duration::from_secs(1), c.status())
                .await
                .ok()?
                .ok()?;
            ids.push((i, status.header()?.member_id()));
            if status.leader() == 0 || leader.is_some_and(|l| l != status.leader()) {
                return None;
            }
            leader = Some(status.leader());
        }
        ids.iter()
            .find(|(_, id)| Some(*id) == leader)
            .map(|(i, _)| *i)
    }

    pub fn kill(&mut self, i: usize) {
        self.members[i].kill();
    }

    pub fn signal(&self, i: usize, signal: &str) {
        self.members[i].signal(signal);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Stopped first, then their files removed.
        self.members.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A ZooKeeper four-letter word's answer ("" when the server is down).
fn four_letter(host: &str, word: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(host) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut reply = String::new();
    if s.write_all(word.as_bytes()).is_ok() {
        let _ = s.read_to_string(&mut reply);
    }
    reply
}

/// What became of a lock whose holder's leader was killed.
#[derive(Debug, PartialEq, Eq)]
pub enum AfterLeaderKill {
    /// Still held, and nobody else granted it, for the whole `watch`.
    Kept,
    /// The holder was told it lost the lock, this long after the kill, and
    /// another was granted it only later.
    ToldFirst { told_ms: u128 },
}

/// Kills the leader while `holder` holds `k` and `other` waits for it, and
/// watches for `watch`: the lock is kept (nobody else granted it, the
/// holder not told) or the holder is told before `other` is granted.
pub async fn kill_the_leader_mid_hold<B: Backend + Clone + 'static>(
    cluster: &mut Cluster,
    holder: &B,
    other: &B,
    watch: Duration,
) -> AfterLeaderKill {
    let held = holder.lock("k").await.unwrap();
    let waiting = {
        let other = other.clone();
        tokio::spawn(async move {
            let g = other.lock("k").wait(Duration::from_secs(60)).await;
            (g, Instant::now())
        })
    };
    let leader = cluster.leader().await.unwrap();
    let killed_at = Instant::now();
    cluster.kill(leader);
    let mut told_at = None;
    while killed_at.elapsed() < watch && !waiting.is_finished() {
        if told_at.is_none() && held.is_lost() {
            told_at = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if told_at.is_none() && held.is_lost() {
        told_at = Some(Instant::now());
    }
    let outcome = match told_at {
        None => {
            assert!(
                !waiting.is_finished(),
                "granted to another while the holder was not told"
            );
            AfterLeaderKill::Kept
        }
        Some(told_at) => AfterLeaderKill::ToldFirst {
            told_ms: told_at.duration_since(killed_at).as_millis(),
        },
    };
    let token = held.token();
    drop(held);
    let (g, granted_at) = waiting.await.unwrap();
    let g = g.unwrap();
    if let AfterLeaderKill::ToldFirst { told_ms } = outcome {
        assert!(
            granted_at.duration_since(killed_at).as_millis() > told_ms,
            "granted before the holder was told"
        );
    }
    assert!(g.token() > token);
    g.release().await.unwrap();
    outcome
}

/// With `follower` stopped, two backends connected to the other members
/// still take turns: a majority is all a cluster needs.
pub async fn a_paused_follower_changes_nothing<B: Backend + Clone + 'static>(
    cluster: &Cluster,
    follower: usize,
    a: &B,
    b: &B,
) {
    cluster.signal(follower, "STOP");
    let counts = super::take_turns(a, b, "k", Duration::from_millis(2000)).await;
    super::assert_neither_starved(counts);
    cluster.signal(follower, "CONT");
}

/// Restarts every member in turn while six workers over two backends lock
/// one key: never two holders that were not told, tokens rising per worker.
/// Returns the holds made.
pub async fn rolling_restart_under_load<B: Backend + Clone + 'static>(
    cluster: &mut Cluster,
    backends: [&B; 2],
) -> usize {
    let inside = Arc::new(AtomicUsize::new(0));
    let held = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for i in 0..6 {
        let b = backends[i % 2].clone();
        let (inside, held, stop) = (inside.clone(), held.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut last = 0;
            while !stop.load(Ordering::Relaxed) {
                // An election may fail an acquisition: try again.
                let g = match b.lock("k").wait(Duration::from_secs(5)).await {
                    Ok(g) => g,
                    Err(LockError::Timeout { .. } | LockError::Backend { .. }) => continue,
                    Err(e) => panic!("{e}"),
                };
                assert!(g.token().get() > last, "token did not rise");
                last = g.token().get();
                if !g.is_lost() {
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    held.fetch_add(1, Ordering::Relaxed);
                }
                drop(g);
            }
        }));
    }
    for i in 0..3 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        cluster.kill(i);
        tokio::time::sleep(Duration::from_millis(500)).await;
        cluster.spawn(i);
        cluster.wait_healthy().await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    held.load(Ordering::Relaxed)
}
