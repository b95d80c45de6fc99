//! MariaDB connections: opening one with the settings a lock holder needs,
//! knowing it alive while it holds a lock, and the pool of them.
//!
//! A `GET_LOCK` lock lives as long as the connection that took it, so each
//! held lock has a connection of its own (a connection answers one query at
//! a time, and a wait blocks it); released, the connection goes back to the
//! pool.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, Statement};

use crate::backend::engine::holds::Holds;
use crate::backend::engine::InFlight;
use crate::backend::sql::{Alive, Connections, Slot};
use crate::error::LockError;
use crate::sync::lock;

/// How long a connection that holds nothing stays open unused: a burst of
/// requests opens connections that its end need not keep for ever.
const IDLE_CLOSE: Duration = Duration::from_secs(60);

/// The pool's idle connections, each with when it went back.
pub(super) type Idle = Mutex<Vec<(Instant, Arc<Session>)>>;

/// `GET_LOCK` on pooled connections: the store behind
/// [`MysqlBackend`](super::MysqlBackend). Its acquire path is in the
/// module; the engine ([`RemoteBackend`](crate::backend::RemoteBackend))
/// does the rest.
pub struct MysqlStore {
    pub(super) opts: Opts,
    /// `host:port/db`, for messages (never the password).
    pub(super) target: String,
    pub(super) lease: Duration,
    pub(super) connect_timeout: Duration,
    /// The token sequence, a plain (checked) identifier.
    pub(super) sequence: String,
    pub(super) sequence_ready: AtomicBool,
    pub(super) statements: super::Statements,
    /// Connections that hold nothing, and since when; each closes after
    /// [`IDLE_CLOSE`] unused.
    pub(super) idle: Arc<Idle>,
    pub(super) connections: Connections,
    pub(super) releases: Arc<InFlight>,
}

/// One connection, and the lock it holds, if any.
pub(super) struct Session {
    pub(super) conn: tokio::sync::Mutex<Conn>,
    /// The server's id of this connection, for `KILL QUERY`.
    pub(super) id: u32,
    /// How long the connection (and its lock) is known alive, and the
    /// server's uptime for the restart quarantine.
    pub(super) alive: Alive,
    pub(super) ended: AtomicBool,
    pub(super) hold: Holds<()>,
    /// The lock's two statements, prepared on this connection when it
    /// opened. Given as text, the driver would parse each again on every
    /// call, to look it up in its cache: that was a sixth of the client's
    /// work per lock.
    pub(super) prepared: Prepared,
    _slot: Slot,
}

/// The statements of [`Statements`](super::Statements), prepared on one
/// connection (a statement is valid on its own connection only).
pub(super) struct Prepared {
    pub(super) lock: Statement,
    pub(super) release: Statement,
}

pub(super) fn my_error(doing: &str, e: mysql_async::Error) -> LockError {
    LockError::backend("mysql", format!("{doing}: {e}"), Some(Box::new(e) as _))
}

impl Session {
    fn usable(&self) -> bool {
        !self.ended.load(Ordering::Acquire)
    }

    /// Ends the connection: its lock is told, and nothing more runs on it.
    pub(super) fn end(&self, reason: &str) {
        if self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.hold.end(reason) > 0 {
            tracing::warn!(reason, "mysql lock lost");
        }
    }
}

impl MysqlStore {
    /// A connection for one acquisition: an idle one, or a new one within
    /// `max_connections`. With every connection taken, it waits for one to
    /// close or go back idle, up to the connect timeout (as a pool does):
    /// a burst of requests a little over the limit waits a moment rather
    /// than failing. Without `wait` (a lock that fails fast), it fails at
    /// once.
    pub(super) async fn session(&self, wait: bool) -> Result<Arc<Session>, LockError> {
        let give_up = tokio::time::Instant::now() + self.connect_timeout;
        loop {
            let room = self.connections.room();
            tokio::pin!(room);
            // Before looking: a connection freed in between wakes it.
            room.as_mut().enable();
            while let Some((_, s)) = lock(&self.idle).pop() {
                if s.usable() {
                    return Ok(s);
                }
            }
            let full =
                match self
                    .connections
                    .take("mysql", "MysqlOptions::max_connections", &self.target)
                {
                    Ok(slot) => return self.open(slot).await,
                    Err(full) => full,
                };
            if !wait || tokio::time::timeout_at(give_up, room).await.is_err() {
                return Err(full);
            }
        }
    }

