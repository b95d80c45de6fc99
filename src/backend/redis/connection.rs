//! The connection commands go on: to one server, (with Sentinel) to
//! whichever server is the master now, or (with Cluster) to the master of
//! each key's slot.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};
use tokio::sync::Notify;

use crate::error::LockError;
use crate::sync::lock;

/// A handle on the `redis` crate's connection: both kinds reconnect by
/// themselves, and a clone is cheap.
#[derive(Clone)]
pub(super) enum Link {
    /// One RESP3 connection to one server.
    Server(ConnectionManager),
    /// A connection to every node of a Redis Cluster, each command routed
    /// to the master of its keys' slot (following `MOVED` and `ASK`), each
    /// subscription a sharded one (`SSUBSCRIBE`) to the node of its
    /// channel's slot.
    Cluster(ClusterConnection),
}

impl Link {
    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Link::Server(c) => c.subscribe(channel).await,
            Link::Cluster(c) => c.ssubscribe(channel).await,
        }
    }

    pub(super) async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Link::Server(c) => c.unsubscribe(channel).await,
            Link::Cluster(c) => c.sunsubscribe(channel).await,
        }
    }
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Server(c) => c.req_packed_command(cmd),
            Link::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Server(c) => c.req_packed_commands(pipeline, offset, count),
            Link::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Server(c) => c.get_db(),
            Link::Cluster(c) => c.get_db(),
        }
    }
}

/// One [`Link`]; under Sentinel, replaced by one to the new master after a
/// failover.
pub(super) struct Connection {
    /// The connection, and the config epoch under which the Sentinels named
    /// its server master (0 without Sentinel).
    current: Mutex<(Link, u64)>,
    /// Under Sentinel: whether the master must be confirmed after a broken
    /// connection before a lock is taken.
    follows: bool,
    /// To a Redis Cluster: fixed at connect (under Sentinel only the
    /// server is replaced).
    cluster: bool,
    pub(super) doubt: Arc<Doubt>,
}

/// What the connection knows of its server after failures, shared with the
/// push handler (which hears of disconnections) and the master follower.
#[derive(Default)]
pub(super) struct Doubt {
    /// A command failed or the connection broke since the Sentinels last
    /// confirmed the master.
    unconfirmed: AtomicBool,
    /// Counts the connection's breaks and replacements.
    breaks: AtomicU64,
    /// Wakes the master follower (see `master.rs`).
    pub(super) ask: Notify,
    /// Wakes acquisitions waiting for the master to be confirmed.
    confirmed: Notify,
}

impl Doubt {
    /// A command failed: maybe the server is no longer the master.
    pub(super) fn suspect(&self) {
        self.unconfirmed.store(true, Ordering::Release);
        self.ask.notify_one();
    }

    /// The connection broke. Under Sentinel, the `ConnectionManager`
    /// reconnects to the same address, where a restarted server may now
    /// be an empty master the Sentinels have already replaced.
    pub(super) fn broke(&self) {
        self.breaks.fetch_add(1, Ordering::AcqRel);
        self.suspect();
    }

    /// Whether the master is to be confirmed again.
    pub(super) fn is_unconfirmed(&self) -> bool {
        self.unconfirmed.load(Ordering::Acquire)
    }

    /// How many times the connection broke or moved so far.
    pub(super) fn breaks(&self) -> u64 {
        self.breaks.load(Ordering::Acquire)
    }

    /// The Sentinels named the master, and the connection goes there.
    pub(super) fn confirm(&self) {
        self.unconfirmed.store(false, Ordering::Release);
        self.confirmed.notify_waiters();
    }
}

impl Drop for Connection {
    /// Wakes the master follower, which then finds the backend gone and
    /// stops (with its Sentinel connection).
    fn drop(&mut self) {
        self.doubt.ask.notify_one();
    }
}

impl Connection {
    pub(super) fn new(conn: Link, epoch: u64, doubt: Arc<Doubt>, follows: bool) -> Self {
        Connection {
            cluster: matches!(conn, Link::Cluster(_)),
            current: Mutex::new((conn, epoch)),
            follows,
            doubt,
        }
    }

    /// Whether the connection is to a Redis Cluster.
    pub(super) fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The connection to use now (a cheap clone of a handle).
    pub(super) fn get(&self) -> Link {
        lock(&self.current).0.clone()
    }

    /// The connection to take a lock on, its break count (to compare after
    /// the answer with [`broke_since`](Self::broke_since)) and its master's
    /// config epoch. Under Sentinel, after a failure, waits (up to
    /// `within`) until the Sentinels have confirmed the master.
    pub(super) async fn for_locking(
        &self,
        within: Duration,
    ) -> Result<(Link, u64, u64), LockError> {
        let doubt = &self.doubt;
        if self.follows {
            let deadline = tokio::time::Instant::now() + within;
            loop {
                let confirmed = doubt.confirmed.notified();
                tokio::pin!(confirmed);
                confirmed.as_mut().enable();
                if !doubt.unconfirmed.load(Ordering::Acquire) {
                    break;
                }
                doubt.ask.notify_one();
                if tokio::time::timeout_at(deadline, confirmed).await.is_err() {
                    return Err(LockError::backend(
                        "redis",
                        format!(
                            "the connection to the master failed, and the Sentinels have not \
                             named the master again within {} ms",
                            within.as_millis()
                        ),
                        None,
                    ));
                }
            }
        }
        let breaks = doubt.breaks();
        let (conn, epoch) = lock(&self.current).clone();
        Ok((conn, breaks, epoch))
    }

    /// Under Sentinel, whether the connection broke (and may have been
    /// reconnected to another server) or was moved to a new master since
    /// [`for_locking`](Self::for_locking) returned `breaks`: a lock granted
    /// meanwhile cannot be trusted.
    pub(super) fn broke_since(&self, breaks: u64) -> bool {
        self.follows && self.doubt.breaks() != breaks
    }

    /// A command failed: maybe the server is no longer the master.
    pub(super) fn suspect(&self) {
        self.doubt.suspect();
    }

    /// From now on, commands go to `conn`. An answer still to come on the
    /// old connection is not trusted: a master paused through a failover
    /// may run a request it queued, and grant, once it runs again.
    ///
    /// Returns the break count that the replacement made.
    pub(super) fn replace(&self, conn: ConnectionManager, epoch: u64) -> u64 {
        *lock(&self.current) = (Link::Server(conn), epoch);
        self.doubt.breaks.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// The Sentinels name the same master under a later config epoch (this
    /// process missed the failovers in between).
    pub(super) fn raise_epoch(&self, epoch: u64) {
        let mut current = lock(&self.current);
        current.1 = current.1.max(epoch);
    }
}
