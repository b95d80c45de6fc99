//! The etcd lease every lock of a backend is attached to: granting it,
//! knowing it alive from keep-alive answers, and ending it.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use etcd_client as etcd;

use crate::backend::engine::holds::Holds;
use crate::backend::engine::InFlight;
use crate::error::LockError;
use crate::lost::Deadline;
use crate::sync::lock;

/// An etcd client and its lease: the store behind
/// [`EtcdBackend`](super::EtcdBackend). Its acquire path is in the module;
/// the engine ([`RemoteBackend`](crate::backend::RemoteBackend)) does the
/// rest.
pub struct EtcdStore {
    pub(super) endpoints: Vec<String>,
    pub(super) root: String,
    pub(super) ttl: Duration,
    pub(super) connect_timeout: Duration,
    /// One client (one channel, balanced over the endpoints) for every
    /// session.
    pub(super) client: etcd::Client,
    pub(super) current: Mutex<Option<Arc<Session>>>,
    /// One lease being granted at a time.
    pub(super) opening: tokio::sync::Mutex<()>,
    /// Deletes sent and not yet answered, on every session.
    pub(super) releases: Arc<InFlight>,
    /// Numbers the contender keys' values, unique per acquisition: a
    /// create sent again finds by it whether the key is its own.
    pub(super) next: std::sync::atomic::AtomicU64,
    /// Who holds a key, after the number in its value, for `inspect`.
    pub(super) identity: String,
}

/// One etcd lease and the locks attached to it.
pub(super) struct Session {
    pub(super) client: etcd::Client,
    pub(super) lease: i64,
    /// The TTL the server granted the lease.
    pub(super) ttl: Duration,
    /// Until when the server surely keeps the lease: see [`keep_alive`].
    /// Its locks share it.
    pub(super) alive_until: Arc<Deadline>,
    /// Set when the lease ends or is given up: no new lock is taken on it,
    /// and every lock it holds is lost with it.
    pub(super) ended: AtomicBool,
    /// Wakes the acquisitions waiting on this lease when it ends.
    pub(super) ended_notify: tokio::sync::Notify,
    /// The locks held on this lease, by key, told when it ends.
    pub(super) holds: Holds<String>,
    /// The backend's deletes in flight.
    pub(super) releases: Arc<InFlight>,
    /// The contender key names in use (see [`Slot`](super::contender::Slot)).
    pub(super) slots: Mutex<HashSet<String>>,
}

pub(super) fn etcd_error(doing: &str, e: etcd::Error) -> LockError {
    LockError::backend("etcd", doing.to_owned(), Some(Box::new(e) as _))
}

/// Whether a request failed without a definite answer (the connection
/// broke, the server had no leader, the request timed out): it may or may
/// not have been applied, and the lease may well survive it.
pub(super) fn uncertain(e: &etcd::Error) -> bool {
    // gRPC codes: cancelled 1, unknown 2, deadline exceeded 4, aborted 10,
    // internal 13, unavailable 14.
    match e {
        etcd::Error::GRpcStatus(status) => {
            matches!(i32::from(status.code()), 1 | 2 | 4 | 10 | 13 | 14)
        }
        etcd::Error::TransportError(_)
        | etcd::Error::IoError(_)
        | etcd::Error::WatchError(_)
        | etcd::Error::LeaseKeepAliveError(_) => true,
        _ => false,
    }
}

impl Session {
    /// Whether new requests may use this lease.
    pub(super) fn usable(&self) -> bool {
        !self.ended.load(Ordering::Acquire) && !self.alive_until.passed()
    }

    /// Ends the lease for this backend, saying why in the log: tells its
    /// waiters and holders, and sends no more keep-alives.
    ///
    /// It is not revoked: its holders were told a third of the TTL before
    /// the server could expire it, and that time is theirs to stop in. A
    /// revoke would free their keys at once (under a one-way partition it
    /// still gets through); the server expires the lease a TTL after the
    /// last keep-alive it received instead.
    pub(super) fn end(&self, reason: String) {
        if self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(lease = self.lease, reason, "etcd locks lost");
        self.ended_notify.notify_waiters();
        self.holds.end(&reason);
    }

