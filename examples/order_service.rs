//! The order-code generator from the seed articles, as an axum service.
//!
//! `POST /orders/{sku}` reads the SKU's last order number, waits a moment (a
//! database round trip, say), and writes number + 1: a read-modify-write that
//! hands out duplicate codes when two requests for one SKU overlap. The
//! `LockLayer` serialises them.
//!
//! ```text
//! cargo run --example order_service                 # ten concurrent requests, locked
//! cargo run --example order_service -- --no-lock    # the same without the lock: duplicates
//! cargo run --example order_service -- --serve      # then keep serving: curl -X POST http://ADDR/orders/sku-1
//! cargo run --example order_service --features redis -- --backend redis://127.0.0.1:6379 --instances 2
//! cargo run --example order_service --features zookeeper -- --backend zk://127.0.0.1:2181 --instances 2
//! cargo run --example order_service --features postgres -- --backend postgres://postgres@127.0.0.1:5432/test --instances 2
//! cargo run --example order_service --features postgres -- --backend "postgres://postgres@127.0.0.1:6432/test?lease_table" --instances 2
//! cargo run --example order_service --features mysql -- --backend mysql://root@127.0.0.1:3306/test --instances 2
//! cargo run --example order_service --features etcd -- --backend etcd://127.0.0.1:2379 --instances 2
//! ```
//!
//! The memory backend needs nothing but a Rust toolchain. A remote backend
//! takes its feature (`redis`, `zookeeper`, `postgres`, `mysql`, `etcd`;
//! etcd's client needs `protoc` to build); without it the example says which.
//!
//! Flags: `--backend <url>` (`memory`, `redis://host:port`, `redlock://h1:p1,h2:p2,h3:p3`,
//! `zk://host:port`, `postgres://user@host:port/db`, `mysql://user@host:port/db`; see
//! `tower_lock::backend::connect`), `--instances N` (servers in N separate
//! processes sharing the backend, the requests split between them; needs a
//! shared backend), `--requests N` (default 10), `--sku S`, `--no-lock`,
//! `--serve`.
//!
//! With a Redis backend the order numbers live in Redis too (with Redlock, in
//! the first server), with ZooKeeper in a node `/order_service/last/<sku>`,
//! with PostgreSQL or MariaDB in a table `order_service_last`, so that every instance
//! reads and writes the same counter.

use tower_lock_example_support as common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::routing::post;
use axum::Router;
#[cfg(feature = "postgres")]
use tokio_postgres::types::Type;
use tower_lock::{Backend, HeldLock, LockLayer, Locker, PathParam};

/// Where the last order number of each SKU is kept: deliberately read and
/// written in two steps.
enum Numbers {
    Local(Mutex<HashMap<String, u64>>),
    #[cfg(feature = "redis")]
    Redis(redis::aio::MultiplexedConnection),
    #[cfg(feature = "zookeeper")]
    ZooKeeper(zookeeper_client::Client),
    /// A table `order_service_last (sku text primary key, n bigint)`.
    #[cfg(feature = "postgres")]
    Postgres(tokio_postgres::Client),
    /// The same table in MariaDB.
    #[cfg(feature = "mysql")]
    Mysql(tokio::sync::Mutex<mysql_async::Conn>),
    /// A key per SKU, `/order_service/last/<sku>`, as decimal text (the
    /// same path as ZooKeeper's node).
    #[cfg(feature = "etcd")]
    Etcd(etcd_client::KvClient),
}

#[cfg(any(feature = "zookeeper", feature = "etcd"))]
/// The ZooKeeper node holding a SKU's last order number, as decimal text.
fn zk_node(sku: &str) -> String {
    format!("/order_service/last/{sku}")
}

impl Numbers {
    #[cfg(feature = "redis")]
    fn redis_key(sku: &str) -> String {
        format!("order_service:last:{sku}")
    }

