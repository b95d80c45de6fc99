//! The `http` workload's floor on a remote backend (`rps_floor`): the same
//! route, each request locking its SKU with the fewest raw commands that
//! give the library's guarantee (one holder at a time, a fencing token that
//! rises with each grant, and a lease or session that frees the lock of a
//! holder that dies), through the driver the backend uses, with no library
//! logic: no waiting, no renewal, no lost signal, no cohort. A key found
//! taken answers 503 (the workload never contends). The release is sent
//! after the response, off its path, as `LockLayer` releases by default.
//!
//! What each sends, and why fewer would not do:
//!
//! | backend | acquire | release |
//! |---|---|---|
//! | Redis, Sentinel's master, Cluster | one script: `INCR` the key's counter (the token), `PEXPIRE` it, `SET key owner NX PX lease` | one script: `DEL` if the value is the owner's |
//! | Redlock | the same on every instance at once; a majority must grant | the same on every instance |
//! | ZooKeeper | `create` of an ephemeral node named by the key (its creation zxid is the token) | `delete` |
//! | PostgreSQL | `pg_try_advisory_lock` and `nextval` in one statement, on one shared session | `pg_advisory_unlock` |
//! | PostgreSQL lease table | one `INSERT … ON CONFLICT` of the row, its token from a sequence, taking an expired one | `DELETE` of the row if it still has the token |
//! | MariaDB | `GET_LOCK(key, 0)` and `NEXTVAL` in one statement, on a pooled connection | `RELEASE_LOCK` on that connection |
//! | etcd | one transaction: put the key under the client's session lease if it does not exist (the revision is the token) | one transaction: delete it if its create revision is the token |
//!
//! Every row is two round trips, one to take and one to give back: a lock
//! that a dead holder can free must be written by the grant (the key, node,
//! row or session lock), and one that lives on must be removed by the
//! release; the token is drawn in the grant's own round trip. The library
//! does more: it waits (a watch, a subscription, a queued node), renews,
//! tells a holder of a lost lock, and queues a process's own waiters; none
//! of it is needed for a key nobody else wants, which is what the workload
//! sends, so the floor shows what that costs.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tokio::task::JoinSet;

use tower_lock_bench::orders::order;

/// The lease the floor's locks carry (Redis, the lease table): a holder
/// that dies frees its key after it. etcd's session lease is longer and
/// kept alive.
const LEASE: Duration = Duration::from_secs(10);

/// How long a Redis fencing counter outlives its key's last grant (as the
/// library's does).
const FENCE_TTL_MS: u64 = 24 * 3600 * 1000;

const REDIS_ACQUIRE: &str = r"
local t = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if redis.call('SET', KEYS[1], ARGV[3], 'NX', 'PX', ARGV[1]) then return t end
return false";

const REDIS_RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

/// The lease table's connections, as many as the library's.
const TABLE_CONNECTIONS: usize = 4;

/// The token sequence the SQL floors draw from (named in the statements
/// below too).
const SEQUENCE: &str = "bench_floor_tokens";

const TABLE_ACQUIRE: &str = "INSERT INTO bench_floor_leases \
     VALUES ($1, nextval('bench_floor_tokens'), now() + $2::bigint * interval '1 millisecond') \
     ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, expires = EXCLUDED.expires \
     WHERE bench_floor_leases.expires < now() RETURNING token";

const TABLE_RELEASE: &str = "DELETE FROM bench_floor_leases WHERE key = $1 AND token = $2";

const MYSQL_ACQUIRE: &str = "SELECT GET_LOCK(?, 0), NEXTVAL(bench_floor_tokens)";
const MYSQL_RELEASE: &str = "SELECT RELEASE_LOCK(?)";

/// A connection, or connections, to the backend's servers, and how to
/// lock a key through them.
// One per run, made once and never moved: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum RawLock {
    Redis(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
    Redlock(Vec<redis::aio::ConnectionManager>),
    ZooKeeper(zookeeper_client::Client),
    Postgres {
        client: tokio_postgres::Client,
        lock: tokio_postgres::Statement,
        unlock: tokio_postgres::Statement,
    },
    PostgresTable {
        /// Each statement commits on its own; spread over several
        /// connections, commits share the server's WAL flushes.
        clients: Vec<TableClient>,
    },
    Mysql(MysqlPool),
    Etcd {
        client: etcd_client::Client,
        lease: i64,
        /// Keeps the session lease alive while the floor runs.
        _keeper: tokio::task::JoinHandle<()>,
    },
}

