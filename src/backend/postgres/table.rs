//! The lease-table mode: a lock is a row with an expiry, for where a
//! session-level advisory lock cannot live (a pooler in transaction mode
//! hands each statement to another server session).
//!
//! Every statement stands alone (autocommit, one round trip), so a
//! transaction pooler may run each on any server session; statements are
//! unnamed until the server's sessions are known to last.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, Client, NoTls, Row, Statement};

use super::session::{check_sequence, create_missing, pg_error};
use super::table_sql::{Routine, Sql};
use super::PostgresBackend;
use crate::backend::engine::lease::{
    check_lease, known_until, release_in_background, Lease, Protocol, Released,
};
use crate::backend::engine::owner::Tokens;
use crate::backend::engine::renewal::Renewals;
use crate::backend::engine::InFlight;
use crate::backend::{Acquired, BackendFuture, LockRequest};
use crate::error::LockError;
use crate::lost::Deadline;
use crate::mode::{LockMode, Wait};
use crate::sync::lock;

mod hand_off;
mod listen;
mod routines;

use hand_off::Armed;
use listen::listen;

/// The longest a waiter sleeps without a notification before it looks
/// again: covers a notification lost while the listener reconnected.
const MAX_RECHECK: Duration = Duration::from_secs(1);
/// How often a waiter looks when notifications do not arrive (a pooler in
/// transaction mode between the listener and the server).
pub(super) const POLL_RECHECK: Duration = Duration::from_millis(50);
/// How often expired rows (of holders that died) are deleted.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Pause between tries of a statement whose connection broke.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// How many connections carry the statements (each statement is its own
/// transaction, whose commit waits for the server's WAL flush: keys spread
/// over several connections commit in parallel).
const STATEMENT_CONNECTIONS: usize = 4;

/// One statement connection.
#[derive(Default)]
struct Slot {
    conn: Mutex<Option<Arc<Conn>>>,
    opening: tokio::sync::Mutex<()>,
}

/// A statement connection, and the statements prepared on it once the
/// server's sessions are known to be kept.
pub(super) struct Conn {
    pub(super) client: Client,
    /// The statements of each lock ([`Stmt::Acquire`] to `Release`).
    prepared: [tokio::sync::OnceCell<Statement>; 5],
}

/// Which statement to run.
#[derive(Clone, Copy)]
enum Stmt {
    Acquire,
    /// A waiter's tries: [`Sql::join`], then [`Sql::acquire_waiting`].
    Join,
    AcquireWaiting,
    Renew,
    Release,
    /// Rare: never prepared.
    Sweep,
    Probe,
}

pub(super) struct LeaseTable {
    config: tokio_postgres::Config,
    /// Where the listener connects: the same server, or a direct address
    /// when statements go through a transaction pooler.
    listen_config: tokio_postgres::Config,
    pub(super) target: String,
    connect_timeout: Duration,
    /// The token sequence's name.
    pub(super) sequence: String,
    pub(super) sql: Sql,
    /// The statement connections, each opened again when it breaks. A key
    /// always uses the same one, so that a release sent lands before the
    /// next acquire of the key; different keys commit in parallel.
    clients: [Slot; STATEMENT_CONNECTIONS],
    /// Whether the listener hears notifications now.
    notified: AtomicBool,
    /// The statement URL's sessions are kept from one statement to the
    /// next (the listener, on that URL, heard a notification sent after
    /// its `LISTEN` by another connection: no pooler in transaction mode):
    /// statements may then be prepared once, not parsed each time.
    sessions_kept: AtomicBool,
    /// The listener connects to the statement URL.
    listens_there: bool,
    /// The table's name, as given.
    table: String,
    /// The statements' functions ([`Sql::routines`]), once made and
    /// trusted; unnamed statements call them while `routines_on`.
    routines: OnceLock<[Routine; 5]>,
    routines_on: AtomicBool,
    /// The local waiters of each key, woken by a release notification.
    waiters: Mutex<HashMap<String, Weak<Notify>>>,
    /// Woken by the listener's own test notification.
    probe: Notify,
    /// That notification's payload: [`PROBE`] and a nonce, new for each.
    probe_payload: Mutex<String>,
    /// Release notifications that woke a local waiter (or the wait of a
    /// hand-off, for this backend's own release).
    heard: AtomicU64,
    owners: Tokens,
    /// The listener and the sweep, stopped with the backend.
    tasks: Mutex<Vec<JoinHandle<()>>>,
    pub(super) releases: Arc<InFlight>,
    /// Leases whose first renewal is not due yet.
    pub(super) renewals: Arc<Renewals>,
}

