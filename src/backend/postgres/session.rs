//! PostgreSQL sessions: opening one (with the settings a lock holder needs),
//! knowing it alive, and the pool of them a backend keeps.
//!
//! A session-level advisory lock lives exactly as long as the server
//! session that took it, so a session is to this backend what a ZooKeeper
//! session is to that one: it is known alive until the send time of the
//! last request it answered plus the lease, and every lock it holds is lost
//! with it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls, Statement};

use crate::backend::engine::holds::Holds;
use crate::backend::engine::owner::Tokens;
use crate::backend::engine::InFlight;
use crate::backend::sql::{Alive, Connections, Slot};
use crate::error::LockError;
use crate::sync::lock;

/// How many sessions that hold nothing are kept open for the next wait.
const MAX_IDLE: usize = 2;

pub(super) struct Advisory {
    pub(super) config: tokio_postgres::Config,
    /// `host:port/db`, for messages (never the password).
    pub(super) target: String,
    pub(super) lease: Duration,
    pub(super) connect_timeout: Duration,
    /// The token sequence, a plain (checked) identifier.
    pub(super) sequence: String,
    /// Set once the sequence is known to exist.
    pub(super) sequence_ready: AtomicBool,
    /// The session every lock that is free at once is taken on.
    pub(super) shared: Mutex<Option<Arc<Session>>>,
    /// One shared session opening at a time.
    pub(super) opening: tokio::sync::Mutex<()>,
    /// Sessions that hold nothing, for the next wait.
    pub(super) idle: Mutex<Vec<Arc<Session>>>,
    /// Sessions open, shared and idle ones included.
    pub(super) connections: Connections,
    /// Releases in flight, for `flush`.
    pub(super) releases: Arc<InFlight>,
    /// Each session's mark.
    pub(super) markers: Tokens,
}

/// One server session and the locks it holds.
pub(super) struct Session {
    pub(super) client: Client,
    pub(super) statements: Statements,
    /// Until when the server surely keeps the session (and so its locks),
    /// and the server's uptime for the restart quarantine.
    pub(super) alive: Alive,
    /// Set when the session ends or is given up: nothing new is taken on
    /// it, and every lock it holds is lost with it.
    pub(super) ended: AtomicBool,
    /// The locks held on this session, by id, told when it ends.
    pub(super) holds: Holds<usize>,
    /// The keys locked or being locked on this session: advisory locks are
    /// re-entrant per session, so a second lock on one of them would be
    /// granted at once, and is taken on another session instead.
    claims: Mutex<HashSet<String>>,
    connection: JoinHandle<()>,
    _slot: Slot,
}

/// Why advisory locks cannot work on a connection whose statements run on
/// another server session than the one it set up.
pub(super) const POOLED: &str = "this connection's statements run on a PostgreSQL session \
     other than its own (a pooler in transaction mode, such as PgBouncer?): advisory locks \
     live in one session; connect straight to the server or through session pooling, or use \
     PostgresOptions::lease_table";

/// The custom setting that marks a server session as one connection's.
pub(super) const MARK: &str = "tower_lock.session";

pub(super) fn pg_error(doing: &str, e: tokio_postgres::Error) -> LockError {
    // A statement prepared on one server session and run on another.
    let hint = if e.code() == Some(&SqlState::INVALID_SQL_STATEMENT_NAME) {
        format!(" ({POOLED})")
    } else {
        String::new()
    };
    LockError::backend(
        "postgres",
        format!("{doing}: {e}{hint}"),
        Some(Box::new(e) as _),
    )
}

/// The error for a statement that ran on a session not marked as its own.
pub(super) fn pooled() -> LockError {
    LockError::backend("postgres", POOLED, None)
}

impl Session {
    pub(super) fn usable(&self) -> bool {
        !self.ended.load(Ordering::Acquire) && !self.client.is_closed()
    }