    async fn read(&self, sku: &str) -> u64 {
        match self {
            Numbers::Local(m) => m.lock().unwrap().get(sku).copied().unwrap_or(0),
            #[cfg(feature = "redis")]
            Numbers::Redis(c) => {
                let v: Option<u64> = redis::cmd("GET")
                    .arg(Self::redis_key(sku))
                    .query_async(&mut c.clone())
                    .await
                    .expect("read the order number");
                v.unwrap_or(0)
            }
            #[cfg(feature = "zookeeper")]
            Numbers::ZooKeeper(zk) => match zk.get_data(&zk_node(sku)).await {
                Ok((data, _)) => String::from_utf8_lossy(&data).parse().unwrap_or(0),
                Err(zookeeper_client::Error::NoNode) => 0,
                Err(e) => panic!("read the order number: {e}"),
            },
            #[cfg(feature = "postgres")]
            Numbers::Postgres(pg) => pg
                .query_typed(
                    "SELECT n FROM order_service_last WHERE sku = $1",
                    &[(&sku, Type::TEXT)],
                )
                .await
                .expect("read the order number")
                .first()
                .map_or(0, |row| row.get::<_, i64>(0) as u64),
            #[cfg(feature = "mysql")]
            Numbers::Mysql(conn) => {
                use mysql_async::prelude::Queryable;
                let n: Option<u64> = conn
                    .lock()
                    .await
                    .exec_first("SELECT n FROM order_service_last WHERE sku = ?", (sku,))
                    .await
                    .expect("read the order number");
                n.unwrap_or(0)
            }
            #[cfg(feature = "etcd")]
            Numbers::Etcd(kv) => {
                let got = kv
                    .clone()
                    .get(zk_node(sku), None)
                    .await
                    .expect("read the order number");
                got.kvs().first().map_or(0, |kv| {
                    String::from_utf8_lossy(kv.value()).parse().unwrap_or(0)
                })
            }
        }
    }

    async fn write(&self, sku: &str, n: u64) {
        match self {
            Numbers::Local(m) => {
                m.lock().unwrap().insert(sku.to_owned(), n);
            }
            #[cfg(feature = "redis")]
            Numbers::Redis(c) => {
                let _: () = redis::cmd("SET")
                    .arg(Self::redis_key(sku))
                    .arg(n)
                    .query_async(&mut c.clone())
                    .await
                    .expect("write the order number");
            }
            #[cfg(feature = "zookeeper")]
            Numbers::ZooKeeper(zk) => {
                let (path, data) = (zk_node(sku), n.to_string());
                match zk.set_data(&path, data.as_bytes(), None).await {
                    Err(zookeeper_client::Error::NoNode) => {
                        let persistent = zookeeper_client::CreateMode::Persistent
                            .with_acls(zookeeper_client::Acls::anyone_all());
                        zk.mkdir("/order_service/last", &persistent)
                            .await
                            .expect("create the order numbers' parent");
                        // Without the lock another request may create it first.
                        match zk.create(&path, data.as_bytes(), &persistent).await {
                            Ok(_) => {}
                            Err(zookeeper_client::Error::NodeExists) => {
                                zk.set_data(&path, data.as_bytes(), None)
                                    .await
                                    .expect("write the order number");
                            }
                            Err(e) => panic!("write the order number: {e}"),
                        }
                    }
                    r => {
                        r.expect("write the order number");
                    }
                }
            }
            #[cfg(feature = "postgres")]
            Numbers::Postgres(pg) => {
                pg.query_typed(
                    "INSERT INTO order_service_last (sku, n) VALUES ($1, $2) \
                     ON CONFLICT (sku) DO UPDATE SET n = excluded.n",
                    &[(&sku, Type::TEXT), (&(n as i64), Type::INT8)],
                )
                .await
                .expect("write the order number");
            }
            #[cfg(feature = "mysql")]
            Numbers::Mysql(conn) => {
                use mysql_async::prelude::Queryable;
                conn.lock()
                    .await
                    .exec_drop(
                        "INSERT INTO order_service_last (sku, n) VALUES (?, ?) \
                         ON DUPLICATE KEY UPDATE n = VALUES(n)",
                        (sku, n),
                    )
                    .await
                    .expect("write the order number");
            }
            #[cfg(feature = "etcd")]
            Numbers::Etcd(kv) => {
                kv.clone()
                    .put(zk_node(sku), n.to_string(), None)
                    .await
                    .expect("write the order number");
            }
        }
    }

