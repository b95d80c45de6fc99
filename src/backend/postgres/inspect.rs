//! Who holds a key, in each mode: `pg_locks` with `pg_stat_activity` for
//! advisory locks, the row for the lease table.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::session::{pg_error, Advisory};
use super::table::LeaseTable;
use super::token_of;
use crate::backend::{BreakScope, Broken, Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;

/// The advisory locks on a key's hash in this database, granted or
/// waited for, with the session that holds or waits: its server process,
/// client address and application name.
const ADVISORY: &str = "SELECT l.granted, l.mode, a.pid, a.client_addr::text, a.application_name \
     FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended($1, 0)";

/// Ends the sessions among `$2` that still hold an advisory lock on key
/// `$1`, in the statement that checks it (a session that let go in between
/// may hold other locks), waiting up to 5 s for each (PostgreSQL 14+): each
/// one's pid and whether it ended.
const TERMINATE: &str = "SELECT pid, pg_terminate_backend(pid, 5000) FROM (SELECT DISTINCT l.pid \
     FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
     AND l.pid = ANY($2) \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended($1, 0)) held";

impl Advisory {
    /// Holders (mode and session; no token, which the server does not
    /// keep) and the sessions waiting in the server. A semaphore's permits
    /// are locks on other hashes, not shown.
    ///
    /// Runs on a connection of its own, not the one free locks are taken
    /// on (whose keep-alive a slow `pg_locks` scan would hold up), in a
    /// transaction bounded by a statement timeout.
    pub(super) async fn inspect(&self, key: LockKey) -> Result<Inspection, LockError> {
        let session = self.dedicated().await?;
        let rows = advisory_rows(&session.client, key.as_str()).await;
        if rows.is_ok() {
            self.give_back(session);
        } else {
            session.end("inspecting a lock failed");
        }
        let rows = rows.map_err(|e| pg_error("inspecting a lock", e))?;
        let waiters = rows.iter().filter(|row| !row.get::<_, bool>(0)).count();
        Ok(Inspection {
            key,
            holders: rows.iter().filter_map(holder_of).map(|(_, h)| h).collect(),
            waiters: Some(u32::try_from(waiters).unwrap_or(u32::MAX)),
        })
    }

    /// Ends the holders' sessions ([`TERMINATE`]); only with
    /// [`BreakScope::Sessions`], as the server frees an advisory lock only
    /// for its session. The floor is drawn from the token sequence before
    /// the listing for a key found free, after it for holders (whose tokens
    /// their lock statement drew), and the listing is done again if a holder
    /// let go meanwhile. A lock statement that had taken its lock but not
    /// yet drawn its token when the floor was drawn (microseconds apart)
    /// may get a token above the floor; its session is ended all the same.
    /// On a connection of its own, as [`inspect`](Self::inspect).
    pub(super) async fn break_key(
        &self,
        key: LockKey,
        scope: BreakScope,
    ) -> Result<Broken, LockError> {
        let session = self.dedicated().await?;
        let next = format!("SELECT nextval('{}')", self.sequence);
        let run = async {
            let client = &session.client;
            let drawn: Option<i64> = client
                .query_one(&drawn_before(&self.sequence), &[])
                .await?
                .get(0);
            if drawn.is_none() {
                return Ok(Err(unused_sequence(&self.sequence)));
            }
            let mut freed = Vec::new();
            loop {
                // Drawn before the listing: a lock taken after it draws later.
                let before: i64 = client.query_one(&next, &[]).await?.get(0);
                let rows = advisory_rows(client, key.as_str()).await?;
                let held: Vec<(i32, Holder)> = rows.iter().filter_map(holder_of).collect();
                if held.is_empty() {
                    return Ok(Ok(Broken {
                        key,
                        holders: freed,
                        floor: token_of(before),
                    }));
                }
                let pids: Vec<i32> = held.iter().map(|(pid, _)| *pid).collect();
                if scope == BreakScope::LocksOnly {
                    let pids: Vec<String> = pids.iter().map(i32::to_string).collect();
                    return Ok(Err(LockError::Unsupported(format!(
                        "PostgreSQL frees an advisory lock only when its holder unlocks it or \
                         its session ends: breaking it ends server process {} and frees every \
                         lock it holds (needs pg_signal_backend); ask for that with --force \
                         (BreakScope::Sessions)",
                        pids.join(", ")
                    ))));
                }
                // Drawn after the listing: above the holders' tokens, drawn
                // in the statement that took their lock.
                let floor: i64 = client.query_one(&next, &[]).await?.get(0);
                let ended = client.query(TERMINATE, &[&key.as_str(), &pids]).await?;
                let mut all = true;
                for (pid, holder) in held {
                    match ended.iter().find(|row| row.get::<_, i32>(0) == pid) {
                        Some(row) if row.get::<_, bool>(1) => freed.push(holder),
                        Some(_) => {
                            return Ok(Err(LockError::backend(
                                "postgres",
                                format!(
                                    "server process {pid} did not end within 5 s of \
                                     pg_terminate_backend (the floor is {}): break again",
                                    token_of(floor)
                                ),
                                None,
                            )))
                        }
                        // It let go between the listing and now.
                        None => all = false,
                    }
                }
                if all {
                    return Ok(Ok(Broken {
                        key,
                        holders: freed,
                        floor: token_of(floor),
                    }));
                }
            }
        };
        let outcome: Result<_, tokio_postgres::Error> = run.await;
        if outcome.is_ok() {
            self.give_back(session);
        } else {
            session.end("breaking a lock failed");
        }
        outcome.map_err(|e| pg_error("breaking a lock", e))?
    }
}