/// A lease-table connection and its two statements, prepared once as the
/// library's are; `None` behind a pooler, where the library sends unnamed
/// statements (`query_typed`: one round trip, no prepare) and so does this.
pub(super) struct TableClient {
    client: tokio_postgres::Client,
    prepared: Option<(tokio_postgres::Statement, tokio_postgres::Statement)>,
}

/// MariaDB connections, each used by one lock at a time and kept for the
/// next (the driver's own pool resets a connection given back: one round
/// trip more), each with the floor's two statements prepared on it (given
/// as text, the driver parses a statement again on every call).
pub(super) struct MysqlPool {
    opts: mysql_async::Opts,
    idle: std::sync::Mutex<Vec<MysqlConn>>,
}

/// A floor connection and its prepared statements.
pub(super) struct MysqlConn {
    conn: mysql_async::Conn,
    acquire: mysql_async::Statement,
    release: mysql_async::Statement,
}

impl MysqlPool {
    async fn get(&self) -> Result<MysqlConn, String> {
        let idle = self.idle.lock().unwrap().pop();
        match idle {
            Some(conn) => Ok(conn),
            None => MysqlConn::open(self.opts.clone()).await,
        }
    }
}

impl MysqlConn {
    async fn open(opts: mysql_async::Opts) -> Result<Self, String> {
        use mysql_async::prelude::Queryable;
        let mut conn = mysql_async::Conn::new(opts)
            .await
            .map_err(|e| err("mariadb")(&e))?;
        let acquire = conn
            .prep(MYSQL_ACQUIRE)
            .await
            .map_err(|e| err("mariadb")(&e))?;
        let release = conn
            .prep(MYSQL_RELEASE)
            .await
            .map_err(|e| err("mariadb")(&e))?;
        Ok(MysqlConn {
            conn,
            acquire,
            release,
        })
    }
}

/// A lock the floor holds.
pub(super) struct Held {
    key: String,
    token: u64,
    /// Redis: the value of the lock's key.
    owner: u64,
    /// MariaDB: the connection the lock lives on.
    conn: Option<MysqlConn>,
}

/// Where the ZooKeeper floor's nodes live (a persistent parent made once).
const ZK_PARENT: &str = "/bench-floor";

/// A SKU is a node name: the workload's SKUs hold no `/`.
fn zk_path(key: &str) -> String {
    format!("{ZK_PARENT}/{key}")
}

fn err(what: &str) -> impl Fn(&dyn std::fmt::Display) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// A PostgreSQL (or PgBouncer) error with the server's own message and
/// code, which the driver's `Display` ("db error") leaves out.
fn pg(e: tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("postgres: {} ({})", db.message(), db.code().code()),
        None => match std::error::Error::source(&e) {
            Some(cause) => format!("postgres: {e}: {cause}"),
            None => format!("postgres: {e}"),
        },
    }
}