/// What a release statement did.
#[derive(PartialEq, Eq)]
enum Deleted {
    /// The row was not this owner's (it expired and was taken or swept).
    NotHeld,
    Quietly,
    /// The row was marked wanted: waiters were notified.
    Notified,
}

/// What one acquire statement found.
enum Attempt {
    /// The sequence's value drawn for the grant.
    Granted(i64),
    /// Held by another: its time left in milliseconds, if it was seen.
    Busy(Option<i64>),
}

impl LeaseTable {
    /// The mode's state; connects nothing yet.
    pub(super) fn new(
        config: tokio_postgres::Config,
        listen_config: Option<tokio_postgres::Config>,
        target: String,
        connect_timeout: Duration,
        table: &str,
        sequence: &str,
    ) -> Arc<Self> {
        let listens_there = listen_config.is_none();
        let listen_config = listen_config.unwrap_or_else(|| config.clone());
        Arc::new(LeaseTable {
            config,
            listen_config,
            target,
            connect_timeout,
            sql: Sql::new(table, sequence, table),
            sequence: sequence.to_owned(),
            clients: std::array::from_fn(|_| Slot::default()),
            notified: AtomicBool::new(false),
            sessions_kept: AtomicBool::new(false),
            listens_there,
            table: table.to_owned(),
            routines: OnceLock::new(),
            routines_on: AtomicBool::new(false),
            waiters: Mutex::new(HashMap::new()),
            probe: Notify::new(),
            probe_payload: Mutex::new(String::new()),
            heard: AtomicU64::new(0),
            owners: Tokens::new(),
            tasks: Mutex::new(Vec::new()),
            releases: Arc::default(),
            renewals: Renewals::new(None),
        })
    }

    /// Connects, creates the table and sequence if missing, and starts the
    /// listener and the sweep.
    pub(super) async fn start(self: &Arc<Self>) -> Result<(), LockError> {
        let conn = self.conn("").await?;
        create_missing(&conn.client, &self.sql.create, "the lease table").await?;
        check_sequence(&conn.client, &self.sequence).await?;
        self.create_routines(&conn.client).await;
        let listener = tokio::spawn(listen(Arc::downgrade(self)));
        let sweeper = tokio::spawn(sweep(Arc::downgrade(self)));
        lock(&self.tasks).extend([listener, sweeper]);
        Ok(())
    }

    /// Whether waiters are woken by notifications (for tests).
    pub(super) fn notifications(&self) -> bool {
        self.notified.load(Ordering::Acquire)
    }

    /// How many release notifications woke a local waiter (or a
    /// hand-off's wait).
    pub(super) fn releases_heard(&self) -> u64 {
        self.heard.load(Ordering::Relaxed)
    }

    /// The statement connection for `key`, opened if there is none or it
    /// broke.
    pub(super) async fn conn(&self, key: &str) -> Result<Arc<Conn>, LockError> {
        use std::hash::BuildHasher;
        // A fixed hash: the same key, the same connection.
        let hash =
            std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
                .hash_one(key);
        let slot = &self.clients[(hash % STATEMENT_CONNECTIONS as u64) as usize];
        let open = |c: &&Arc<Conn>| !c.client.is_closed();
        if let Some(c) = lock(&slot.conn).as_ref().filter(open) {
            return Ok(c.clone());
        }
        let _opening = slot.opening.lock().await;
        if let Some(c) = lock(&slot.conn).as_ref().filter(open) {
            return Ok(c.clone());
        }
        let (client, _driver) =
            connect(&self.config, &self.target, self.connect_timeout, None).await?;
        let conn = Arc::new(Conn {
            client,
            prepared: Default::default(),
        });
        *lock(&slot.conn) = Some(conn.clone());
        Ok(conn)
    }