/// The rows of [`ADVISORY`] for `key`, in a transaction bounded by a
/// statement timeout.
async fn advisory_rows(
    client: &tokio_postgres::Client,
    key: &str,
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    client
        .batch_execute("BEGIN; SET LOCAL statement_timeout = 10000")
        .await?;
    let rows = client.query(ADVISORY, &[&key]).await;
    client.batch_execute("COMMIT").await?;
    rows
}

/// A granted row of [`ADVISORY`]: the holder's server process and what
/// it shows.
fn holder_of(row: &tokio_postgres::Row) -> Option<(i32, Holder)> {
    if !row.get::<_, bool>(0) {
        return None;
    }
    let mode = match row.get::<_, &str>(1) {
        "ShareLock" => LockMode::Read,
        _ => LockMode::Exclusive,
    };
    let pid: i32 = row.get(2);
    let addr: Option<&str> = row.get(3);
    let app: Option<&str> = row.get(4);
    let mut who = format!("server process {pid}");
    if let Some(addr) = addr {
        who += &format!(" for {addr}");
    }
    if let Some(app) = app.filter(|a| !a.is_empty()) {
        who += &format!(" ({app})");
    }
    Some((pid, Holder::new(None).mode(mode).identity(who)))
}

/// A row of the lease table's `inspect`: its owner, and the holder it
/// shows.
fn table_holder(row: &tokio_postgres::Row) -> (String, Holder) {
    let owner: &str = row.get(0);
    let left = u64::try_from(row.get::<_, i64>(1)).unwrap_or(0);
    let holder = Holder::new(None)
        .mode(LockMode::Exclusive)
        .lease_left(Duration::from_millis(left))
        .identity(format!("owner {owner}"));
    (owner.to_owned(), holder)
}

/// The last value drawn from `sequence`, NULL if none ever was.
fn drawn_before(sequence: &str) -> String {
    format!("SELECT pg_sequence_last_value('{sequence}'::regclass)")
}

/// The token sequence had never been drawn from (connecting may just have
/// made it): the application's tokens come from another, and a floor from
/// this one would be below them.
fn unused_sequence(sequence: &str) -> LockError {
    LockError::Config(format!(
        "the token sequence {sequence} had never been drawn from, so the holder's tokens come \
         from another: name the application's with ?sequence=name in the URL \
         (PostgresOptions::sequence)"
    ))
}

impl LeaseTable {
    /// The keys of the rows whose lease has not run out.
    pub(super) async fn list(&self, prefix: &str) -> Result<Vec<LockKey>, LockError> {
        let conn = self.conn(prefix).await?;
        let rows = conn
            .client
            .query_typed(&self.sql.list, &[(&prefix, Type::TEXT)])
            .await
            .map_err(|e| pg_error("listing locks", e))?;
        Ok(rows
            .iter()
            .filter_map(|row| LockKey::new(row.get::<_, &str>(0)).ok())
            .collect())
    }

    /// The row's owner and the time its lease has left; waiters are not
    /// counted (a row keeps only whether someone wants it).
    pub(super) async fn inspect(&self, key: LockKey) -> Result<Inspection, LockError> {
        // Unnamed statements: through a transaction pooler a named one
        // could be prepared on one server session and run on another.
        let conn = self.conn(key.as_str()).await?;
        let rows = conn
            .client
            .query_typed(&self.sql.inspect, &[(&key.as_str(), Type::TEXT)])
            .await
            .map_err(|e| pg_error("inspecting a lock", e))?;
        let holders = rows.iter().map(|row| table_holder(row).1).collect();
        Ok(Inspection {
            key,
            holders,
            waiters: None,
        })
    }

    /// Deletes the row if it still has the owner read, and notifies its
    /// waiters as a release does; reads again if the owner changed. The
    /// floor is drawn from the token sequence after the read for a holder
    /// (its grant drew its token before its row could be read), before it
    /// for a key found free (a later grant draws later). A grant whose
    /// statement ran across both (it drew before the floor and committed
    /// after the read, microseconds apart) gets a token below the floor.
    pub(super) async fn break_key(&self, key: LockKey) -> Result<Broken, LockError> {
        let conn = self.conn(key.as_str()).await?;
        let next = format!("SELECT nextval('{}')", self.sequence);
        let fail = |e| pg_error("breaking a lock", e);
        // Unnamed statements, as every one through a transaction pooler.
        let draw = || async {
            let drawn = conn.client.query_typed(&next, &[]).await.map_err(fail)?;
            match drawn.first() {
                Some(row) => Ok(token_of(row.get::<_, i64>(0))),
                None => Err(LockError::backend(
                    "postgres",
                    "nextval answered no row",
                    None,
                )),
            }
        };
        let drawn = conn
            .client
            .query_typed(&drawn_before(&self.sequence), &[])
            .await
            .map_err(fail)?;
        if drawn
            .first()
            .and_then(|row| row.get::<_, Option<i64>>(0))
            .is_none()
        {
            return Err(unused_sequence(&self.sequence));
        }
        loop {
            // Drawn before the read: a grant after it draws later.
            let before = draw().await?;
            let rows = conn
                .client
                .query_typed(&self.sql.inspect, &[(&key.as_str(), Type::TEXT)])
                .await
                .map_err(fail)?;
            let Some((owner, holder)) = rows.first().map(table_holder) else {
                return Ok(Broken {
                    key,
                    holders: Vec::new(),
                    floor: before,
                });
            };
            // Drawn after: the holder's grant drew before writing its row.
            let floor = draw().await?;
            let deleted = conn
                .client
                .query_typed(
                    &self.sql.release,
                    &[(&key.as_str(), Type::TEXT), (&owner, Type::TEXT)],
                )
                .await
                .map_err(fail)?;
            if !deleted.is_empty() {
                return Ok(Broken {
                    key,
                    holders: vec![holder],
                    floor,
                });
            }
        }
    }
}