impl RawLock {
    /// Connects to the servers `url` names (a backend URL as the library
    /// takes it); `None` for the memory backend.
    pub(super) async fn open(url: &str) -> Result<Option<RawLock>, String> {
        let (scheme, rest) = url.split_once("://").unwrap_or((url, ""));
        let hosts = rest.split(['/', '?']).next().unwrap_or(rest);
        let hosts = hosts.rsplit('@').next().unwrap_or(hosts);
        Ok(Some(match scheme {
            "memory" | "" => return Ok(None),
            "redis" | "redis+sentinel" => {
                let master = match scheme {
                    "redis" => format!("redis://{hosts}"),
                    _ => super::floors::redis_group_master(url).await?,
                };
                let client = redis::Client::open(master).map_err(|e| err("redis")(&e))?;
                let conn = redis::aio::ConnectionManager::new(client)
                    .await
                    .map_err(|e| err("redis")(&e))?;
                RawLock::Redis(conn)
            }
            "redis+cluster" => {
                let nodes: Vec<String> = hosts.split(',').map(|h| format!("redis://{h}")).collect();
                let conn = redis::cluster::ClusterClient::new(nodes)
                    .map_err(|e| err("redis cluster")(&e))?
                    .get_async_connection()
                    .await
                    .map_err(|e| err("redis cluster")(&e))?;
                RawLock::Cluster(conn)
            }
            "redlock" => {
                let mut conns = Vec::new();
                for host in hosts.split(',') {
                    let client = redis::Client::open(format!("redis://{host}"))
                        .map_err(|e| err("redis")(&e))?;
                    conns.push(
                        redis::aio::ConnectionManager::new(client)
                            .await
                            .map_err(|e| err("redis")(&e))?,
                    );
                }
                RawLock::Redlock(conns)
            }
            "zk" => {
                let zk = zookeeper_client::Client::connect(hosts)
                    .await
                    .map_err(|e| err("zookeeper")(&e))?;
                let persistent = zookeeper_client::CreateMode::Persistent
                    .with_acls(zookeeper_client::Acls::anyone_all());
                match zk.create(ZK_PARENT, &[], &persistent).await {
                    Ok(_) | Err(zookeeper_client::Error::NodeExists) => {}
                    Err(e) => return Err(err("zookeeper")(&e)),
                }
                RawLock::ZooKeeper(zk)
            }
            "postgres" | "postgresql" => {
                let plain = tower_lock::backend::postgres::driver_url(url);
                let (client, connection) = tokio_postgres::connect(&plain, tokio_postgres::NoTls)
                    .await
                    .map_err(pg)?;
                tokio::spawn(connection);
                client
                    .batch_execute(&format!("CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}"))
                    .await
                    .map_err(pg)?;
                if url.contains("lease_table") {
                    client
                        .batch_execute(
                            "CREATE TABLE IF NOT EXISTS bench_floor_leases \
                             (key text PRIMARY KEY, token bigint NOT NULL, expires timestamptz NOT NULL)",
                        )
                        .await
                        .map_err(pg)?;
                    let pooled = super::behind_pooler();
                    let mut clients = Vec::new();
                    let mut next = Some(client);
                    while clients.len() < TABLE_CONNECTIONS {
                        let client = match next.take() {
                            Some(client) => client,
                            None => {
                                let (client, connection) =
                                    tokio_postgres::connect(&plain, tokio_postgres::NoTls)
                                        .await
                                        .map_err(pg)?;
                                tokio::spawn(connection);
                                client
                            }
                        };
                        let prepared = match pooled {
                            true => None,
                            false => Some((
                                client.prepare(TABLE_ACQUIRE).await.map_err(pg)?,
                                client.prepare(TABLE_RELEASE).await.map_err(pg)?,
                            )),
                        };
                        clients.push(TableClient { client, prepared });
                    }
                    RawLock::PostgresTable { clients }
                } else {
                    let lock = client
                        .prepare(&format!(
                            "SELECT pg_try_advisory_lock(hashtextextended($1, 0)), nextval('{SEQUENCE}')"
                        ))
                        .await
                        .map_err(pg)?;
                    let unlock = client
                        .prepare("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
                        .await
                        .map_err(pg)?;
                    RawLock::Postgres {
                        client,
                        lock,
                        unlock,
                    }
                }
            }
            "mysql" => {
                use mysql_async::prelude::Queryable;
                let base = url.split('?').next().unwrap_or(url);
                let opts = mysql_async::Opts::from_url(base).map_err(|e| err("mariadb")(&e))?;
                let mut conn = mysql_async::Conn::new(opts.clone())
                    .await
                    .map_err(|e| err("mariadb")(&e))?;
                conn.query_drop(format!("CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}"))
                    .await
                    .map_err(|e| err("mariadb")(&e))?;
                conn.disconnect().await.map_err(|e| err("mariadb")(&e))?;
                let first = MysqlConn::open(opts.clone()).await?;
                let pool = MysqlPool {
                    opts,
                    idle: std::sync::Mutex::new(vec![first]),
                };
                RawLock::Mysql(pool)
            }
            "etcd" => {
                let endpoints: Vec<&str> = hosts.split(',').collect();
                let mut client = etcd_client::Client::connect(&endpoints, None)
                    .await
                    .map_err(|e| err("etcd")(&e))?;
                let lease = client
                    .lease_grant(30, None)
                    .await
                    .map_err(|e| err("etcd")(&e))?
                    .id();
                let (mut keeper, mut answers) = client
                    .lease_keep_alive(lease)
                    .await
                    .map_err(|e| err("etcd")(&e))?;
                let _keeper = tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        if keeper.keep_alive().await.is_err() || answers.message().await.is_err() {
                            return;
                        }
                    }
                });
                RawLock::Etcd {
                    client,
                    lease,
                    _keeper,
                }
            }
            other => return Err(format!("no raw floor for {other}:// backends")),
        }))
    }

    /// Locks `key` once, without waiting.
    pub(super) async fn acquire(&self, key: &str) -> Result<Held, String> {
        // The value a Redis lock holds: its holder's alone (Redlock's
        // instances each draw a token of their own).
        let owner = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
        let held = |token: u64| Held {
            key: key.to_owned(),
            token,
            owner,
            conn: None,
        };
        match self {
            RawLock::Redis(conn) => redis_acquire(conn.clone(), key, owner).await.map(held),
            RawLock::Cluster(conn) => redis_acquire(conn.clone(), key, owner).await.map(held),
            RawLock::Redlock(conns) => {
                let mut all = JoinSet::new();
                for conn in conns {
                    let (conn, key) = (conn.clone(), key.to_owned());
                    all.spawn(async move { redis_acquire(conn, &key, owner).await });
                }
                let (mut granted, mut token) = (0, 0);
                while let Some(answer) = all.join_next().await {
                    if let Ok(Ok(t)) = answer {
                        granted += 1;
                        token = token.max(t);
                    }
                }
                // Without a majority, what was granted expires with its
                // lease (the workload never gets there).
                match granted > conns.len() / 2 {
                    true => Ok(held(token)),
                    false => Err("no majority".into()),
                }
            }
            RawLock::ZooKeeper(zk) => {
                let ephemeral = zookeeper_client::CreateMode::Ephemeral
                    .with_acls(zookeeper_client::Acls::anyone_all());
                let (stat, _) = zk
                    .create(&zk_path(key), &[], &ephemeral)
                    .await
                    .map_err(|e| err("zookeeper")(&e))?;
                Ok(held(stat.czxid as u64))
            }
            RawLock::Postgres { client, lock, .. } => {
                let row = client.query_one(lock, &[&key]).await.map_err(pg)?;
                match row.get::<_, bool>(0) {
                    true => Ok(held(row.get::<_, i64>(1) as u64)),
                    false => Err("taken".into()),
                }
            }
            RawLock::PostgresTable { clients } => {
                let TableClient { client, prepared } = table_client(clients, key);
                let ms = LEASE.as_millis() as i64;
                let rows = match prepared {
                    Some((acquire, _)) => client.query(acquire, &[&key, &ms]).await,
                    None => {
                        use tokio_postgres::types::Type;
                        client
                            .query_typed(TABLE_ACQUIRE, &[(&key, Type::TEXT), (&ms, Type::INT8)])
                            .await
                    }
                }
                .map_err(pg)?;
                match rows.first() {
                    Some(row) => Ok(held(row.get::<_, i64>(0) as u64)),
                    None => Err("taken".into()),
                }
            }
            RawLock::Mysql(pool) => {
                use mysql_async::prelude::Queryable;
                let mut conn = pool.get().await?;
                let got: Option<(Option<i64>, i64)> = conn
                    .conn
                    .exec_first(&conn.acquire, (key,))
                    .await
                    .map_err(|e| err("mariadb")(&e))?;
                match got {
                    Some((Some(1), token)) => Ok(Held {
                        conn: Some(conn),
                        ..held(token as u64)
                    }),
                    _ => Err("taken".into()),
                }
            }
            RawLock::Etcd { client, lease, .. } => {
                use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
                let txn = Txn::new()
                    .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(
                        key,
                        "",
                        Some(PutOptions::new().with_lease(*lease)),
                    )]);
                let answer = client
                    .kv_client()
                    .txn(txn)
                    .await
                    .map_err(|e| err("etcd")(&e))?;
                let revision = answer.header().map_or(0, |h| h.revision());
                match answer.succeeded() {
                    true => Ok(held(revision as u64)),
                    false => Err("taken".into()),
                }
            }
        }
    }

    /// Unlocks what `acquire` locked, counted among the releases
    /// [`released`] waits for from now: for a task of its own.
    pub(super) fn released_later(self: Arc<Self>, held: Held) -> impl Future<Output = ()> {
        IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
        async move {
            self.release(held).await;
            IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Unlocks what `acquire` locked.
    pub(super) async fn release(&self, held: Held) {
        let Held {
            key,
            token,
            owner,
            conn,
        } = held;
        let done: Result<(), String> = match self {
            RawLock::Redis(conn) => redis_release(conn.clone(), &key, owner).await,
            RawLock::Cluster(conn) => redis_release(conn.clone(), &key, owner).await,
            RawLock::Redlock(conns) => {
                let mut all = JoinSet::new();
                for conn in conns {
                    let (conn, key) = (conn.clone(), key.clone());
                    all.spawn(async move { redis_release(conn, &key, owner).await });
                }
                all.join_all().await.into_iter().collect()
            }
            RawLock::ZooKeeper(zk) => zk
                .delete(&zk_path(&key), None)
                .await
                .map_err(|e| err("zookeeper")(&e)),
            RawLock::Postgres { client, unlock, .. } => client
                .query_one(unlock, &[&key])
                .await
                .map(drop)
                .map_err(pg),
            RawLock::PostgresTable { clients } => {
                let TableClient { client, prepared } = table_client(clients, &key);
                let token = token as i64;
                match prepared {
                    Some((_, release)) => client.execute(release, &[&key, &token]).await.map(drop),
                    None => {
                        use tokio_postgres::types::Type;
                        client
                            .query_typed(TABLE_RELEASE, &[(&key, Type::TEXT), (&token, Type::INT8)])
                            .await
                            .map(drop)
                    }
                }
                .map_err(pg)
            }
            RawLock::Mysql(pool) => {
                use mysql_async::prelude::Queryable;
                let mut conn = conn.expect("a MariaDB lock keeps its connection");
                let done = conn
                    .conn
                    .exec_drop(&conn.release, (key,))
                    .await
                    .map_err(|e| err("mariadb")(&e));
                if done.is_ok() {
                    pool.idle.lock().unwrap().push(conn);
                }
                done
            }
            RawLock::Etcd { client, .. } => {
                use etcd_client::{Compare, CompareOp, Txn, TxnOp};
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        key.as_str(),
                        CompareOp::Equal,
                        token as i64,
                    )])
                    .and_then([TxnOp::delete(key.as_str(), None)]);
                client
                    .kv_client()
                    .txn(txn)
                    .await
                    .map(drop)
                    .map_err(|e| err("etcd")(&e))
            }
        };
        if let Err(e) = done {
            eprintln!("bench: the floor's release failed: {e}");
        }
    }
}