    /// Runs one statement on the statement connection of `key`: unnamed,
    /// parsed each time, unless the server's sessions are known to be kept
    /// (a named statement through a pooler in transaction mode could reach
    /// another client's session, where that name is another statement).
    async fn query(
        &self,
        key: &str,
        which: Stmt,
        params: &[(&(dyn ToSql + Sync), Type)],
        doing: &str,
    ) -> Result<Vec<Row>, LockError> {
        let conn = self.conn(key).await?;
        let sql = &self.sql;
        let (text, slot) = match which {
            Stmt::Acquire => (&sql.acquire, Some(0)),
            Stmt::Join => (&sql.join, Some(1)),
            Stmt::AcquireWaiting => (&sql.acquire_waiting, Some(2)),
            Stmt::Renew => (&sql.renew, Some(3)),
            Stmt::Release => (&sql.release, Some(4)),
            Stmt::Sweep => (&sql.sweep, None),
            Stmt::Probe => (&sql.probe, None),
        };
        let prepared = slot.filter(|_| self.sessions_kept.load(Ordering::Acquire));
        let Some(slot) = prepared else {
            if let Some(call) = slot.and_then(|i| self.routine(i)) {
                match conn.client.query_typed(call, params).await {
                    // Not run: the statement itself goes instead.
                    Err(e) if self.gives_up_routines(&e) => {}
                    answer => return answer.map_err(|e| pg_error(doing, e)),
                }
            }
            return conn
                .client
                .query_typed(text, params)
                .await
                .map_err(|e| pg_error(doing, e));
        };
        let client = &conn.client;
        let statement = conn.prepared[slot]
            .get_or_try_init(|| {
                let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
                async move { client.prepare_typed(text, &types).await }
            })
            .await
            .map_err(|e| pg_error(doing, e))?;
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
        conn.client
            .query(statement, &values)
            .await
            .map_err(|e| pg_error(doing, e))
    }

    /// Tries `which`, an acquire statement: [`Stmt::Join`] or one that
    /// answers a token or the holder's time left.
    async fn attempt(
        &self,
        which: Stmt,
        key: &str,
        owner: &str,
        lease_ms: i64,
    ) -> Result<Attempt, LockError> {
        let rows = self
            .query(
                key,
                which,
                &[
                    (&key, Type::TEXT),
                    (&owner, Type::TEXT),
                    (&lease_ms, Type::INT8),
                ],
                "taking a lease row",
            )
            .await?;
        let Some(row) = rows.first() else {
            if let Stmt::Join = which {
                return Ok(Attempt::Busy(None));
            }
            return Err(LockError::backend(
                "postgres",
                "the acquire statement returned no row",
                None,
            ));
        };
        Ok(match row.get::<_, Option<i64>>(0) {
            Some(n) => Attempt::Granted(n),
            None => Attempt::Busy(row.get(1)),
        })
    }

    /// Deletes the row if `owner` holds it: whether it did and its
    /// release notified waiters (it was marked wanted).
    async fn delete(&self, key: &str, owner: &str) -> Result<Deleted, LockError> {
        let rows = self
            .query(
                key,
                Stmt::Release,
                &[(&key, Type::TEXT), (&owner, Type::TEXT)],
                "deleting a lease row",
            )
            .await?;
        // The statement answers whether it did not notify.
        Ok(match rows.first() {
            None => Deleted::NotHeld,
            Some(row) if row.get::<_, bool>(0) => Deleted::Quietly,
            Some(_) => Deleted::Notified,
        })
    }

