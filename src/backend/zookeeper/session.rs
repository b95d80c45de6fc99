//! The ZooKeeper session: opening it, knowing it alive, and the retries
//! every call makes through connection loss.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use zookeeper_client as zk;

use super::url::node_name;
use crate::backend::engine::holds::Holds;
use crate::backend::engine::InFlight;
use crate::error::LockError;
use crate::key::LockKey;
use crate::lost::Deadline;
use crate::sync::lock;

/// ZooKeeper sessions and Curator's recipes: the store behind
/// [`ZookeeperBackend`](super::ZookeeperBackend). Its acquire path is in
/// the module; the engine ([`RemoteBackend`](crate::backend::RemoteBackend))
/// does the rest.
pub struct ZookeeperStore {
    pub(super) hosts: String,
    pub(super) root: String,
    pub(super) session_timeout: Duration,
    pub(super) connect_timeout: Duration,
    /// Each lock node's data: who holds it, for `inspect`.
    pub(super) identity: Arc<[u8]>,
    pub(super) current: Mutex<Option<Arc<Session>>>,
    /// One session opening at a time.
    pub(super) opening: tokio::sync::Mutex<()>,
    /// Deletes sent and not yet answered, on every session.
    pub(super) releases: Arc<InFlight>,
}

/// One ZooKeeper session and the locks that live with it.
pub(super) struct Session {
    pub(super) client: zk::Client,
    /// Until when the server surely keeps the session: see [`keep_alive`].
    /// Its locks' leases share it.
    pub(super) alive_until: Arc<Deadline>,
    /// Set when the session ends (or is given up): no new lock is taken on
    /// it, and every lock it holds is lost with it.
    pub(super) ended: AtomicBool,
    /// Wakes the acquires waiting on this session when it ends.
    pub(super) ended_notify: tokio::sync::Notify,
    /// The locks held on this session by node path, told when it ends.
    /// Each has a lost state of its own, so that a lock's waker list lives
    /// only as long as the lock. The flag marks exclusive and write locks:
    /// their waiters need not list the children again when they go.
    pub(super) holds: Holds<String, bool>,
    /// The backend's deletes in flight.
    pub(super) releases: Arc<InFlight>,
    /// Each lock node's data (the store's `identity`).
    pub(super) identity: Arc<[u8]>,
    /// Lock parents seen to exist on this session (see
    /// [`Session::create_node`]).
    pub(super) known_dirs: KnownDirs,
}

impl Session {
    /// Whether new requests may use this session.
    pub(super) fn usable(&self) -> bool {
        !self.ended.load(Ordering::Acquire) && alive(self) && !self.alive_until.passed()
    }

    /// Ends the session, saying why in the log.
    fn end_with_warning(&self, reason: String) {
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        tracing::warn!(
            session = self.client.session_id().0,
            reason,
            "zookeeper locks lost"
        );
        self.end(reason);
    }

    /// Ends the session for this backend: tells its waiters and holders.
    fn end(&self, reason: String) {
        self.ended.store(true, Ordering::Release);
        self.ended_notify.notify_waiters();
        self.holds.end(&reason);
    }
}

pub(super) fn zk_error(doing: &str, e: zk::Error) -> LockError {
    LockError::backend("zookeeper", doing.to_owned(), Some(Box::new(e) as _))
}

impl ZookeeperStore {
    pub(super) fn dir(&self, key: &LockKey) -> String {
        format!("{}/{}", self.root, node_name(key))
    }

    /// The live session, opening a new one if there is none or it ended.
    pub(super) async fn session(&self) -> Result<Arc<Session>, LockError> {
        if let Some(s) = lock(&self.current).as_ref().filter(|s| s.usable()) {
            return Ok(s.clone());
        }
        let _opening = self.opening.lock().await;
        if let Some(s) = lock(&self.current).as_ref().filter(|s| s.usable()) {
            return Ok(s.clone());
        }
        // The session cannot have been heard by the server before this.
        let connecting = std::time::Instant::now();
        let connect = zk::Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_fail_eagerly()
            .connect(&self.hosts);
        let client = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                return Err(zk_error(
                    &format!("connecting to ZooKeeper at {}", self.hosts),
                    e,
                ))
            }
            Err(_) => {
                return Err(LockError::backend(
                    "zookeeper",
                    format!(
                        "connecting to ZooKeeper at {} timed out after {} ms",
                        self.hosts,
                        self.connect_timeout.as_millis()
                    ),
                    None,
                ))
            }
        };
        let states = client.state_watcher();
        let known_alive = known_alive(client.session_timeout());
        let session = Arc::new(Session {
            alive_until: Arc::new(Deadline::new(connecting + known_alive)),
            client,
            ended: AtomicBool::new(false),
            ended_notify: tokio::sync::Notify::new(),
            holds: Holds::new(),
            releases: self.releases.clone(),
            identity: self.identity.clone(),
            known_dirs: KnownDirs::default(),
        });
        tokio::spawn(watch_session(Arc::downgrade(&session), states));
        tokio::spawn(keep_alive(Arc::downgrade(&session), known_alive));
        *lock(&self.current) = Some(session.clone());
        Ok(session)
    }
}