    /// Opens a connection in the place `slot` holds, within the connect
    /// timeout (its own: not what waiting for the place left of it).
    async fn open(&self, slot: Slot) -> Result<Arc<Session>, LockError> {
        match tokio::time::timeout(self.connect_timeout, self.connect(slot)).await {
            Ok(Ok(session)) => {
                let session = Arc::new(session);
                tokio::spawn(keep_alive(
                    Arc::downgrade(&session),
                    self.lease,
                    Arc::downgrade(&self.idle),
                ));
                Ok(session)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(LockError::backend(
                "mysql",
                format!(
                    "connecting to MariaDB at {} timed out after {} ms",
                    self.target,
                    self.connect_timeout.as_millis()
                ),
                None,
            )),
        }
    }

    /// Takes back a connection whose lock was released (or never granted):
    /// kept open for the next acquisition, up to `max_connections` in all.
    pub(super) fn give_back(&self, session: Arc<Session>) {
        if !session.usable() || !session.hold.is_empty() {
            return;
        }
        lock(&self.idle).push((Instant::now(), session));
        self.connections.freed();
    }

    async fn connect(&self, slot: Slot) -> Result<Session, LockError> {
        let doing = || format!("connecting to MariaDB at {}", self.target);
        let sent = Instant::now();
        let mut conn = Conn::new(self.opts.clone())
            .await
            .map_err(|e| my_error(&doing(), e))?;
        // The server drops a connection idle this long, freeing its lock:
        // never before a lease after it last heard from the holder, which
        // is asked every quarter lease.
        let wait_timeout = (self.lease * 2).as_secs().max(2);
        // UTC: the clock read below must not go back an hour with
        // daylight saving time.
        conn.query_drop(format!(
            "SET SESSION wait_timeout = {wait_timeout}, time_zone = '+00:00'"
        ))
        .await
        .map_err(|e| my_error("setting up the connection", e))?;
        let uptime: Option<(String, u64, u64)> = conn
            .query_first(
                "SELECT VERSION(), CAST((SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
                 WHERE VARIABLE_NAME = 'UPTIME') AS UNSIGNED), \
                 CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS UNSIGNED)",
            )
            .await
            .map_err(|e| my_error("setting up the connection", e))?;
        let learnt = Instant::now();
        let (version, uptime, now_us) = uptime.unwrap_or_default();
        if !version.contains("MariaDB") {
            return Err(LockError::Config(format!(
                "{} runs MySQL {version}: this backend needs MariaDB 10.3 or later \
                 (its fencing tokens come from a SEQUENCE, which MySQL lacks)",
                self.target
            )));
        }
        // Read before creating: `CREATE SEQUENCE IF NOT EXISTS` takes an
        // exclusive metadata lock even on a sequence that exists, and so
        // queues behind every `GET_LOCK` waiting in the server (its
        // statement draws from the sequence): a process starting while
        // another waits for a lock could not connect until that wait ended.
        if !self.sequence_ready.load(Ordering::Acquire) {
            if !check_sequence(&mut conn, &self.sequence).await? {
                conn.query_drop(format!("CREATE SEQUENCE IF NOT EXISTS {}", self.sequence))
                    .await
                    .map_err(|e| {
                        my_error(
                            &format!(
                                "creating the token sequence {0} (a user that may not create \
                                 it needs it made once: CREATE SEQUENCE {0})",
                                self.sequence
                            ),
                            e,
                        )
                    })?;
                if !check_sequence(&mut conn, &self.sequence).await? {
                    return Err(LockError::Config(format!(
                        "the token sequence {} cannot be read after CREATE SEQUENCE",
                        self.sequence
                    )));
                }
            }
            self.sequence_ready.store(true, Ordering::Release);
        }
        // A sequence's state survives a crash of the server only as far as
        // its engine wrote it (InnoDB's, killed, can restart below values
        // it handed out): every connection lifts it to the server's clock
        // in microseconds first, above anything drawn before a restart
        // (SETVAL never lowers a sequence).
        conn.query_drop(format!("SELECT SETVAL({}, {now_us})", self.sequence))
            .await
            .map_err(|e| my_error("lifting the token sequence to the server's clock", e))?;
        let preparing = |e| my_error("preparing the lock statements", e);
        let prepared = Prepared {
            lock: conn.prep(&self.statements.lock).await.map_err(preparing)?,
            release: conn
                .prep(&self.statements.release)
                .await
                .map_err(preparing)?,
        };
        let id = conn.id();
        Ok(Session {
            conn: tokio::sync::Mutex::new(conn),
            id,
            alive: Alive::new(sent, self.lease, Duration::from_secs(uptime), learnt),
            ended: AtomicBool::new(false),
            hold: Holds::new(),
            prepared,
            _slot: slot,
        })
    }

    /// Interrupts a wait in the server (`KILL QUERY`) from another
    /// connection: closing the waiting one alone would go unnoticed until
    /// the wait ends.
    pub(super) async fn kill_query(self: Arc<Self>, id: u32) {
        let kill = async {
            let mut conn = Conn::new(self.opts.clone()).await?;
            conn.query_drop(format!("KILL QUERY {id}")).await?;
            conn.disconnect().await
        };
        // Bounded: `flush` waits for this.
        let _ = tokio::time::timeout(self.connect_timeout * 2, kill).await;
    }
}

