//! Session-level advisory locks: the acquire path, the statements, one
//! attempt (undone when abandoned), and a held lock's release.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use tokio_postgres::NoTls;

use super::session::{pg_error, pooled, Advisory, Session, POOLED};
use super::PostgresBackend;
use crate::backend::engine::lease::{release_in_background, Lease, Protocol, Released};
use crate::backend::{Acquired, LockRequest};
use crate::error::LockError;
use crate::mode::{LockMode, Wait};

/// Gives each held lock its entry in its session's holds.
static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

impl Advisory {
    pub(super) async fn acquire(
        self: Arc<Self>,
        request: LockRequest,
    ) -> Result<Acquired, LockError> {
        if let LockMode::Semaphore { permits } = request.mode {
            if permits == 0 {
                return Err(LockError::InvalidMode(
                    "a semaphore needs at least one permit".into(),
                ));
            }
            return self.acquire_permit(&request, permits).await;
        }
        let read = request.mode == LockMode::Read;
        let key = request.key.as_str();
        let tokens = if read { 1 } else { request.tokens };
        let fail_fast = request.wait == Wait::FailFast;
        // A free key: one try on the shared connection.
        let shared = self.shared().await?;
        // Before the claim: a caller that gives up while this waits leaves
        // no claim behind.
        shared.alive.quarantine().await;
        if shared.claim(key) {
            let sent = Instant::now();
            if let Some(n) = attempt(&self, &shared, key, read, false).await? {
                shared.alive.answered(sent);
                return Ok(self.held(shared, key, read, n, tokens));
            }
            if fail_fast {
                return Err(LockError::Busy);
            }
        }
        // A held key (or one this process holds on the shared connection):
        // wait in the server on a connection of its own.
        self.wait_in_server(key, read, !fail_fast, tokens).await
    }

    /// Takes `key` on a connection of its own: waits for it in the server
    /// (`wait`), or tries it once. The connection then holds the lock.
    async fn wait_in_server(
        self: &Arc<Self>,
        key: &str,
        read: bool,
        wait: bool,
        tokens: u32,
    ) -> Result<Acquired, LockError> {
        let session = self.dedicated().await?;
        session.claim(key);
        session.alive.quarantine().await;
        let sent = Instant::now();
        let Some(n) = attempt(self, &session, key, read, wait).await? else {
            self.give_back(session);
            return Err(LockError::Busy);
        };
        session.alive.answered(sent);
        // A long wait: the grant counts from a send time long past. One
        // more round trip makes the connection known alive from now.
        if session.alive.stale_after(sent) {
            if let Err(e) = session.ping().await {
                session.end("the connection failed as the lock was granted");
                return Err(e);
            }
        }
        Ok(self.held(session, key, read, n, tokens))
    }

    /// One of `permits` permits of a semaphore: the exclusive advisory
    /// lock of one of its permit keys. Each free-looking permit is tried on
    /// the shared connection, starting from a different one each time;
    /// if none is free, the wait is in the server for one permit, chosen
    /// in turn, on a connection of its own.
    async fn acquire_permit(
        self: Arc<Self>,
        request: &LockRequest,
        permits: u32,
    ) -> Result<Acquired, LockError> {
        let key = request.key.as_str();
        let start = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let shared = self.shared().await?;
        shared.alive.quarantine().await;
        for i in 0..permits as usize {
            let permit = permit_key(key, (start + i) % permits as usize);
            if !shared.claim(&permit) {
                continue;
            }
            let sent = Instant::now();
            if let Some(n) = attempt(&self, &shared, &permit, false, false).await? {
                shared.alive.answered(sent);
                return Ok(self.held(shared, &permit, false, n, 1));
            }
        }
        if request.wait == Wait::FailFast {
            return Err(LockError::Busy);
        }
        let permit = permit_key(key, start % permits as usize);
        self.wait_in_server(&permit, false, true, 1).await
    }

    /// A grant as an [`Acquired`], listed with its session.
    fn held(
        self: &Arc<Self>,
        session: Arc<Session>,
        key: &str,
        read: bool,
        n: i64,
        tokens: u32,
    ) -> Acquired {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let token = super::token_of(n);
        let held = AdvisoryLock {
            pg: self.clone(),
            session: session.clone(),
            key: key.to_owned(),
            read,
            id,
        };
        let lease = Lease::new(
            held,
            self.lease,
            session.alive.until.clone(),
            self.releases.clone(),
        );
        session.holds.insert(id, &lease, ());
        lease.acquired(token, tokens.clamp(1, PostgresBackend::TOKEN_SPACING))
    }
}

/// The advisory key text of a semaphore's permit `i`: the key, a control
/// character (which no lock key contains) and the number, so that no lock
/// key names a permit.
fn permit_key(key: &str, i: usize) -> String {
    format!("{key}\u{1}permit{i}")
}

