//! Who holds a key (`IS_USED_LOCK` and the process list) and which keys
//! are held (the `metadata_lock_info` plugin), for
//! [`Backend::inspect`](crate::Backend::inspect) and
//! [`Backend::list`](crate::Backend::list).

use std::sync::Arc;

use mysql_async::prelude::Queryable;

use super::session::{my_error, MysqlStore};
use super::{lock_name, token_of};
use crate::backend::{BreakScope, Broken, Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;

/// A holding connection's id, and its user and host if the caller sees
/// them.
type HolderRow = (u64, Option<String>, Option<String>);

/// The connection holding a lock (argument: its [`lock_name`]), and its
/// user and host where the process list shows them.
const HOLDER_QUERY: &str = "SELECT l.id, p.USER, p.HOST FROM (SELECT IS_USED_LOCK(?) id) l \
     LEFT JOIN information_schema.PROCESSLIST p ON p.ID = l.id WHERE l.id IS NOT NULL";

fn holder_of((id, user, host): HolderRow) -> Holder {
    let who = match (user, host) {
        (Some(user), Some(host)) => format!("connection {id} of {user}@{host}"),
        // Another user's, without the PROCESS privilege.
        _ => format!("connection {id}"),
    };
    Holder::new(None).mode(LockMode::Exclusive).identity(who)
}

/// ER_NO_SUCH_THREAD: `KILL` of a connection that has ended.
const UNKNOWN_THREAD: u16 = 1094;

/// ER_UNKNOWN_TABLE: the plugin's table is not there.
const UNKNOWN_TABLE: u16 = 1109;

impl MysqlStore {
    /// The connection holding the key (`IS_USED_LOCK`) and, where the
    /// caller may see it in the process list, its user and host; no token
    /// (the server keeps none per lock) and no count of waiters (the
    /// process list shows connections waiting on a user lock, not for
    /// which).
    pub(super) async fn inspect_key(
        self: Arc<Self>,
        key: LockKey,
    ) -> Result<Inspection, LockError> {
        let session = self.session(true).await?;
        let holder: Result<Option<HolderRow>, _> = {
            let mut conn = session.conn.lock().await;
            conn.exec_first(HOLDER_QUERY, (&*lock_name(key.as_str()),))
                .await
        };
        let holder = self.after(session, holder, "inspecting a lock")?;
        let holders = holder.map(holder_of).into_iter().collect();
        Ok(Inspection {
            key,
            holders,
            waiters: None,
        })
    }

    /// Ends the holder's connection (`KILL CONNECTION`, in the statement
    /// that checks it still holds the key: a connection that let go may
    /// hold other locks); only with [`BreakScope::Sessions`], as the server
    /// frees a user lock only for its connection. The floor is drawn from
    /// the token sequence before the read for a key found free, after it
    /// for a holder (whose token its `GET_LOCK` statement drew), and the
    /// read is done again if the holder let go meanwhile. A `GET_LOCK`
    /// statement that had the lock but had not yet drawn its token when
    /// the floor was drawn (microseconds apart) may get one above it; its
    /// connection is ended all the same.
    pub(super) async fn break_key(
        self: Arc<Self>,
        key: LockKey,
        scope: BreakScope,
    ) -> Result<Broken, LockError> {
        let session = self.session(true).await?;
        let outcome: Result<Result<Broken, LockError>, mysql_async::Error> = async {
            let mut conn = session.conn.lock().await;
            let name = lock_name(key.as_str());
            let next = format!("SELECT NEXTVAL({})", self.sequence);
            let spaced = |n: Option<i64>| token_of(n.unwrap_or(0));
            // The lock name, for the statement that checks its holder and
            // kills.
            conn.exec_drop("SET @tower_lock_break = ?", (&*name,))
                .await?;
            let check_and_kill = |id: u64| {
                format!(
                    "BEGIN NOT ATOMIC IF IS_USED_LOCK(@tower_lock_break) = {id} THEN \
                     KILL CONNECTION {id}; SELECT 1; ELSE SELECT 0; END IF; END"
                )
            };
            loop {
                // Drawn before the read: a lock taken after it draws later.
                let before = spaced(conn.query_first(&next).await?);
                let held: Option<HolderRow> = conn.exec_first(HOLDER_QUERY, (&*name,)).await?;
                let Some(row) = held else {
                    return Ok(Ok(Broken {
                        key,
                        holders: Vec::new(),
                        floor: before,
                    }));
                };
                if scope == BreakScope::LocksOnly {
                    return Ok(Err(LockError::Unsupported(format!(
                        "MariaDB frees a lock only when its holder releases it or its \
                         connection ends: breaking it ends connection {} and frees every lock \
                         it holds (needs CONNECTION ADMIN or SUPER for another user's); ask \
                         for that with --force (BreakScope::Sessions)",
                        row.0
                    ))));
                }
                // Drawn after: above the token its GET_LOCK statement drew.
                let floor = spaced(conn.query_first(&next).await?);
                let killed: Option<i64> = match conn.query_first(check_and_kill(row.0)).await {
                    Ok(killed) => killed,
                    // Ended since it was read.
                    Err(mysql_async::Error::Server(e)) if e.code == UNKNOWN_THREAD => None,
                    Err(e) => return Err(e),
                };
                if killed == Some(1) {
                    return Ok(Ok(Broken {
                        key,
                        holders: vec![holder_of(row)],
                        floor,
                    }));
                }
                // It let go between the read and the kill: look again.
            }
        }
        .await;
        self.after(session, outcome, "breaking a lock")?
    }

    /// The user locks the `metadata_lock_info` plugin lists (a user lock's
    /// name is its `TABLE_SCHEMA`); a key longer than 64 characters is held
    /// under a hash, and not listed.
    pub(super) async fn list_keys(
        self: Arc<Self>,
        prefix: String,
    ) -> Result<Vec<LockKey>, LockError> {
        let session = self.session(true).await?;
        let names: Result<Vec<Option<Vec<u8>>>, _> = {
            let mut conn = session.conn.lock().await;
            conn.query(
                "SELECT DISTINCT TABLE_SCHEMA FROM information_schema.METADATA_LOCK_INFO \
                 WHERE LOCK_TYPE = 'User lock'",
            )
            .await
        };
        let names = match names {
            Err(mysql_async::Error::Server(e)) if e.code == UNKNOWN_TABLE => {
                self.give_back(session);
                return Err(LockError::Unsupported(
                    "listing MariaDB's locks needs the metadata_lock_info plugin \
                     (INSTALL SONAME 'metadata_lock_info')"
                        .into(),
                ));
            }
            other => self.after(session, other, "listing locks")?,
        };
        let mut keys: Vec<LockKey> = names
            .into_iter()
            .flatten()
            .filter_map(|name| String::from_utf8(name).ok())
            .filter(|name| name.starts_with(prefix.as_str()))
            .filter_map(|name| LockKey::new(&name).ok())
            .collect();
        keys.sort_unstable();
        Ok(keys)
    }

    /// Gives a connection back after a query, or ends it if the query
    /// failed (it may be broken).
    fn after<T>(
        &self,
        session: Arc<super::session::Session>,
        result: Result<T, mysql_async::Error>,
        doing: &str,
    ) -> Result<T, LockError> {
        match result {
            Ok(t) => {
                self.give_back(session);
                Ok(t)
            }
            Err(e) => {
                session.end(doing);
                Err(my_error(doing, e))
            }
        }
    }
}