/// The smallest `MAXVALUE` a token sequence may have: the server's clock in
/// microseconds stays below it until 2112.
const MIN_SEQUENCE_MAX: i64 = 1 << 52;

/// Refuses a sequence (one a user made) that the clock floor cannot keep
/// rising: a step other than 1 could outrun the clock, `CYCLE` would wrap
/// below the tokens handed out, and a small `MAXVALUE` would run out once
/// lifted to the clock. `false` when there is no such sequence yet.
async fn check_sequence(conn: &mut Conn, sequence: &str) -> Result<bool, LockError> {
    /// MariaDB's `ER_NO_SUCH_TABLE`.
    const NO_SUCH_TABLE: u16 = 1146;
    let doing = || {
        format!(
            "reading the token sequence {sequence} (a user that may not create it needs it \
             made once, CREATE SEQUENCE {sequence}, and may read and update it)"
        )
    };
    let row: Option<(i64, i64, i64)> = match conn
        .query_first(format!(
            "SELECT increment, cycle_option, maximum_value FROM {sequence}"
        ))
        .await
    {
        Ok(row) => row,
        Err(mysql_async::Error::Server(e)) if e.code == NO_SUCH_TABLE => return Ok(false),
        Err(e) => return Err(my_error(&doing(), e)),
    };
    match row {
        Some((1, 0, max)) if max >= MIN_SEQUENCE_MAX => Ok(true),
        Some((increment, cycle, max)) => Err(LockError::Config(format!(
            "the token sequence {sequence} has INCREMENT {increment}, {}CYCLE and MAXVALUE              {max}: tokens need INCREMENT 1, NOCYCLE and MAXVALUE of at least {MIN_SEQUENCE_MAX}              (CREATE SEQUENCE {sequence} makes one)",
            if cycle == 0 { "NO" } else { "" }
        ))),
        None => Err(LockError::Config(format!("{}: no row", doing()))),
    }
}

/// Keeps a connection that holds a lock known alive (a ping every quarter
/// lease, counted from its send time), or ends it (the lock is told lost)
/// before its lease from the last answered request runs out. Pooled
/// connections are pinged too, so that the server's `wait_timeout` (two
/// leases) never closes them, until one has been unused for
/// [`IDLE_CLOSE`]: then it leaves the pool and closes.
pub(super) async fn keep_alive(session: Weak<Session>, lease: Duration, idle: Weak<Idle>) {
    let every = lease / 4;
    loop {
        tokio::time::sleep(every).await;
        let Some(s) = session.upgrade() else { return };
        if s.ended.load(Ordering::Acquire) {
            return;
        }
        // Taken out under the pool's lock, so never from an acquisition
        // that has just popped it.
        if let Some(idle) = idle.upgrade() {
            let mut idle = lock(&idle);
            let unused = idle
                .iter()
                .position(|(since, i)| Arc::ptr_eq(i, &s) && since.elapsed() >= IDLE_CLOSE);
            if let Some(at) = unused {
                idle.swap_remove(at);
                drop(idle);
                s.end("unused for a minute");
                return;
            }
        }
        let held = !s.hold.is_empty();
        let deadline = s.alive.until.get();
        let sent = Instant::now();
        let ping = async {
            let mut conn = if held {
                s.conn.lock().await
            } else {
                // Idle ones too, or the server's `wait_timeout` closes them
                // in the pool; but not one an acquisition is using.
                match s.conn.try_lock() {
                    Ok(conn) => conn,
                    // Skipped, so not answered: the acquisition's own
                    // answer counts instead.
                    Err(_) => return Ok(false),
                }
            };
            conn.ping().await.map(|()| true)
        };
        let deadline = if held { deadline } else { sent + lease };
        match tokio::time::timeout_at(deadline.into(), ping).await {
            Ok(Ok(true)) => s.alive.answered(sent),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                s.end(&format!("the connection to MariaDB failed: {e}"));
                return;
            }
            Err(_) => {
                s.end(&format!(
                    "no answer from MariaDB within the lease of {} ms",
                    lease.as_millis()
                ));
                return;
            }
        }
    }
}