    /// Deletes the row, again after failures, until done or `deadline`
    /// (when it expires anyway).
    async fn delete_until(
        &self,
        key: &str,
        owner: &str,
        deadline: Instant,
    ) -> Result<(), LockError> {
        loop {
            match self.delete(key, owner).await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() + RETRY_PAUSE >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
            }
        }
    }

    pub(super) async fn acquire(
        self: Arc<Self>,
        request: LockRequest,
    ) -> Result<Acquired, LockError> {
        check_lease(request.lease, "PostgreSQL")?;
        if !matches!(request.mode, LockMode::Exclusive | LockMode::Write) {
            return Err(LockError::InvalidMode(format!(
                "the PostgreSQL lease table has exclusive locks only, not {:?}",
                request.mode
            )));
        }
        let key = request.key.as_str().to_owned();
        let owner = self.owners.next();
        let lease_ms = i64::try_from(request.lease.as_millis()).unwrap_or(i64::MAX);
        let mut undo = Undo {
            table: &self,
            key: &key,
            owner: &owner,
            armed: true,
        };
        let mut sent = Instant::now();
        let mut attempt = self.attempt(Stmt::Acquire, &key, &owner, lease_ms).await?;
        if let (Attempt::Busy(_), Wait::FailFast) = (&attempt, request.wait) {
            undo.armed = false;
            return Err(LockError::Busy);
        }
        let waited = matches!(attempt, Attempt::Busy(_));
        let contended = waited || request.contended;
        if waited {
            let watch = self.watch(&key);
            loop {
                // Armed before the attempt, so a release notified between
                // the attempt and the wait is not missed.
                let released = watch.notify.notified();
                tokio::pin!(released);
                released.as_mut().enable();
                // Inserting the row, or else only reading it when it is
                // marked: the waiters a release wakes write nothing but the
                // winner's row.
                sent = Instant::now();
                attempt = self.attempt(Stmt::Join, &key, &owner, lease_ms).await?;
                if let Attempt::Busy(_) = attempt {
                    sent = Instant::now();
                    attempt = self
                        .attempt(Stmt::AcquireWaiting, &key, &owner, lease_ms)
                        .await?;
                }
                let Attempt::Busy(left) = attempt else {
                    break;
                };
                let most = if self.notifications() {
                    MAX_RECHECK
                } else {
                    POLL_RECHECK
                };
                // The holder's row was not yet visible: look again soon.
                let recheck = left
                    .map(|ms| Duration::from_millis(ms.max(0) as u64 + 1))
                    .unwrap_or(Duration::from_millis(5))
                    .min(most);
                tokio::select! {
                    _ = released => {}
                    _ = tokio::time::sleep(recheck) => {}
                }
            }
        }
        let Attempt::Granted(n) = attempt else {
            unreachable!("the loop ends on a grant");
        };
        undo.armed = false;
        drop(undo);
        let token = super::token_of(n);
        let valid = Arc::new(Deadline::new(known_until(sent, request.lease)));
        let releases = self.releases.clone();
        let renewals = self.renewals.clone();
        let lease = Lease::new(
            TableLock {
                table: self,
                key,
                owner,
                lease_ms,
                contended,
                arm: AtomicBool::new(false),
                hand_off: Mutex::new(None),
            },
            request.lease,
            valid,
            releases,
        );
        lease.keep_renewed(&renewals);
        Ok(lease.acquired(
            token,
            request.tokens.clamp(1, PostgresBackend::TOKEN_SPACING),
        ))
    }
}

impl Drop for LeaseTable {
    fn drop(&mut self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

/// Opens a connection and drives it in a task; notifications go to `heard`.
async fn connect(
    config: &tokio_postgres::Config,
    target: &str,
    timeout: Duration,
    heard: Option<Weak<LeaseTable>>,
) -> Result<(Client, JoinHandle<()>), LockError> {
    let doing = || format!("connecting to PostgreSQL at {target}");
    // A connection cut without a reset (a partition) fails within seconds
    // rather than TCP's minutes: its statements then fail and are retried
    // on a new one.
    let mut config = config.clone();
    config
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(2))
        .keepalives_interval(Duration::from_secs(1))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(5));
    let (client, mut connection) = tokio::time::timeout(timeout, config.connect(NoTls))
        .await
        .map_err(|_| {
            LockError::backend(
                "postgres",
                format!("{} timed out after {} ms", doing(), timeout.as_millis()),
                None,
            )
        })?
        .map_err(|e| pg_error(&doing(), e))?;
    // Ends when the connection does (the client dropped, or a failure).
    let driver = tokio::spawn(async move {
        loop {
            let message = std::future::poll_fn(|cx| connection.poll_message(cx)).await;
            match message {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    if let Some(table) = heard.as_ref().and_then(Weak::upgrade) {
                        table.heard(n.payload());
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return,
            }
        }
    });
    Ok((client, driver))
}

/// Deletes expired rows, left by holders that died, every [`SWEEP_EVERY`].
async fn sweep(table: Weak<LeaseTable>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(t) = table.upgrade() else { return };
        if let Err(e) = t
            .query("", Stmt::Sweep, &[], "deleting expired lease rows")
            .await
        {
            tracing::debug!(error = %e, "sweeping expired PostgreSQL lease rows failed");
        }
    }
}