    fn revoke_in_background(&self) {
        let Some(rt) = self.releases.runtime() else {
            return;
        };
        let (mut client, lease) = (self.client.clone(), self.lease);
        // Bounded: past the TTL the server has expired it anyway.
        let within = Duration::from_secs(10);
        self.releases.spawn(&rt, async move {
            let _ = tokio::time::timeout(within, client.lease_revoke(lease)).await;
        });
    }

    /// Waits until `wait` completes or the lease ends.
    pub(super) async fn unless_ended<T>(
        &self,
        wait: impl Future<Output = T>,
    ) -> Result<T, LockError> {
        let ended = self.ended_notify.notified();
        tokio::pin!(ended);
        // Registered before the check, so an end in between is not missed.
        ended.as_mut().enable();
        if !self.ended.load(Ordering::Acquire) {
            tokio::select! {
                done = wait => return Ok(done),
                _ = ended => {}
            }
        }
        Err(LockError::backend(
            "etcd",
            "the etcd lease ended while waiting",
            None,
        ))
    }
}

impl Drop for Session {
    /// The last user of the lease is gone: revoke it, so that nothing it
    /// holds lingers until its TTL.
    fn drop(&mut self) {
        if !self.ended.load(Ordering::Acquire) {
            self.revoke_in_background();
        }
    }
}

impl EtcdStore {
    /// The live lease, granting a new one if there is none or it ended.
    pub(super) async fn session(&self) -> Result<Arc<Session>, LockError> {
        if let Some(s) = lock(&self.current).as_ref().filter(|s| s.usable()) {
            return Ok(s.clone());
        }
        let _opening = self.opening.lock().await;
        if let Some(s) = lock(&self.current).as_ref().filter(|s| s.usable()) {
            return Ok(s.clone());
        }
        // The lease cannot have been granted before this.
        let sent = Instant::now();
        let ttl = self.ttl.as_secs().max(1) as i64;
        let mut client = self.client.clone();
        let granted =
            match tokio::time::timeout(self.connect_timeout, client.lease_grant(ttl, None)).await {
                Ok(Ok(granted)) => granted,
                Ok(Err(e)) => {
                    return Err(etcd_error(
                        &format!("granting a lease at {}", self.endpoints.join(",")),
                        e,
                    ))
                }
                Err(_) => {
                    return Err(LockError::backend(
                        "etcd",
                        format!(
                            "no answer from etcd at {} within {} ms",
                            self.endpoints.join(","),
                            self.connect_timeout.as_millis()
                        ),
                        None,
                    ))
                }
            };
        // The server may grant more than asked (its minimum TTL).
        let ttl = Duration::from_secs(granted.ttl().max(1) as u64);
        let known_alive = known_alive(ttl);
        let session = Arc::new(Session {
            client,
            lease: granted.id(),
            ttl,
            alive_until: Arc::new(Deadline::new(sent + known_alive)),
            ended: AtomicBool::new(false),
            ended_notify: tokio::sync::Notify::new(),
            holds: Holds::new(),
            releases: self.releases.clone(),
            slots: Mutex::default(),
        });
        // Under the root: a role limited to it may read there.
        let confirm = format!("{}/\0term", self.root);
        tokio::spawn(keep_alive(Arc::downgrade(&session), known_alive, confirm));
        *lock(&self.current) = Some(session.clone());
        Ok(session)
    }
}

/// How long after sending a keep-alive the leader answered the lease is
/// known alive: two thirds of its TTL. The leader expires a lease a TTL
/// after the last keep-alive it received (a new leader even starts every
/// lease afresh), and it received an answered one after it was sent; the
/// third left over covers clock drift, telling the holders, and the holders
/// stopping.
fn known_alive(ttl: Duration) -> Duration {
    ttl * 2 / 3
}

/// What one keep-alive round found.
enum Round {
    /// Renewed by the leader of the current term.
    Renewed,
    /// Answered, but not surely by the current leader (or the stream was
    /// just opened): counts for nothing, try again soon.
    Unconfirmed,
    /// The lease is gone.
    Gone,
}