    /// Forgets a SKU's number, so that a run starts from 1.
    async fn reset(&self, sku: &str) {
        match self {
            Numbers::Local(m) => {
                m.lock().unwrap().remove(sku);
            }
            #[cfg(feature = "redis")]
            Numbers::Redis(c) => {
                let _: Result<(), _> = redis::cmd("DEL")
                    .arg(Self::redis_key(sku))
                    .query_async(&mut c.clone())
                    .await;
            }
            #[cfg(feature = "zookeeper")]
            Numbers::ZooKeeper(zk) => {
                let _ = zk.delete(&zk_node(sku), None).await;
            }
            #[cfg(feature = "postgres")]
            Numbers::Postgres(pg) => {
                let _ = pg
                    .query_typed(
                        "DELETE FROM order_service_last WHERE sku = $1",
                        &[(&sku, Type::TEXT)],
                    )
                    .await;
            }
            #[cfg(feature = "mysql")]
            Numbers::Mysql(conn) => {
                use mysql_async::prelude::Queryable;
                let _ = conn
                    .lock()
                    .await
                    .exec_drop("DELETE FROM order_service_last WHERE sku = ?", (sku,))
                    .await;
            }
            #[cfg(feature = "etcd")]
            Numbers::Etcd(kv) => {
                let _ = kv.clone().delete(zk_node(sku), None).await;
            }
        }
    }
}

/// Where the instances keep the order numbers when they share a backend: the
/// Redis server (with Redlock, the first server), the ZooKeeper ensemble, the
/// PostgreSQL or MariaDB database, or the etcd cluster. Each is built in with
/// the backend's feature; the memory backend keeps them in the process.
async fn shared_store(backend: &str) -> Result<Numbers, String> {
    #[cfg(feature = "redis")]
    {
        let redis_url = if backend.starts_with("redis://") {
            Some(backend.to_owned())
        } else {
            backend
                .strip_prefix("redlock://")
                .and_then(|rest| rest.split(',').next())
                .map(|first| format!("redis://{first}/"))
        };
        if let Some(url) = redis_url {
            let client = redis::Client::open(url).map_err(|e| e.to_string())?;
            let conn = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| e.to_string())?;
            return Ok(Numbers::Redis(conn));
        }
    }
    #[cfg(feature = "zookeeper")]
    if let Some(rest) = backend.strip_prefix("zk://") {
        let hosts = rest.split('/').next().unwrap_or(rest);
        let zk = zookeeper_client::Client::connect(hosts)
            .await
            .map_err(|e| format!("connecting to ZooKeeper at {hosts}: {e}"))?;
        return Ok(Numbers::ZooKeeper(zk));
    }
    #[cfg(feature = "postgres")]
    if backend.starts_with("postgres://") || backend.starts_with("postgresql://") {
        // The lock's own parameter is not the driver's; every statement is
        // unnamed, so that it also runs through a pooler in transaction
        // mode.
        let url = tower_lock::backend::postgres::driver_url(backend);
        let (pg, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("connecting to PostgreSQL: {e}"))?;
        tokio::spawn(connection);
        pg.batch_execute(
            "CREATE TABLE IF NOT EXISTS order_service_last (sku text PRIMARY KEY, n bigint NOT NULL)",
        )
        .await
        .map_err(|e| format!("creating the order numbers' table: {e}"))?;
        return Ok(Numbers::Postgres(pg));
    }
    #[cfg(feature = "mysql")]
    if backend.starts_with("mysql://") {
        use mysql_async::prelude::Queryable;
        let mut conn = mysql_async::Conn::from_url(backend)
            .await
            .map_err(|e| format!("connecting to MariaDB: {e}"))?;
        conn.query_drop(
            "CREATE TABLE IF NOT EXISTS order_service_last \
             (sku VARCHAR(255) PRIMARY KEY, n BIGINT UNSIGNED NOT NULL)",
        )
        .await
        .map_err(|e| format!("creating the order numbers' table: {e}"))?;
        return Ok(Numbers::Mysql(tokio::sync::Mutex::new(conn)));
    }
    #[cfg(feature = "etcd")]
    if let Some(rest) = backend.strip_prefix("etcd://") {
        let hosts: Vec<&str> = rest.split('/').next().unwrap_or(rest).split(',').collect();
        let etcd = etcd_client::Client::connect(&hosts, None)
            .await
            .map_err(|e| format!("connecting to etcd at {hosts:?}: {e}"))?;
        return Ok(Numbers::Etcd(etcd.kv_client()));
    }
    let _ = backend;
    Ok(Numbers::Local(Mutex::new(HashMap::new())))
}

/// How long the handler "talks to the database" between read and write.
const DB_ROUND_TRIP: Duration = Duration::from_millis(5);

fn unix_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