/// An acquire statement sent whose grant nobody will hold (the caller gave
/// up, or the connection failed before the answer): its row is deleted in
/// the background.
struct Undo<'a> {
    table: &'a Arc<LeaseTable>,
    key: &'a str,
    owner: &'a str,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (table, key, owner) = (
            self.table.clone(),
            self.key.to_owned(),
            self.owner.to_owned(),
        );
        let deadline = Instant::now() + MAX_RECHECK * 10;
        release_in_background(
            async move { table.delete_until(&key, &owner, deadline).await },
            &self.table.releases,
            "postgres",
        );
    }
}

/// A held lease row.
struct TableLock {
    table: Arc<LeaseTable>,
    key: String,
    owner: String,
    lease_ms: i64,
    /// Set by a release that notified waiters: what the hand-off waits on.
    /// Left there (the release's future dropped before its answer, so the
    /// cohort never asks), it goes with the lock's last handle.
    hand_off: Mutex<Option<Armed>>,
    /// Its acquisition found the row held, or the key held or waited for
    /// in this process ([`LockRequest::contended`]): others want it too.
    contended: bool,
    /// Set by `may_hand_off`: the release arms the hand-off's wait.
    arm: AtomicBool,
}

impl Protocol for TableLock {
    const BACKEND: &'static str = "postgres";
    const EXPIRED: &'static str =
        "the PostgreSQL lease row is no longer known held (no renewal answered within the lease)";

    fn describe(&self) -> &str {
        &self.key
    }

    /// Extends the row's expiry if this owner still holds it, unexpired;
    /// tries again (within the renewal's time) when the connection broke.
    async fn renew(&self, lease: Duration) -> Result<(), String> {
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(self.lease_ms);
        let params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&self.key, Type::TEXT),
            (&self.owner, Type::TEXT),
            (&lease_ms, Type::INT8),
        ];
        loop {
            match self
                .table
                .query(&self.key, Stmt::Renew, &params, "renewing a lease row")
                .await
            {
                Ok(rows) if rows.is_empty() => {
                    return Err("the lease row expired or was taken over".to_owned())
                }
                Ok(_) => return Ok(()),
                Err(e) => {
                    tracing::debug!(error = %e, key = self.key, "renewing a lease row failed");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    async fn release(&self) -> Released {
        // Before the statement: this process's listener may hear the
        // notification before the answer comes.
        let armed = if self.arm.load(Ordering::Relaxed) {
            self.table.arm_hand_off(&self.key)
        } else {
            None
        };
        match self.table.delete(&self.key, &self.owner).await {
            Ok(deleted) => {
                if deleted == Deleted::Notified {
                    *lock(&self.hand_off) = armed;
                }
                Released {
                    result: Ok(()),
                    again: false,
                }
            }
            Err(e) => Released {
                result: Err(e),
                again: true,
            },
        }
    }

    /// Waiters elsewhere heard the release of a lone holder (armed by
    /// `may_hand_off`): they get a turn first.
    fn hand_off(&self) -> Option<BackendFuture<()>> {
        let armed = lock(&self.hand_off).take()?;
        Some(BackendFuture::new(armed.wait()))
    }

    /// The release of a contended lock (its acquisition had to wait, or
    /// came after a hand-off here) is likely heard elsewhere (the answer
    /// says), so a lone holder's is armed to
    /// time a hand-off, where the listener hears releases. Not the release
    /// of a lock taken at once: most keys are nobody else's, and waiting
    /// for that answer before this process's next acquire of the key
    /// (rather than sending it right behind the release) made a loop of
    /// one worker a quarter slower (p50 477-580 to 655-741 us, three
    /// interleaved rounds). Not asked, so not armed, where a waiter
    /// here was queued already: this process had its turn, bounded by the
    /// cohort, and its next waiter asks as the answer comes, about when
    /// the others hear of the release. That race is even enough (two
    /// processes of four workers: fewest ÷ most 0.93 to 1.00), and a wait
    /// there cost 20 to 30 % of their rate in the bench (every switch of
    /// process paid the grace).
    fn may_hand_off(&self) -> bool {
        let on = self.contended && self.table.notifications();
        self.arm.store(on, Ordering::Relaxed);
        on
    }

    async fn release_until(&self, deadline: Instant) -> Result<(), LockError> {
        self.table
            .delete_until(&self.key, &self.owner, deadline)
            .await
    }
}