/// Keeps a lease known alive, or ends it (its locks are told lost) before
/// the server can expire it and grant its locks to someone else.
///
/// Only answers count: a keep-alive every sixth of the TTL, whose send
/// time, once answered, moves [`Session::alive_until`] to that time plus
/// [`known_alive`]. Nothing else the server sends (watch events, the
/// connection's pings) proves what it has heard from this client, so
/// nothing else counts. An answer with a TTL of zero means the lease is
/// gone (expired, or revoked by someone else): its locks are lost at once.
///
/// An answer counts only when a linearizable read sent after it comes from
/// the same raft term. A lease lives in the leader's memory, and etcd 3.4
/// lets a leader that has been deposed but does not know it yet (paused,
/// cut off) renew a lease: the new leader never hears of it and expires
/// the lease on time, while the holder would count on it (the torture
/// harness caught this on a three-member cluster with the leader paused).
/// Only one leader holds a term, and a read is answered in the current term
/// only once a quorum confirms it, so equal terms mean the leader that
/// renewed was still the leader after the renewal.
async fn keep_alive(session: Weak<Session>, known_alive: Duration, confirm: String) {
    let every = known_alive / 4;
    let mut stream: Option<(etcd::LeaseKeeper, etcd::LeaseKeepAliveStream)> = None;
    loop {
        let Some(s) = session
            .upgrade()
            .filter(|s| !s.ended.load(Ordering::Acquire))
        else {
            return;
        };
        let deadline = s.alive_until.get();
        // The client, not the session, is kept while waiting: an unused
        // session still ends when its last user drops it.
        let (mut client, lease) = (s.client.clone(), s.lease);
        drop(s);
        let sent = Instant::now();
        let answer = tokio::time::timeout_at(deadline.into(), async {
            let Some((keeper, answers)) = stream.as_mut() else {
                // Opening the stream sends a first keep-alive and reads its
                // answer (refusing a TTL of zero), without its header.
                stream = Some(client.lease_keep_alive(lease).await?);
                return Ok(Round::Unconfirmed);
            };
            keeper.keep_alive().await?;
            let Some(answer) = answers.message().await? else {
                return Err(etcd::Error::LeaseKeepAliveError(
                    "the keep-alive stream closed".into(),
                ));
            };
            if answer.ttl() <= 0 {
                return Ok(Round::Gone);
            }
            let renewed_in = answer.header().map_or(0, |h| h.raft_term());
            let read = client
                .get(
                    confirm.as_str(),
                    Some(etcd::GetOptions::new().with_count_only()),
                )
                .await?;
            let current = read.header().map_or(0, |h| h.raft_term());
            Ok(if renewed_in != 0 && renewed_in == current {
                Round::Renewed
            } else {
                Round::Unconfirmed
            })
        })
        .await;
        let Some(s) = session.upgrade() else { return };
        match answer {
            Ok(Ok(Round::Renewed)) => {
                s.alive_until.extend(sent + known_alive);
                drop(s);
                tokio::time::sleep_until((sent + every).into()).await;
            }
            Ok(Ok(Round::Gone)) => {
                s.end("the etcd lease expired or was revoked".into());
                return;
            }
            Ok(Err(etcd::Error::LeaseKeepAliveError(e))) if e.contains("not found") => {
                s.end("the etcd lease expired or was revoked".into());
                return;
            }
            Err(_) => {
                let silent = sent.saturating_duration_since(deadline - known_alive) + known_alive;
                s.end(format!(
                    "no answer from etcd to a keep-alive sent {} ms ago; the lease may expire",
                    silent.as_millis().max(known_alive.as_millis())
                ));
                return;
            }
            // Try again shortly, until the deadline; after a broken
            // connection, on a new stream.
            Ok(other) => {
                if other.is_err() {
                    stream = None;
                }
                drop(s);
                let retry = (sent + every / 8).min(deadline);
                tokio::time::sleep_until(retry.into()).await;
            }
        }
    }
}

/// Runs an etcd call again after an [uncertain] failure, while `go_on`.
pub(super) async fn retry_while<T, F, Fut>(
    session: &Session,
    go_on: impl Fn(&Session) -> bool,
    call: F,
) -> Result<T, etcd::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd::Error>>,
{
    crate::backend::engine::retry::retry_uncertain(uncertain, || go_on(session), call).await
}

/// [`retry_while`] the lease is usable, with the error as a [`LockError`];
/// given up when the lease ends (a request may hang unanswered).
pub(super) async fn retry<T, F, Fut>(
    session: &Session,
    doing: &str,
    call: F,
) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd::Error>>,
{
    session
        .unless_ended(retry_while(session, Session::usable, call))
        .await?
        .map_err(|e| etcd_error(doing, e))
}