async fn create_order(
    State(numbers): State<Arc<Numbers>>,
    Path(sku): Path<String>,
    held: Option<HeldLock>,
) -> String {
    let enter = unix_us();
    // Deliberately unsafe without the lock: read, await, write.
    let last = numbers.read(&sku).await;
    tokio::time::sleep(DB_ROUND_TRIP).await;
    numbers.write(&sku, last + 1).await;
    let leave = unix_us();
    let (waited, token) = held.map_or((Duration::ZERO, 0), |h| (h.waited(), h.token().get()));
    format!(
        "code=ORD-{sku}-{:05} waited_us={} enter_us={enter} leave_us={leave} token={token} pid={}",
        last + 1,
        waited.as_micros(),
        std::process::id(),
    )
}

struct Args {
    backend: String,
    requests: usize,
    instances: usize,
    sku: String,
    no_lock: bool,
    serve: bool,
    /// Internal: run as one of `--instances`, print the address, serve.
    child: bool,
}

const USAGE: &str = "usage: order_service [--backend URL] [--instances N] [--requests N] [--sku S] [--no-lock] [--serve]";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backend: "memory".into(),
        requests: 10,
        instances: 1,
        sku: "SKU-1001".into(),
        no_lock: false,
        serve: false,
        child: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => args.backend = value()?,
            "--requests" => {
                args.requests = value()?.parse().map_err(|e| format!("--requests: {e}"))?;
            }
            "--instances" => {
                args.instances = value()?.parse().map_err(|e| format!("--instances: {e}"))?;
            }
            "--sku" => args.sku = value()?,
            "--no-lock" => args.no_lock = true,
            "--serve" => args.serve = true,
            "--child" => args.child = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if args.requests == 0 || args.instances == 0 {
        return Err("--requests and --instances must be at least 1".into());
    }
    if args.instances > 1 && args.backend == "memory" {
        return Err(
            "--instances needs a backend the processes share (redis://..., zk://...): \
             the memory backend lives in one process"
                .into(),
        );
    }
    Ok(args)
}

/// One finished request, parsed from its reply.
struct Outcome {
    code: String,
    waited_us: u64,
    enter_us: u128,
    leave_us: u128,
    token: u64,
    pid: u32,
}

fn parse_reply(body: &str) -> Option<Outcome> {
    let field = |name: &str| {
        body.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    };
    Some(Outcome {
        code: field("code")?.to_owned(),
        waited_us: field("waited_us")?.parse().ok()?,
        enter_us: field("enter_us")?.parse().ok()?,
        leave_us: field("leave_us")?.parse().ok()?,
        token: field("token")?.parse().ok()?,
        pid: field("pid")?.parse().ok()?,
    })
}

/// Builds the app and starts serving it on a free loopback port. The
/// backend is returned for [`Backend::flush`] before the process exits.
async fn start_server(args: &Args) -> Result<(SocketAddr, Arc<dyn Backend>), String> {
    let backend = tower_lock::backend::connect(&args.backend)
        .await
        .map_err(|e| match e {
            // Each remote backend is built into this example by its feature.
            tower_lock::LockError::Config(m) if m.contains("feature") => format!(
                "{m}: run `cargo run --example order_service --features <feature> -- --backend ...`"
            ),
            e => e.to_string(),
        })?;
    let numbers = shared_store(&args.backend).await?;
    let mut app = Router::new().route("/orders/{sku}", post(create_order));
    if !args.no_lock {
        let locker = Locker::from_arc(backend.clone()).wait(Duration::from_secs(10));
        app = app.route_layer(LockLayer::with_locker(locker, PathParam("sku")).namespace("sku"));
    }
    let app = app.with_state(Arc::new(numbers));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((addr, backend))
}

/// Starts `n` servers in child processes and returns their addresses.
fn spawn_instances(n: usize) -> Result<(Vec<Child>, Vec<SocketAddr>), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..n {
        // The child serves until its stdin closes.
        let mut child = Command::new(&exe)
            .args(std::env::args().skip(1))
            .arg("--child")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().expect("piped"))
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let addr = line
            .trim()
            .strip_prefix("listening=")
            .and_then(|a| a.parse().ok())
            .ok_or(format!("an instance did not start: {line:?}"))?;
        children.push(child);
        addrs.push(addr);
    }
    Ok((children, addrs))
}