/// Follows a session's state; ends it (its locks are told) when it expires,
/// is closed or fails authentication. A disconnect alone ends nothing here:
/// [`keep_alive`] decides how long the session is known alive.
async fn watch_session(session: Weak<Session>, mut states: zk::StateWatcher) {
    let mut state = states.state();
    let reason = loop {
        match state {
            zk::SessionState::Expired => break "the ZooKeeper session expired",
            zk::SessionState::Closed => break "the ZooKeeper session was closed",
            zk::SessionState::AuthFailed => break "ZooKeeper authentication failed",
            // Dropping the last client closes the session, which ends here
            // as `Closed`.
            _ => state = states.changed().await,
        }
    };
    if let Some(s) = session.upgrade() {
        s.end_with_warning(reason.to_owned());
    }
}

/// How long after sending a request the server answered the session is
/// known alive: two thirds of the negotiated session timeout. The server
/// expires a session a timeout after the last request it received from it,
/// and it received an answered request after it was sent; the third left
/// over covers clock drift, telling the holders, and the holders stopping.
fn known_alive(session_timeout: Duration) -> Duration {
    session_timeout * 2 / 3
}

/// Keeps a session known alive, or ends it (its locks are told lost) before
/// the server can expire it and grant its locks to someone else.
///
/// Only answers count: a `sync` every sixth of the session timeout, whose
/// send time, once answered, moves [`Session::alive_until`] to that time
/// plus [`known_alive`]. Watch notifications and other traffic from the
/// server prove nothing about what the server has heard from this client
/// (under a one-way partition they keep coming while every request is
/// lost), so they never count; the client library's own disconnect
/// detection, which counts them, is not relied upon either. `sync` rather
/// than a read, so that on an ensemble the answer comes through the leader,
/// which is where sessions expire.
async fn keep_alive(session: Weak<Session>, known_alive: Duration) {
    let every = known_alive / 4;
    loop {
        let Some(s) = session
            .upgrade()
            .filter(|s| !s.ended.load(Ordering::Acquire))
        else {
            return;
        };
        let deadline = s.alive_until.get();
        // A clone of the client, not the session, is kept while waiting: an
        // unused session still closes when its last user drops it.
        let client = s.client.clone();
        drop(s);
        let sent = std::time::Instant::now();
        let answer = tokio::time::timeout_at(deadline.into(), client.sync("/")).await;
        drop(client);
        let Some(s) = session.upgrade() else { return };
        match answer {
            Ok(Ok(())) => {
                s.alive_until.extend(sent + known_alive);
                drop(s);
                tokio::time::sleep_until((sent + every).into()).await;
            }
            Err(_) => {
                let silent = sent.saturating_duration_since(deadline - known_alive) + known_alive;
                s.end_with_warning(format!(
                    "no answer from ZooKeeper to a request sent {} ms ago; the session may expire",
                    silent.as_millis().max(known_alive.as_millis())
                ));
                return;
            }
            // Disconnected, or the session ended (which `watch_session`
            // reports): try again shortly, until the deadline.
            Ok(Err(_)) => {
                drop(s);
                let retry = (sent + every / 8).min(deadline);
                tokio::time::sleep_until(retry.into()).await;
            }
        }
    }
}

/// Whether a request failed without a definite answer: the connection
/// broke (the client reports that as `ConnectionLoss`, or as a custom error
/// for a socket error or a silent server) and the request may or may not
/// have been applied. The session may well survive it.
pub(super) fn uncertain(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::ConnectionLoss | zk::Error::Custom(_) | zk::Error::Timeout
    )
}

/// Runs a ZooKeeper call again after an [uncertain] failure, until it
/// succeeds, fails for certain, or the session ends (for an acquire, also
/// when this backend has given the session up).
pub(super) async fn retry<T, F, Fut>(
    session: &Session,
    doing: &str,
    call: F,
) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, zk::Error>>,
{
    retry_while(session, Session::usable, call)
        .await
        .map_err(|e| zk_error(doing, e))
}

/// Whether a session still lives at all, even given up: its nodes live as
/// long as it does, so cleaning up goes on until then.
pub(super) fn alive(session: &Session) -> bool {
    !session.client.state().is_terminated()
}

/// [`retry`], going on while `go_on(session)`, with the client's error.
pub(super) async fn retry_while<T, F, Fut>(
    session: &Session,
    go_on: impl Fn(&Session) -> bool,
    call: F,
) -> Result<T, zk::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, zk::Error>>,
{
    crate::backend::engine::retry::retry_uncertain(uncertain, || go_on(session), call).await
}

/// Lock parents this session has seen exist, so that it creates a lock
/// node under one with a plain `create` (and a listing), and under any
/// other creates the parent and the node in one `multi` (a semaphore's
/// lease: the parent's `create` sent just before the node's): one round
/// trip either way, where a `create` under a missing parent fails and costs
/// two more (the parent, then the node again). Wrong, it costs a round trip
/// more: a failed `multi` under a parent another client made, or a failed
/// `create` under a parent the server has reaped since (a container, once
/// empty), with two more. Bounded: emptied when full, so a service that
/// locks ever new keys keeps at most [`KnownDirs::MAX`] names, and after
/// each emptying a key it locks again costs that failed `multi` once.
#[derive(Default)]
pub(super) struct KnownDirs(std::sync::Mutex<std::collections::HashSet<String>>);

impl KnownDirs {
    pub(super) const MAX: usize = 4096;

    pub(super) fn contains(&self, dir: &str) -> bool {
        crate::sync::lock(&self.0).contains(dir)
    }

    pub(super) fn insert(&self, dir: &str) {
        let mut dirs = crate::sync::lock(&self.0);
        if dirs.len() >= Self::MAX {
            dirs.clear();
        }
        dirs.insert(dir.to_owned());
    }

    pub(super) fn remove(&self, dir: &str) {
        crate::sync::lock(&self.0).remove(dir);
    }
}