/// Sends one lock statement on `session` for `key`, which the caller has
/// claimed there: `wait` blocks in the server until granted, otherwise it
/// is a try. The token sequence's value on a grant, `None` when busy.
///
/// Dropped before the answer (the caller gave up), or failed, it may still
/// have granted the lock, and it is undone: on the shared session by an
/// unlock sent after it on the same connection; on a session of its own,
/// by cancelling the wait and closing the session. Either way the claim is
/// given up once nothing can be left.
pub(super) async fn attempt(
    pg: &Arc<Advisory>,
    session: &Arc<Session>,
    key: &str,
    read: bool,
    wait: bool,
) -> Result<Option<i64>, LockError> {
    let mut undo = Undo {
        pg,
        session,
        key,
        read,
        armed: true,
    };
    let statements = &session.statements;
    let statement = if wait {
        &statements.lock[usize::from(read)]
    } else {
        &statements.try_lock[usize::from(read)]
    };
    let row = session
        .client
        .query_one(statement, &[&key])
        .await
        .map_err(|e| pg_error("taking an advisory lock", e))?;
    let token: Option<i64> = row.get(0);
    undo.armed = false;
    if token == Some(-1) {
        session.unclaim(key);
        session.end(POOLED);
        return Err(pooled());
    }
    if token.is_none() {
        session.unclaim(key);
    }
    Ok(token)
}

/// An attempt that may have granted a lock nobody will hold.
struct Undo<'a> {
    pg: &'a Arc<Advisory>,
    session: &'a Arc<Session>,
    key: &'a str,
    read: bool,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let session = self.session.clone();
        if !self.pg.is_shared(&session) {
            // A wait of its own: cancel it on the server and close the
            // session, which frees whatever the wait got.
            session.end("an abandoned wait");
            let cancel = session.client.cancel_token();
            let limit = self.pg.connect_timeout;
            if let Some(rt) = self.pg.releases.runtime() {
                self.pg.releases.spawn(&rt, async move {
                    let _ = tokio::time::timeout(limit, cancel.cancel_query(NoTls)).await;
                });
            }
            return;
        }
        let key = self.key.to_owned();
        let read = self.read;
        release_in_background(
            async move {
                let unlock = &session.statements.unlock[usize::from(read)];
                let answer = session.client.query_one(unlock, &[&key]).await;
                if answer.is_err() {
                    // Closing the session frees whatever it holds.
                    session.end("an unlock failed");
                }
                session.unclaim(&key);
                Ok(())
            },
            &self.pg.releases,
            "postgres",
        );
    }
}

/// A held advisory lock.
pub(super) struct AdvisoryLock {
    pub(super) pg: Arc<Advisory>,
    pub(super) session: Arc<Session>,
    pub(super) key: String,
    pub(super) read: bool,
    /// Its entry in the session's holds.
    pub(super) id: usize,
}

impl AdvisoryLock {
    /// One unlock; a failure closes the session, which frees the lock.
    async fn unlock(&self) -> Result<(), LockError> {
        self.session.holds.remove(&self.id);
        let unlock = &self.session.statements.unlock[usize::from(self.read)];
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&self.key];
        let mut query = std::pin::pin!(self.session.client.query_one(unlock, &params));
        // The first poll puts the unlock on the connection, and whatever is
        // sent on it later is applied after it: the key may be claimed (and
        // tried) on this session again at once, without waiting for the
        // answer.
        let first = std::future::poll_fn(|cx| Poll::Ready(query.as_mut().poll(cx))).await;
        self.session.unclaim(&self.key);
        let answer = match first {
            Poll::Ready(answer) => answer,
            Poll::Pending => query.await,
        };
        let result = match answer {
            Ok(row) => match row.get::<_, Option<bool>>(0) {
                Some(true) => Ok(()),
                Some(false) => {
                    tracing::warn!(
                        key = self.key,
                        "postgres had no such advisory lock on this session to release"
                    );
                    Ok(())
                }
                None => {
                    self.session.end(POOLED);
                    Err(pooled())
                }
            },
            Err(e) => {
                self.session.end("an unlock failed");
                Err(pg_error("releasing an advisory lock", e))
            }
        };
        self.pg.give_back(self.session.clone());
        result
    }
}

impl Protocol for AdvisoryLock {
    const BACKEND: &'static str = "postgres";
    const EXPIRED: &'static str =
        "the PostgreSQL connection is no longer known alive (no answer within the lease)";

    fn describe(&self) -> &str {
        &self.key
    }

    /// Never called: the session's keep-alive serves all its locks.
    async fn renew(&self, _lease: std::time::Duration) -> Result<(), String> {
        Ok(())
    }

    async fn release(&self) -> Released {
        Released {
            result: self.unlock().await,
            // A failed unlock closed the session: nothing to retry.
            again: false,
        }
    }

    async fn release_until(&self, _deadline: Instant) -> Result<(), LockError> {
        self.unlock().await
    }
}