    /// Claims `key` for one lock on this session; false if it is claimed.
    pub(super) fn claim(&self, key: &str) -> bool {
        lock(&self.claims).insert(key.to_owned())
    }

    /// Gives up a claim: the lock is released, or was never granted.
    pub(super) fn unclaim(&self, key: &str) {
        lock(&self.claims).remove(key);
    }

    pub(super) fn holds_nothing(&self) -> bool {
        self.holds.is_empty()
    }

    /// Asks the server once, so that the session is known alive from now.
    pub(super) async fn ping(&self) -> Result<(), LockError> {
        let sent = Instant::now();
        let own: Option<bool> = self
            .client
            .query_one(&self.statements.ping, &[])
            .await
            .map_err(|e| pg_error("checking the connection", e))?
            .get(0);
        if own != Some(true) {
            return Err(pooled());
        }
        self.alive.answered(sent);
        Ok(())
    }

    /// Ends the session: its locks are told, and the connection is closed,
    /// which makes the server free whatever it still holds.
    pub(super) fn end(&self, reason: &str) {
        if self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        let told = self.holds.end(reason);
        if told > 0 {
            tracing::warn!(reason, locks = told, "postgres locks lost");
        }
        self.connection.abort();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

impl Advisory {
    /// The session locks free at once are taken on, opened if there is none
    /// or it ended.
    pub(super) async fn shared(&self) -> Result<Arc<Session>, LockError> {
        if let Some(s) = lock(&self.shared).as_ref().filter(|s| s.usable()) {
            return Ok(s.clone());
        }
        let _opening = self.opening.lock().await;
        {
            let mut shared = lock(&self.shared);
            if let Some(s) = shared.as_ref().filter(|s| s.usable()) {
                return Ok(s.clone());
            }
            // An ended session leaves the slot (and, once its holders let
            // go, the count of open connections).
            *shared = None;
        }
        // Boxed (here and in `dedicated`): opening a session is rare, and its
        // future (some 8 KB) would be carried by every acquire's future,
        // and copied with it (a tenth of a lock's instructions).
        let session = Box::pin(self.open_session()).await?;
        *lock(&self.shared) = Some(session.clone());
        Ok(session)
    }

    /// A session of its own for one wait (and then the lock it gets): an
    /// idle one, or a new one within `max_connections`.
    pub(super) async fn dedicated(&self) -> Result<Arc<Session>, LockError> {
        loop {
            let Some(s) = lock(&self.idle).pop() else {
                break;
            };
            if s.usable() {
                return Ok(s);
            }
        }
        Box::pin(self.open_session()).await
    }

    pub(super) fn is_shared(&self, session: &Arc<Session>) -> bool {
        lock(&self.shared)
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(s, session))
    }

    /// Takes back a session whose lock was released: kept for the next
    /// wait, or closed.
    pub(super) fn give_back(&self, session: Arc<Session>) {
        if self.is_shared(&session) || !session.usable() || !session.holds_nothing() {
            return;
        }
        let mut idle = lock(&self.idle);
        if idle.len() < MAX_IDLE {
            idle.push(session);
        }
    }

    async fn open_session(&self) -> Result<Arc<Session>, LockError> {
        // At the limit, idle sessions make room for the new one.
        while self.connections.at_limit() {
            let Some(idle) = lock(&self.idle).pop() else {
                break;
            };
            idle.end("closed to make room for another connection");
        }
        let slot =
            self.connections
                .take("postgres", "PostgresOptions::max_connections", &self.target)?;
        let opened = tokio::time::timeout(self.connect_timeout, self.connect(slot)).await;
        match opened {
            Ok(result) => result,
            Err(_) => Err(LockError::backend(
                "postgres",
                format!(
                    "connecting to PostgreSQL at {} timed out after {} ms",
                    self.target,
                    self.connect_timeout.as_millis()
                ),
                None,
            )),
        }
    }

    async fn connect(&self, slot: Slot) -> Result<Arc<Session>, LockError> {
        let doing = || format!("connecting to PostgreSQL at {}", self.target);
        let (client, connection) = self
            .config
            .connect(NoTls)
            .await
            .map_err(|e| pg_error(&doing(), e))?;
        // The session, once made: told when the connection ends.
        let owner = Arc::new(std::sync::OnceLock::<Weak<Session>>::new());
        let told = owner.clone();
        let connection = tokio::spawn(async move {
            let reason = match connection.await {
                Ok(()) => "the connection to PostgreSQL closed".to_owned(),
                Err(e) => format!("the connection to PostgreSQL failed: {e}"),
            };
            if let Some(s) = told.get().and_then(Weak::upgrade) {
                s.end(&reason);
            }
        });
        // From here on the task is aborted on any error: the socket closes.
        let guard = AbortOnDrop(Some(connection));
        let sent = Instant::now();
        client
            .batch_execute(&self.settings())
            .await
            .map_err(|e| pg_error("setting up the session", e))?;
        // Marks the server session as this connection's, unless another
        // connection marked it or it holds advisory locks already: then
        // statements are being handed between clients (a pooler in
        // transaction mode). Every lock statement checks the mark, so none
        // runs on a session not its own.
        let marker = self.markers.next();
        let row = client
            .query_typed(
                &format!(
                    "SELECT extract(epoch FROM now() - pg_postmaster_start_time())::float8, \
                     CASE WHEN coalesce(current_setting('{MARK}', true), '') = '' \
                     AND NOT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                     AND pid = pg_backend_pid()) \
                     THEN set_config('{MARK}', $1, false) END"
                ),
                &[(&marker, tokio_postgres::types::Type::TEXT)],
            )
            .await
            .map_err(|e| pg_error("reading the server's uptime", e))?;
        let row = row
            .first()
            .ok_or_else(|| LockError::backend("postgres", "no answer to the uptime query", None))?;
        if row.get::<_, Option<String>>(1).is_none() {
            return Err(pooled());
        }
        let uptime: f64 = row.get(0);
        let learnt = Instant::now();
        if !self.sequence_ready.load(Ordering::Acquire) {
            self.create_sequence(&client).await?;
            self.sequence_ready.store(true, Ordering::Release);
        }
        let statements = Statements::prepare(&client, &self.sequence, &marker).await?;
        let connection = guard.disarm();
        let session = Arc::new(Session {
            client,
            statements,
            alive: Alive::new(
                sent,
                self.lease,
                Duration::from_secs_f64(uptime.max(0.0)),
                learnt,
            ),
            ended: AtomicBool::new(false),
            holds: Holds::new(),
            claims: Mutex::new(HashSet::new()),
            connection,
            _slot: slot,
        });
        let _ = owner.set(Arc::downgrade(&session));
        if session.client.is_closed() {
            session.end("the connection to PostgreSQL closed");
        }
        tokio::spawn(keep_alive(Arc::downgrade(&session), self.lease));
        Ok(session)
    }

    /// Creates the token sequence if it is missing, and checks one that
    /// was there.
    async fn create_sequence(&self, client: &Client) -> Result<(), LockError> {
        let sql = format!("CREATE SEQUENCE IF NOT EXISTS {}", self.sequence);
        create_missing(
            client,
            &sql,
            &format!("the token sequence {}", self.sequence),
        )
        .await?;
        check_sequence(client, &self.sequence).await
    }

    /// The session settings a lock holder needs, whatever the server's
    /// defaults: no statement or idle timeout cuts a wait or a hold short,
    /// and the server gives up a silent client no sooner than a lease
    /// after it last heard from it (TCP keepalive and user timeout), so a
    /// holder is told it lost the lock before the server frees it.
    fn settings(&self) -> String {
        let secs = self.lease.as_secs() + 1;
        let interval = (secs / 3).max(1);
        let user_timeout_ms = (secs + 3 * interval) * 1000;
        let settings = [
            ("statement_timeout", "0".to_owned()),
            ("lock_timeout", "0".to_owned()),
            ("idle_in_transaction_session_timeout", "0".to_owned()),
            ("idle_session_timeout", "0".to_owned()),
            ("tcp_keepalives_idle", secs.to_string()),
            ("tcp_keepalives_interval", interval.to_string()),
            ("tcp_keepalives_count", "3".to_owned()),
            ("tcp_user_timeout", user_timeout_ms.to_string()),
            // A waiting server process notices a closed client (PG 14+).
            ("client_connection_check_interval", "1000".to_owned()),
        ];
        let values: Vec<String> = settings
            .iter()
            .map(|(name, value)| format!("('{name}', '{value}')"))
            .collect();
        // Only the settings this server version has.
        format!(
            "SELECT set_config(v.name, v.value, false) FROM (VALUES {}) AS v(name, value) \
             WHERE EXISTS (SELECT 1 FROM pg_settings s WHERE s.name = v.name)",
            values.join(", ")
        )
    }
}

/// Runs `sql`, which creates `what` if it is missing; another process
/// creating it at the same moment is no error.
/// Refuses a token sequence (one a user made) whose values do not come out
/// in the order they are drawn across sessions: with `CACHE` above 1 each
/// session takes a block of values and hands them out on its own, so a
/// later grant on another session can get a lower token; `CYCLE` wraps
/// below the tokens handed out; a step below 1 does not rise.
pub(super) async fn check_sequence(client: &Client, sequence: &str) -> Result<(), LockError> {
    // Unnamed (`query_typed`), so that it also runs through a pooler in
    // transaction mode.
    let rows = client
        .query_typed(
            "SELECT seqincrement, seqcycle, seqcache FROM pg_catalog.pg_sequence \
             WHERE seqrelid = to_regclass($1)",
            &[(&sequence, tokio_postgres::types::Type::TEXT)],
        )
        .await
        .map_err(|e| pg_error(&format!("reading the token sequence {sequence}"), e))?;
    let Some(row) = rows.first() else {
        return Err(LockError::Config(format!(
            "the token sequence {sequence} is not a sequence this role can see"
        )));
    };
    let (increment, cycle, cache): (i64, bool, i64) = (row.get(0), row.get(1), row.get(2));
    if increment >= 1 && !cycle && cache == 1 {
        return Ok(());
    }
    Err(LockError::Config(format!(
        "the token sequence {sequence} has INCREMENT {increment}, CACHE {cache} and {}CYCLE: \
         fencing tokens need values in the order they are drawn (CACHE 1, NO CYCLE, a positive \
         INCREMENT); run ALTER SEQUENCE {sequence} INCREMENT 1 CACHE 1 NO CYCLE",
        if cycle { "" } else { "NO " }
    )))
}

pub(super) async fn create_missing(
    client: &Client,
    sql: &str,
    what: &str,
) -> Result<(), LockError> {
    create_racing(client, sql).await.map_err(|e| {
        pg_error(
            &format!(
                "creating {what} (a role that may not create it needs it made once: \
                 {sql})"
            ),
            e,
        )
    })
}

/// Runs `sql`, which creates what is missing, again (up to three times)
/// when another process creating the same at once made it collide: it
/// exists by then.
pub(super) async fn create_racing(client: &Client, sql: &str) -> Result<(), tokio_postgres::Error> {
    let raced = [
        SqlState::UNIQUE_VIOLATION,
        SqlState::DUPLICATE_TABLE,
        SqlState::DUPLICATE_FUNCTION,
    ];
    let mut tries = 0;
    loop {
        match client.batch_execute(sql).await {
            Err(e) if tries < 3 && e.code().is_some_and(|c| raced.contains(c)) => tries += 1,
            done => return done,
        }
    }
}

struct AbortOnDrop(Option<JoinHandle<()>>);

impl AbortOnDrop {
    fn disarm(mut self) -> JoinHandle<()> {
        self.0.take().expect("armed")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Keeps a session that holds locks known alive, or ends it (its locks are
/// told lost) before its lease from the last answered request runs out.
/// Only answers count, timed from their send time. A session that holds
/// nothing is not asked: it may be waiting for a lock, and the next grant
/// counts from its own send time.
async fn keep_alive(session: Weak<Session>, lease: Duration) {
    let every = lease / 4;
    loop {
        let Some(s) = session.upgrade() else { return };
        if s.ended.load(Ordering::Acquire) {
            return;
        }
        if s.client.is_closed() {
            s.end("the connection to PostgreSQL closed");
            return;
        }
        if s.holds_nothing() {
            drop(s);
            tokio::time::sleep(every).await;
            continue;
        }
        let deadline = s.alive.until.get();
        let sent = Instant::now();
        let answer = tokio::time::timeout_at(deadline.into(), s.ping()).await;
        match answer {
            Ok(Ok(())) => {
                drop(s);
                tokio::time::sleep_until((sent + every).into()).await;
            }
            Ok(Err(e)) => {
                s.end(&format!("the connection to PostgreSQL failed: {e}"));
                return;
            }
            Err(_) => {
                s.end(&format!(
                    "no answer from PostgreSQL within the lease of {} ms",
                    lease.as_millis()
                ));
                return;
            }
        }
    }
}

/// The statements a session prepares once, so that each lock operation is
/// one round trip. Index 0 is exclusive, 1 shared.
pub(super) struct Statements {
    pub(super) try_lock: [Statement; 2],
    pub(super) lock: [Statement; 2],
    pub(super) unlock: [Statement; 2],
    pub(super) ping: Statement,
}

/// The lock's 64-bit key: the server's own hash of the key text, so that
/// SQL can take the same lock (`pg_advisory_lock(hashtextextended('sku:A1',
/// 0))`).
const KEY: &str = "hashtextextended($1, 0)";

impl Statements {
    pub(super) async fn prepare(
        client: &Client,
        sequence: &str,
        marker: &str,
    ) -> Result<Self, LockError> {
        // Run on a session not marked as this connection's (a pooler in
        // transaction mode), a lock statement takes nothing and answers
        // -1, an unlock NULL, a ping false.
        let foreign = format!("current_setting('{MARK}', true) IS DISTINCT FROM '{marker}'");
        // The token is drawn after the grant, in the same statement (a
        // CASE evaluates in order): grants and tokens go up together.
        let try_sql = |f: &str| {
            format!(
                "SELECT CASE WHEN {foreign} THEN -1 WHEN {f}({KEY}) THEN nextval('{sequence}') END"
            )
        };
        let lock_sql = |f: &str| {
            format!(
                "SELECT CASE WHEN {foreign} THEN -1 \
                 WHEN {f}({KEY})::text = '' THEN nextval('{sequence}') END"
            )
        };
        let unlock_sql =
            |f: &str| format!("SELECT CASE WHEN {foreign} THEN NULL ELSE {f}({KEY}) END");
        let texts = [
            try_sql("pg_try_advisory_lock"),
            try_sql("pg_try_advisory_lock_shared"),
            lock_sql("pg_advisory_lock"),
            lock_sql("pg_advisory_lock_shared"),
            unlock_sql("pg_advisory_unlock"),
            unlock_sql("pg_advisory_unlock_shared"),
            format!("SELECT NOT {foreign}"),
        ];
        let p = |i: usize| client.prepare(&texts[i]);
        // Sent together: one round trip.
        let (t0, t1, l0, l1, u0, u1, ping) =
            tokio::try_join!(p(0), p(1), p(2), p(3), p(4), p(5), p(6))
                .map_err(|e| pg_error("preparing the lock statements", e))?;
        Ok(Statements {
            try_lock: [t0, t1],
            lock: [l0, l1],
            unlock: [u0, u1],
            ping,
        })
    }
}