/// The lease table's connection for `key`, as the library picks one (by
/// the key's hash).
fn table_client<'a>(clients: &'a [TableClient], key: &str) -> &'a TableClient {
    use std::hash::{BuildHasher, BuildHasherDefault};
    let hash =
        BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(key);
    &clients[hash as usize % clients.len()]
}

/// The next Redis lock value.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// Releases sent and not yet answered.
static IN_FLIGHT: AtomicU64 = AtomicU64::new(0);

/// Waits until every release the floor sent has been answered.
pub(super) async fn released() {
    while IN_FLIGHT.load(Ordering::Acquire) > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn redis_acquire(
    mut conn: impl redis::aio::ConnectionLike + Send,
    key: &str,
    owner: u64,
) -> Result<u64, String> {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    let token: Option<u64> = SCRIPT
        .get_or_init(|| redis::Script::new(REDIS_ACQUIRE))
        .key(format!("{{{key}}}"))
        .key(format!("{{{key}}}:fence"))
        .arg(LEASE.as_millis() as u64)
        .arg(FENCE_TTL_MS)
        .arg(owner)
        .invoke_async(&mut conn)
        .await
        .map_err(|e| err("redis")(&e))?;
    token.ok_or_else(|| "taken".into())
}

async fn redis_release(
    mut conn: impl redis::aio::ConnectionLike + Send,
    key: &str,
    owner: u64,
) -> Result<(), String> {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    let _: i64 = SCRIPT
        .get_or_init(|| redis::Script::new(REDIS_RELEASE))
        .key(format!("{{{key}}}"))
        .arg(owner)
        .invoke_async(&mut conn)
        .await
        .map_err(|e| err("redis")(&e))?;
    Ok(())
}

/// `POST /orders/{sku}` under the raw floor: the bare route's handler,
/// called while the SKU is locked; the release is sent once the response
/// is ready, without holding it back.
pub(super) async fn order_raw(
    State(raw): State<Arc<RawLock>>,
    Path(sku): Path<String>,
) -> Response {
    let held = match raw.acquire(&sku).await {
        Ok(held) => held,
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e).into_response(),
    };
    let body = order(Path(sku)).await;
    tokio::spawn(raw.released_later(held));
    body.into_response()
}
