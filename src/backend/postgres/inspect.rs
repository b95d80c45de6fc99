//! Who holds a key, in each mode: `pg_locks` with `pg_stat_activity` for
//! advisory locks, the row for the lease table.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::session::{pg_error, Advisory};
use super::table::LeaseTable;
use crate::backend::{Holder, Inspection};
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
        let query = async {
            let client = &session.client;
            client
                .batch_execute("BEGIN; SET LOCAL statement_timeout = 10000")
                .await?;
            let rows = client.query(ADVISORY, &[&key.as_str()]).await;
            client.batch_execute("COMMIT").await?;
            rows
        };
        let rows = query.await;
        if rows.is_ok() {
            self.give_back(session);
        } else {
            session.end("inspecting a lock failed");
        }
        let rows = rows.map_err(|e| pg_error("inspecting a lock", e))?;
        let mut holders = Vec::new();
        let mut waiters = 0u32;
        for row in rows {
            if !row.get::<_, bool>(0) {
                waiters += 1;
                continue;
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
            holders.push(Holder::new(None).mode(mode).identity(who));
        }
        Ok(Inspection {
            key,
            holders,
            waiters: Some(waiters),
        })
    }
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
        let holders = rows
            .iter()
            .map(|row| {
                let owner: &str = row.get(0);
                let left = u64::try_from(row.get::<_, i64>(1)).unwrap_or(0);
                Holder::new(None)
                    .mode(LockMode::Exclusive)
                    .lease_left(Duration::from_millis(left))
                    .identity(format!("owner {owner}"))
            })
            .collect();
        Ok(Inspection {
            key,
            holders,
            waiters: None,
        })
    }
}
