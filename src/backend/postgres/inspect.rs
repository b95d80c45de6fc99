//! Who holds a key, in each mode: `pg_locks` with `pg_stat_activity` for
//! advisory locks, the row for the lease table.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::session::{pg_error, Advisory};
use super::table::LeaseTable;
use super::PostgresBackend;
use crate::backend::{BreakScope, Broken, Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;
use crate::token::FencingToken;

/// The advisory locks on a key's hash in this database, granted or
/// waited for, with the session that holds or waits: its server process,
/// client address and application name.
const ADVISORY: &str = "SELECT l.granted, l.mode, a.pid, a.client_addr::text, a.application_name \
     FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended($1, 0)";

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

    /// Ends the holders' sessions (`pg_terminate_backend`, waiting up to
    /// 5 s for each to end), after drawing the floor from the token
    /// sequence; only with [`BreakScope::Sessions`], as the server frees an
    /// advisory lock only for its session. On a connection of its own, as
    /// [`inspect`](Self::inspect).
    pub(super) async fn break_key(
        &self,
        key: LockKey,
        scope: BreakScope,
    ) -> Result<Broken, LockError> {
        let session = self.dedicated().await?;
        let run = async {
            let client = &session.client;
            let rows = advisory_rows(client, key.as_str()).await?;
            let held: Vec<(i32, Holder)> = rows.iter().filter_map(holder_of).collect();
            if !held.is_empty() && scope == BreakScope::LocksOnly {
                let pids: Vec<String> = held.iter().map(|(pid, _)| pid.to_string()).collect();
                return Ok(Err(LockError::Unsupported(format!(
                    "PostgreSQL frees an advisory lock only when its holder unlocks it or its \
                     session ends: breaking it ends server process {} and frees every lock it \
                     holds (needs pg_signal_backend); ask for that with --force \
                     (BreakScope::Sessions)",
                    pids.join(", ")
                ))));
            }
            let floor: i64 = client
                .query_one(&format!("SELECT nextval('{}')", self.sequence), &[])
                .await?
                .get(0);
            let mut holders = Vec::with_capacity(held.len());
            for (pid, holder) in held {
                let ended = client
                    .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
                    .await?;
                if ended.get::<_, bool>(0) {
                    holders.push(holder);
                }
            }
            Ok(Ok(Broken {
                key,
                holders,
                floor: spaced(floor),
            }))
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

/// A sequence value as the floor of the tokens a grant draws with it.
fn spaced(value: i64) -> FencingToken {
    FencingToken::new(
        (value.max(0) as u64).saturating_mul(u64::from(PostgresBackend::TOKEN_SPACING)),
    )
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

    /// Deletes the row if it still has the owner read, after drawing the
    /// floor from the token sequence (a grant draws after writing its row,
    /// so every grant of the owner read drew before), and notifies its
    /// waiters as a release does; reads again if the owner changed.
    pub(super) async fn break_key(&self, key: LockKey) -> Result<Broken, LockError> {
        let conn = self.conn(key.as_str()).await?;
        let next = format!("SELECT nextval('{}')", self.sequence);
        let fail = |e| pg_error("breaking a lock", e);
        loop {
            let rows = conn
                .client
                .query_typed(&self.sql.inspect, &[(&key.as_str(), Type::TEXT)])
                .await
                .map_err(fail)?;
            // Unnamed, as every statement through a transaction pooler.
            let drawn = conn.client.query_typed(&next, &[]).await.map_err(fail)?;
            let Some(floor) = drawn.first().map(|row| row.get::<_, i64>(0)) else {
                return Err(LockError::backend(
                    "postgres",
                    "nextval answered no row",
                    None,
                ));
            };
            let Some((owner, holder)) = rows.first().map(table_holder) else {
                return Ok(Broken {
                    key,
                    holders: Vec::new(),
                    floor: spaced(floor),
                });
            };
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
                    floor: spaced(floor),
                });
            }
        }
    }
}