#[tokio::main]
async fn main() -> ExitCode {
    // `RUST_LOG=tower_lock=debug` shows one span per acquisition.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if args.child {
        return match start_server(&args).await {
            Ok((addr, backend)) => {
                println!("listening={addr}");
                // Serve until the parent closes our stdin, then let the
                // last releases reach the backend before exiting.
                let _ = tokio::io::copy(&mut tokio::io::stdin(), &mut tokio::io::sink()).await;
                backend.flush().await;
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("order_service instance: {e}");
                ExitCode::from(2)
            }
        };
    }

    let (children, addrs, backend) = if args.instances > 1 {
        match spawn_instances(args.instances) {
            Ok((children, addrs)) => (children, addrs, None),
            Err(e) => {
                eprintln!("order_service: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        match start_server(&args).await {
            Ok((addr, backend)) => (Vec::new(), vec![addr], Some(backend)),
            Err(e) => {
                eprintln!("order_service: {e}");
                return ExitCode::from(2);
            }
        }
    };
    // A fresh counter for this run (shared stores outlive it).
    if let Ok(numbers) = shared_store(&args.backend).await {
        numbers.reset(&args.sku).await;
    }
    let servers: Vec<String> = addrs.iter().map(|a| format!("http://{a}")).collect();
    println!(
        "order_service on {} (backend {}, {})",
        servers.join(" and "),
        args.backend,
        if args.no_lock {
            "NO lock"
        } else {
            "LockLayer on path parameter `sku`"
        }
    );

    let outcomes = fire(&addrs, &args.sku, args.requests).await;
    report(&outcomes, args.requests);

    if args.serve {
        println!(
            "serving until Ctrl-C: curl -X POST {}/orders/{}",
            servers[0], args.sku
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    for mut c in children {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    // Releases still in flight reach the backend before the process exits.
    if let Some(backend) = backend {
        backend.flush().await;
    }
    ExitCode::SUCCESS
}

/// Sends `n` concurrent requests for one SKU, each on its own connection,
/// spread over the servers in turn.
async fn fire(addrs: &[SocketAddr], sku: &str, n: usize) -> Vec<Option<Outcome>> {
    let mut clients = Vec::with_capacity(n);
    for i in 0..n {
        let addr = addrs[i % addrs.len()];
        clients.push(common::Client::connect(addr).await.expect("connect"));
    }
    let path = format!("/orders/{sku}");
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            let path = path.clone();
            tokio::spawn(async move {
                match c.post(&path).await {
                    Ok(r) if r.status.is_success() => parse_reply(&r.body),
                    Ok(r) => {
                        eprintln!("request failed: {} {}", r.status, r.body.trim());
                        None
                    }
                    Err(e) => {
                        eprintln!("request failed: {e}");
                        None
                    }
                }
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(n);
    for t in tasks {
        outcomes.push(t.await.expect("request task"));
    }
    outcomes
}

fn report(outcomes: &[Option<Outcome>], n: usize) {
    let ok: Vec<&Outcome> = outcomes.iter().flatten().collect();
    let mut sorted = ok.clone();
    sorted.sort_by_key(|o| o.enter_us);
    let t0 = sorted.first().map_or(0, |o| o.enter_us);
    for (i, o) in sorted.iter().enumerate() {
        println!(
            "request {:>3}: waited {:>8.3} ms, held {:>8.3} .. {:>8.3} ms, order code {}, fencing token {}, server pid {}",
            i + 1,
            o.waited_us as f64 / 1e3,
            (o.enter_us - t0) as f64 / 1e3,
            (o.leave_us - t0) as f64 / 1e3,
            o.code,
            o.token,
            o.pid,
        );
    }
    // A request was serialised if its critical section overlapped no other's.
    let serialised = ok
        .iter()
        .enumerate()
        .filter(|(i, a)| {
            ok.iter()
                .enumerate()
                .all(|(j, b)| *i == j || a.leave_us <= b.enter_us || b.leave_us <= a.enter_us)
        })
        .count();
    // The most critical sections open at one instant, across every process.
    let mut edges: Vec<(u128, i32)> = ok
        .iter()
        .flat_map(|o| [(o.enter_us, 1), (o.leave_us, -1)])
        .collect();
    edges.sort_by_key(|&(t, d)| (t, d)); // a leave before an enter at the same instant
    let (mut open, mut max_open) = (0, 0);
    for (_, d) in edges {
        open += d;
        max_open = max_open.max(open);
    }
    let mut codes: Vec<&str> = ok.iter().map(|o| o.code.as_str()).collect();
    codes.sort_unstable();
    codes.dedup();
    println!(
        "serialised: {serialised}/{n} requests, {} unique order codes, max concurrent in critical section = {max_open}",
        codes.len(),
    );
}
