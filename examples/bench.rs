//! The benchmark program: command line, workloads and output format are
//! described in `bench/README.md`.
//!
//! ```text
//! cargo run --release --example bench -- --backend memory --workload uncontended --n 5000
//! cargo run --release --example bench -- --backend memory --workload contended --secs 5 --workers 8
//! cargo run --release --example bench -- --backend memory --workload contended --secs 5 --no-lock
//! cargo run --release --example bench -- --backend memory --workload keys --secs 5 --workers 8 --keys 100
//! cargo run --release --example bench -- --backend memory --workload http --secs 5 --conns 32
//! cargo run --release --example bench -- --backend memory --workload http --secs 5 --conns 32 --calibrate
//! cargo run --release --example bench -- --backend zk://127.0.0.1:2181 --workload floor --n 2000
//! ```
//!
//! `floor` measures the physical floor of a lock through the client the
//! backend uses: on ZooKeeper one raw create of an ephemeral node and its
//! delete with `zookeeper-client` (`impl=raw-create-delete`), on Redis two
//! PINGs through the `redis` crate's `ConnectionManager`
//! (`impl=redis-rs-2xping`), on PostgreSQL two prepared `SELECT 1` through
//! `tokio-postgres` (`impl=tokio-postgres-2xselect`), on MariaDB the same
//! through `mysql_async` (`impl=mysql-async-2xselect`), on etcd one put
//! and one delete through `etcd-client` (`impl=etcd-client-put-delete`),
//! printed as
//! `workload=uncontended` lines to sit beside the locks'. Given a
//! `redis+sentinel://` or `redis+cluster://` URL, the Redis floor is a
//! master's (the one the Sentinels name; a master among the nodes), its
//! line tagged `sentinels=N` or `servers=N` as the locks' lines are.
//!
//! `--release drop` (the default) releases each lock by dropping its guard,
//! as the layer and the extractors do: remote backends then send the release
//! and await its answer in the background, and the next acquire follows it
//! on the same connection. `--release await` calls `guard.release().await`,
//! which waits for the answer: one more round trip per cycle. Its lines carry
//! `release=await` after the workload. Lines measured on a ZooKeeper
//! ensemble, an etcd cluster or a Redis Cluster carry `servers=N` there
//! too, and Redis through Sentinel `sentinels=N`.
//!
//! `http` on the memory backend also measures, in the same run and phases,
//! the handler a user would write instead of the library: the route's SKU
//! locked through a shared `DashMap` of per-key `tokio::sync::Mutex`es that
//! forgets a key when its last user leaves. It gets a line of its own,
//! `impl=hand-mutex-map`, in the library's format (`rps_locked` is the rate
//! of its route, `ratio` that rate over the bare route's).
//!
//! The critical section of `contended` and `keys` counts its holders and
//! yields (or sleeps `--hold-us`) while inside, so a lock that lets two
//! holders in shows `overlaps>0` whatever its latency; `--no-lock` is the
//! negative control that proves it (`impl=no-lock`: each worker locks a key
//! of its own through the same backend, so the lock excludes nobody).
//!
//! Each result is one line of `key=value` pairs separated by single spaces.
//! Exit code 2 for bad arguments or a backend this build cannot open.

mod common;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::routing::post;
use axum::Router;
use dashmap::DashMap;
use tower_lock::{Backend, BackendExt, LockGuard, LockLayer, Locker, PathParam, Wait};

struct Args {
    backend: String,
    workload: String,
    n: usize,
    secs: u64,
    workers: usize,
    keys: usize,
    conns: usize,
    processes: usize,
    /// `guard.release().await` rather than dropping the guard.
    await_release: bool,
    /// How long a holder stays in the critical section; zero yields once.
    hold: Duration,
    /// Negative control: each worker locks a key of its own, so the lock
    /// excludes nobody and the overlap check must see overlaps.
    no_lock: bool,
    /// `http`: serve both routes bare, to calibrate the comparison.
    calibrate: bool,
    /// Internal: run as one of `--processes`, logging critical sections to
    /// this file.
    section_log: Option<String>,
}

const USAGE: &str = "usage: bench --backend <memory|redis://..|redlock://..|zk://..> \
--workload <uncontended|contended|keys|http|floor> [--n N] [--secs S] [--workers W] [--keys K] \
[--conns C] [--processes P] [--release drop|await] [--hold-us H] [--no-lock] [--calibrate]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        backend: "memory".into(),
        workload: String::new(),
        n: 5000,
        secs: 5,
        workers: 8,
        keys: 100,
        conns: 32,
        processes: 1,
        await_release: false,
        hold: Duration::ZERO,
        no_lock: false,
        calibrate: false,
        section_log: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{flag}: {v:?} is not a positive number"))
        }
        match flag.as_str() {
            "--backend" => a.backend = value()?,
            "--workload" => a.workload = value()?,
            "--n" => a.n = num(&flag, value()?)?,
            "--secs" => a.secs = num(&flag, value()?)?,
            "--workers" => a.workers = num(&flag, value()?)?,
            "--keys" => a.keys = num(&flag, value()?)?,
            "--conns" => a.conns = num(&flag, value()?)?,
            "--processes" => a.processes = num(&flag, value()?)?,
            "--section-log" => a.section_log = Some(value()?),
            "--hold-us" => a.hold = Duration::from_micros(num(&flag, value()?)?),
            "--no-lock" => a.no_lock = true,
            "--calibrate" => a.calibrate = true,
            "--release" => {
                a.await_release = match value()?.as_str() {
                    "drop" => false,
                    "await" => true,
                    other => return Err(format!("--release: {other:?} is not drop or await")),
                }
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.workload.is_empty() {
        return Err(format!("--workload is required\n{USAGE}"));
    }
    if a.no_lock && !matches!(a.workload.as_str(), "contended" | "keys") {
        return Err("--no-lock applies to the contended and keys workloads".into());
    }
    if a.calibrate && a.workload != "http" {
        return Err("--calibrate applies to the http workload".into());
    }
    if a.n == 0 || a.secs == 0 || a.workers == 0 || a.keys == 0 || a.conns == 0 || a.processes == 0
    {
        return Err("every count must be at least 1".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    // `uncontended` is one task: a single-threaded runtime measures the lock
    // rather than wake-ups between worker threads. The other workloads run
    // tasks in parallel.
    let mut builder = if args.workload == "uncontended" || args.workload == "floor" {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let rt = builder.enable_all().build().expect("tokio runtime");
    rt.block_on(run(args))
}

/// Whether the PostgreSQL URL measured leads to a pooler, such as PgBouncer
/// (set once at start, for lease-table URLs).
static BEHIND_POOLER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn behind_pooler() -> bool {
    BEHIND_POOLER.get().copied().unwrap_or(false)
}

/// Whether `url` leads to a pooler: the server behind it listens on
/// another port than the URL's.
async fn find_pooler(url: &str) -> bool {
    let plain = tower_lock::backend::postgres::driver_url(url);
    let Ok((client, connection)) = tokio_postgres::connect(&plain, tokio_postgres::NoTls).await
    else {
        // The run itself says why it cannot connect.
        return false;
    };
    tokio::spawn(connection);
    // The server's own setting: known whether the pooler reaches it by
    // TCP or by a Unix socket.
    let server_port: Option<i32> = match client
        .query_one("SELECT current_setting('port')::int", &[])
        .await
    {
        Ok(row) => row.get(0),
        Err(_) => return false,
    };
    // The driver's own reading of the URL (`host:port`, or `?port=`).
    let url_port = plain
        .parse::<tokio_postgres::Config>()
        .ok()
        .and_then(|c| c.get_ports().first().copied())
        .unwrap_or(5432);
    server_port.is_some_and(|p| p != i32::from(url_port))
}

async fn run(args: Args) -> ExitCode {
    if servers_setting(&args.backend).contains("mode=lease-table") {
        let _ = BEHIND_POOLER.set(find_pooler(&args.backend).await);
    }
    if args.workload == "floor" {
        return floor(&args.backend, args.n).await;
    }
    let backend = match tower_lock::backend::connect(&args.backend).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    if args.processes > 1 && backend.name() == "memory" {
        eprintln!("bench: --processes needs a backend shared between processes; `memory` lives in one process");
        return ExitCode::from(2);
    }
    if args.processes > 1 && args.workload != "contended" {
        eprintln!("bench: --processes applies to the contended workload");
        return ExitCode::from(2);
    }
    let how = match How::new(&args) {
        Ok(how) => how,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    if args.section_log.is_some() {
        // One of `--processes`: its raw tally, for the parent to add up.
        let r = run_workers(
            &backend,
            args.workers,
            vec!["bench:contended".into()],
            args.secs,
            &how,
        )
        .await;
        backend.flush().await;
        let waits: Vec<String> = r.waits.iter().map(|w| w.as_nanos().to_string()).collect();
        println!(
            "child cycles={} elapsed_ns={} per_worker_min={} per_worker_max={} overlaps={} waits_ns={}",
            r.cycles,
            r.elapsed.as_nanos(),
            r.per_worker_min,
            r.per_worker_max,
            r.overlaps,
            waits.join(",")
        );
        return ExitCode::SUCCESS;
    }
    let name = backend.name();
    let mut peer_line = None;
    let line = match args.workload.as_str() {
        "uncontended" => uncontended(&backend, args.n, &how).await,
        "contended" if args.processes > 1 => match contended_processes(&args).await {
            Ok(line) => line,
            Err(e) => {
                eprintln!("bench: {e}");
                return ExitCode::FAILURE;
            }
        },
        "contended" => contended(&backend, args.workers, args.secs, &how).await,
        "keys" => keys(&backend, args.workers, args.keys, args.secs, &how).await,
        "http" => {
            let rates = http(backend.clone(), args.conns, args.secs, args.calibrate).await;
            let line = |rps_locked: f64| {
                format!(
                    "conns={} secs={} rps_bare={:.0} rps_locked={rps_locked:.0} ratio={:.3}",
                    args.conns,
                    args.secs,
                    rates.bare,
                    rps_locked / rates.bare
                )
            };
            match rates.peer {
                // The peer's route is bare too: its slot's rate goes on the
                // calibration line.
                Some(peer) if args.calibrate => format!(
                    "{} rps_peer={peer:.0} ratio_peer={:.3}",
                    line(rates.locked),
                    peer / rates.bare
                ),
                // The hand-written peer's own line, in the library's format:
                // its `rps_locked` is the rate of its route.
                Some(peer) => {
                    peer_line = Some(format!(
                        "impl={HAND_MUTEX_MAP} backend={name} workload=http {}",
                        line(peer)
                    ));
                    line(rates.locked)
                }
                None => line(rates.locked),
            }
        }
        other => {
            eprintln!("bench: unknown workload {other:?}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    // Releases still in flight reach the server before the process exits.
    backend.flush().await;
    // The negative control and the calibration are not this library's
    // figures: they say so in the first field.
    let implementation = if args.no_lock {
        "no-lock"
    } else if args.calibrate {
        "bare-vs-bare"
    } else {
        "tower-lock"
    };
    // A line measured with `--release await` says so; `drop` is the default.
    let release = if args.await_release && args.workload != "http" {
        " release=await"
    } else {
        ""
    };
    let servers = servers_setting(&args.backend);
    println!(
        "impl={implementation} backend={name} workload={}{release}{servers} {line}",
        args.workload
    );
    if let Some(peer_line) = peer_line {
        println!("{peer_line}");
    }
    ExitCode::SUCCESS
}

/// ` servers=N` for a ZooKeeper ensemble, an etcd cluster of N > 1 or a
/// Redis Cluster (the URL's hosts), ` sentinels=N` for Redis through
/// Sentinel, ` mode=lease-table` for PostgreSQL's lease-table mode, so that
/// their lines are not taken for a single server's or the default mode's.
fn servers_setting(url: &str) -> String {
    // Redis under Sentinel: ` sentinels=N`; on a Redis Cluster, the nodes
    // given: ` servers=N`; and the replicas each write waits for.
    let redis = url
        .strip_prefix("redis+sentinel://")
        .map(|rest| ("sentinels", rest))
        .or_else(|| {
            url.strip_prefix("redis+cluster://")
                .map(|rest| ("servers", rest))
        });
    if let Some((what, rest)) = redis {
        let hosts = rest.split(['/', '?']).next().unwrap_or(rest);
        let hosts = hosts.rsplit('@').next().unwrap_or(hosts);
        let mut setting = format!(" {what}={}", hosts.split(',').count());
        let query = rest.split_once('?').map_or("", |(_, q)| q);
        if let Some(n) = query
            .split('&')
            .find_map(|p| p.strip_prefix("wait_replicas="))
        {
            setting += &format!(" wait_replicas={n}");
        }
        return setting;
    }
    // PostgreSQL's lease-table mode: ` mode=lease-table`.
    if (url.starts_with("postgres://") || url.starts_with("postgresql://"))
        && url
            .split_once('?')
            .is_some_and(|(_, q)| q.split('&').any(|p| p.starts_with("lease_table")))
    {
        let via = if behind_pooler() { " via=pooler" } else { "" };
        return format!(" mode=lease-table{via}");
    }
    let Some(rest) = url
        .strip_prefix("zk://")
        .or_else(|| url.strip_prefix("etcd://"))
    else {
        return String::new();
    };
    match rest.split('/').next().unwrap_or(rest).split(',').count() {
        1 => String::new(),
        n => format!(" servers={n}"),
    }
}

/// Microseconds, with two decimals below 10 µs (the memory backend's range)
/// and none above.
fn us(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 10.0 {
        format!("{us:.2}")
    } else {
        format!("{us:.0}")
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

async fn uncontended(backend: &Arc<dyn Backend>, n: usize, how: &How) -> String {
    let samples = timed(n, || async {
        let g = backend.lock("bench:uncontended").await.expect("lock");
        how.release(g).await;
    })
    .await;
    latencies(n, samples)
}

/// The durations of `n` runs of `cycle`, after 50 untimed ones to warm up.
async fn timed<F, Fut>(n: usize, mut cycle: F) -> Vec<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for _ in 0..50 {
        cycle().await;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        cycle().await;
        samples.push(t.elapsed());
    }
    samples
}

/// `n=.. p50_us=.. p99_us=..` of acquire+release samples.
fn latencies(n: usize, mut samples: Vec<Duration>) -> String {
    samples.sort_unstable();
    format!(
        "n={n} p50_us={} p99_us={}",
        us(percentile(&samples, 0.50)),
        us(percentile(&samples, 0.99))
    )
}

/// One raw create (ephemeral) and delete per sample: the round trips any
/// ZooKeeper lock needs at least.
async fn floor(backend: &str, n: usize) -> ExitCode {
    if backend.starts_with("redis://") {
        return redis_floor(backend, n, "").await;
    }
    if backend.starts_with("redis+sentinel://") || backend.starts_with("redis+cluster://") {
        // The master's floor, on a line tagged as the locks' lines are (the
        // replicas a write waits for are the locks' business, not the
        // floor's).
        let tag = servers_setting(backend.split('?').next().unwrap_or(backend));
        return match redis_group_master(backend).await {
            Ok(master) => redis_floor(&master, n, &tag).await,
            Err(e) => {
                eprintln!("bench: {e}");
                ExitCode::from(2)
            }
        };
    }
    if backend.starts_with("postgres://") || backend.starts_with("postgresql://") {
        return postgres_floor(backend, n).await;
    }
    if backend.starts_with("mysql://") {
        return mysql_floor(backend, n).await;
    }
    if let Some(rest) = backend.strip_prefix("etcd://") {
        let servers = servers_setting(backend);
        return etcd_floor(rest.split('/').next().unwrap_or(rest), n, &servers).await;
    }
    let Some(hosts) = backend
        .strip_prefix("zk://")
        .map(|r| r.split('/').next().unwrap_or(r))
    else {
        eprintln!(
            "bench: the floor workload is measured for redis:// (and redis+sentinel://, redis+cluster://), zk://, postgres://, mysql:// and etcd:// backends only"
        );
        return ExitCode::from(2);
    };
    let zk = match zookeeper_client::Client::connect(hosts).await {
        Ok(zk) => zk,
        Err(e) => {
            eprintln!("bench: connecting to ZooKeeper at {hosts}: {e}");
            return ExitCode::from(2);
        }
    };
    let ephemeral =
        zookeeper_client::CreateMode::Ephemeral.with_acls(zookeeper_client::Acls::anyone_all());
    let path = format!("/bench-floor-{}", std::process::id());
    let samples = timed(n, || async {
        zk.create(&path, &[], &ephemeral).await.expect("create");
        zk.delete(&path, None).await.expect("delete");
    })
    .await;
    println!(
        "impl=raw-create-delete backend=zookeeper workload=uncontended{} {}",
        servers_setting(backend),
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// The `redis://` URL of the master behind a `redis+sentinel://` URL (as
/// the first Sentinel that answers names it) or of a master of a
/// `redis+cluster://` one (the first node given that says it is one).
/// Only the bench's own URLs: no credentials, no database.
async fn redis_group_master(url: &str) -> Result<String, String> {
    let (sentinel, rest) = match url.strip_prefix("redis+sentinel://") {
        Some(rest) => (true, rest),
        None => (false, url.strip_prefix("redis+cluster://").unwrap_or(url)),
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let hosts = hosts.split('?').next().unwrap_or(hosts);
    let name = path.split(['/', '?']).next().unwrap_or("");
    for host in hosts.split(',') {
        let Ok(client) = redis::Client::open(format!("redis://{host}")) else {
            continue;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        if sentinel {
            let addr: redis::RedisResult<Option<(String, u16)>> = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(name)
                .query_async(&mut conn)
                .await;
            if let Ok(Some((ip, port))) = addr {
                return Ok(format!("redis://{ip}:{port}"));
            }
        } else {
            let role: redis::RedisResult<Vec<redis::Value>> =
                redis::cmd("ROLE").query_async(&mut conn).await;
            if matches!(role.as_deref(), Ok([redis::Value::BulkString(r), ..]) if r == b"master") {
                return Ok(format!("redis://{host}"));
            }
        }
    }
    Err(format!("no master found behind {url}"))
}

/// Two PINGs per sample through the `redis` crate's `ConnectionManager`, the
/// connection the Redis backend uses: the round trips a lock needs at least,
/// as this client makes them. `tag` marks a group's master (` sentinels=N`,
/// ` servers=N`).
async fn redis_floor(url: &str, n: usize, tag: &str) -> ExitCode {
    let conn = match redis::Client::open(url) {
        Ok(client) => redis::aio::ConnectionManager::new(client).await,
        Err(e) => Err(e),
    };
    let conn = match conn {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("bench: connecting to Redis at {url}: {e}");
            return ExitCode::from(2);
        }
    };
    let samples = timed(n, || {
        let mut conn = conn.clone();
        async move {
            for _ in 0..2 {
                let _: String = redis::cmd("PING")
                    .query_async(&mut conn)
                    .await
                    .expect("ping");
            }
        }
    })
    .await;
    println!(
        "impl=redis-rs-2xping backend=redis workload=uncontended{tag} {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// Two `SELECT 1` per sample, prepared once, through `tokio-postgres` (the
/// driver the PostgreSQL backend uses): the round trips a lock needs at
/// least.
async fn postgres_floor(url: &str, n: usize) -> ExitCode {
    // The driver knows no `lease_table` parameter.
    let plain = tower_lock::backend::postgres::driver_url(url);
    let client = match tokio_postgres::connect(&plain, tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(connection);
            client
        }
        Err(e) => {
            eprintln!("bench: connecting to PostgreSQL: {e}");
            return ExitCode::from(2);
        }
    };
    // The lease-table mode writes a row to lock and deletes it to unlock:
    // its floor is two committed writes (each waits for the WAL flush).
    if url.contains("lease_table") {
        client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS bench_floor (key text PRIMARY KEY, n bigint NOT NULL)",
            )
            .await
            .expect("create the floor's table");
        const UPSERT: &str = "INSERT INTO bench_floor VALUES ('floor', 1) \
                              ON CONFLICT (key) DO UPDATE SET n = bench_floor.n + 1";
        // Behind a pooler a prepared statement may run on another server
        // session: the library's statements are then unnamed, and so are
        // the floor's.
        let upsert = match behind_pooler() {
            false => Some(client.prepare(UPSERT).await.expect("prepare")),
            true => None,
        };
        let samples = timed(n, || async {
            for _ in 0..2 {
                match &upsert {
                    Some(upsert) => client.execute(upsert, &[]).await.map(drop),
                    None => client.query_typed(UPSERT, &[]).await.map(drop),
                }
                .expect("upsert");
            }
        })
        .await;
        client
            .batch_execute("DROP TABLE bench_floor")
            .await
            .expect("drop the floor's table");
        println!(
            "impl=tokio-postgres-2xupsert backend=postgres workload=uncontended{} {}",
            servers_setting(url),
            latencies(n, samples)
        );
        return ExitCode::SUCCESS;
    }
    let select = client.prepare("SELECT 1").await.expect("prepare");
    let samples = timed(n, || async {
        for _ in 0..2 {
            client.query_one(&select, &[]).await.expect("select");
        }
    })
    .await;
    println!(
        "impl=tokio-postgres-2xselect backend=postgres workload=uncontended {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// One put and one delete per sample through `etcd-client` (the client the
/// etcd backend uses): the writes any etcd lock needs at least.
async fn etcd_floor(hosts: &str, n: usize, servers: &str) -> ExitCode {
    let endpoints: Vec<&str> = hosts.split(',').collect();
    let client = match etcd_client::Client::connect(&endpoints, None).await {
        Ok(client) => client,
        Err(e) => {
            eprintln!("bench: connecting to etcd at {hosts}: {e}");
            return ExitCode::from(2);
        }
    };
    let key = format!("/bench-floor-{}", std::process::id());
    let samples = timed(n, || {
        let (mut kv, key) = (client.kv_client(), key.clone());
        async move {
            kv.put(key.as_str(), "", None).await.expect("put");
            kv.delete(key.as_str(), None).await.expect("delete");
        }
    })
    .await;
    println!(
        "impl=etcd-client-put-delete backend=etcd workload=uncontended{servers} {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// Two `SELECT 1` per sample, prepared once, through `mysql_async` (the
/// driver the MariaDB backend uses).
async fn mysql_floor(url: &str, n: usize) -> ExitCode {
    use mysql_async::prelude::Queryable;
    let conn = match mysql_async::Conn::from_url(url).await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("bench: connecting to MariaDB: {e}");
            return ExitCode::from(2);
        }
    };
    let conn = tokio::sync::Mutex::new(conn);
    let samples = timed(n, || async {
        let mut conn = conn.lock().await;
        for _ in 0..2 {
            let _: Option<i64> = conn.exec_first("SELECT 1", ()).await.expect("select");
        }
    })
    .await;
    println!(
        "impl=mysql-async-2xselect backend=mysql workload=uncontended {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// How the workers lock, hold and release, and where they log their critical
/// sections.
#[derive(Clone)]
struct How {
    await_release: bool,
    /// Time spent inside the critical section; zero yields once. Either way
    /// other tasks run while a holder is inside, so two holders at once show
    /// as an overlap whatever the lock's latency.
    hold: Duration,
    /// Each worker locks a key of its own: the negative control.
    no_lock: bool,
    /// Under `--processes`: a file every process appends `E token` and
    /// `L token` lines to on entering and leaving a critical section. Appends
    /// are atomic and ordered by the kernel, so the parent finds any overlap
    /// between processes as two `E` lines without an `L` between them.
    section_log: Option<Arc<std::fs::File>>,
}

impl How {
    fn new(args: &Args) -> Result<How, String> {
        let section_log = match &args.section_log {
            Some(path) => Some(Arc::new(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(path)
                    .map_err(|e| format!("{path}: {e}"))?,
            )),
            None => None,
        };
        Ok(How {
            await_release: args.await_release,
            hold: args.hold,
            no_lock: args.no_lock,
            section_log,
        })
    }

    async fn release(&self, guard: LockGuard) {
        if self.await_release {
            guard.release().await.expect("release");
        } else {
            drop(guard);
        }
    }

    /// The critical section, entered by a holder of `token`: counts the
    /// holders inside `inside` (an overlap when it was not alone), logs
    /// entering and leaving, and holds for `hold` (or yields once) in between.
    async fn section(&self, inside: &AtomicUsize, overlaps: &AtomicU64, token: u64) {
        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
            overlaps.fetch_add(1, Ordering::SeqCst);
        }
        self.log('E', token);
        if self.hold.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(self.hold).await;
        }
        self.log('L', token);
        inside.fetch_sub(1, Ordering::SeqCst);
    }

    fn log(&self, what: char, token: u64) {
        if let Some(mut file) = self.section_log.as_deref() {
            // One write per line: appends of one write do not interleave.
            std::io::Write::write_all(&mut file, format!("{what} {token}\n").as_bytes())
                .expect("section log");
        }
    }
}

/// `contended --processes P`: P copies of this program run W workers each
/// on the same key; this one adds up their tallies and checks their
/// critical sections for overlap through the shared section log.
async fn contended_processes(args: &Args) -> Result<String, String> {
    let log = std::env::temp_dir().join(format!("tower-lock-bench-{}.log", std::process::id()));
    std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let (secs, workers) = (args.secs.to_string(), args.workers.to_string());
    let release = if args.await_release { "await" } else { "drop" };
    let hold = args.hold.as_micros().to_string();
    let mut children = Vec::new();
    for _ in 0..args.processes {
        let child = tokio::process::Command::new(&exe)
            .args(["--backend", &args.backend, "--workload", "contended"])
            .args(["--secs", &secs, "--workers", &workers, "--release", release])
            .args(["--hold-us", &hold])
            .args(args.no_lock.then_some("--no-lock"))
            .arg("--section-log")
            .arg(&log)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| e.to_string())?;
        children.push(child);
    }
    let mut cycles = 0;
    let mut elapsed = Duration::ZERO;
    let mut overlaps = 0;
    let mut per_worker_min = u64::MAX;
    let mut per_worker_max = 0;
    let mut waits = Vec::new();
    // Each process's cycles: cohorting must not starve one of them.
    let mut per_process = Vec::new();
    for child in children {
        let out = child.wait_with_output().await.map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("child "))
            .filter(|_| out.status.success())
            .ok_or_else(|| format!("a worker process failed ({})", out.status))?;
        let field = |name: &str| {
            line.split(' ')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .unwrap_or("")
        };
        let num = |name: &str| field(name).parse::<u64>().unwrap_or(0);
        cycles += num("cycles");
        per_process.push(num("cycles").to_string());
        elapsed = elapsed.max(Duration::from_nanos(num("elapsed_ns")));
        overlaps += num("overlaps");
        per_worker_min = per_worker_min.min(num("per_worker_min"));
        per_worker_max = per_worker_max.max(num("per_worker_max"));
        waits.extend(
            field("waits_ns")
                .split(',')
                .filter_map(|w| w.parse().ok())
                .map(Duration::from_nanos),
        );
    }
    let sections = std::fs::read_to_string(&log).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&log);
    let (mut depth, mut last_token, mut regressions) = (0u32, 0u64, 0u64);
    for line in sections.lines() {
        let (what, token) = line.split_once(' ').unwrap_or((line, "0"));
        let token: u64 = token.parse().unwrap_or(0);
        if what == "E" {
            depth += 1;
            if depth > 1 {
                overlaps += 1;
            }
            if token <= last_token {
                regressions += 1;
            }
            last_token = token;
        } else {
            depth = depth.saturating_sub(1);
        }
    }
    // Redlock's tokens rise only while its servers' clocks agree (see its
    // docs); every other backend's must rise strictly.
    if regressions > 0 && !args.no_lock {
        let msg = format!("{regressions} fencing tokens were lower than the one granted before");
        if args.backend.starts_with("redlock://") {
            eprintln!("bench: {msg} (Redlock does not promise rising tokens)");
        } else {
            return Err(msg);
        }
    }
    waits.sort_unstable();
    let run = Run {
        cycles,
        elapsed,
        waits,
        per_worker_min,
        per_worker_max,
        overlaps,
    };
    Ok(format!(
        "processes={} {} per_process={}",
        args.processes,
        contended_line(args.workers, args.secs, &run),
        per_process.join(",")
    ))
}

/// What `contended` and `keys` workers report.
struct Tally {
    cycles: u64,
    waits: Vec<Duration>,
}

/// The totals of a run of workers over some keys.
struct Run {
    cycles: u64,
    /// The time the counted cycles took.
    elapsed: Duration,
    waits: Vec<Duration>,
    per_worker_min: u64,
    per_worker_max: u64,
    overlaps: u64,
}

/// Cycles that start within this long of the workers' start are not counted,
/// in this program and in every peer's: connections, caches and the JIT warm
/// up first.
const WARM_UP: Duration = Duration::from_millis(500);

/// `workers` tasks loop for `secs` seconds after [`WARM_UP`]: pick one of
/// `keys` (a fixed pseudo-random sequence per worker), acquire, run the
/// critical section, release. Under `--no-lock` each worker locks a key of
/// its own instead (same round trips, no exclusion between workers) while
/// the section still counts holders of the key it picked.
async fn run_workers(
    backend: &Arc<dyn Backend>,
    workers: usize,
    keys: Vec<String>,
    secs: u64,
    how: &How,
) -> Run {
    let keys = Arc::new(keys);
    let inside: Arc<Vec<AtomicUsize>> =
        Arc::new(keys.iter().map(|_| AtomicUsize::new(0)).collect());
    let overlaps = Arc::new(AtomicU64::new(0));
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (backend, keys, inside, overlaps, counting, stop, how) = (
            backend.clone(),
            keys.clone(),
            inside.clone(),
            overlaps.clone(),
            counting.clone(),
            stop.clone(),
            how.clone(),
        );
        let own_key = format!("bench:no-lock:{}:{w}", std::process::id());
        tasks.push(tokio::spawn(async move {
            // xorshift64*: a fixed, per-worker sequence of keys.
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
            let mut tally = Tally {
                cycles: 0,
                waits: Vec::with_capacity(1 << 16),
            };
            while !stop.load(Ordering::Relaxed) {
                let counted = counting.load(Ordering::Relaxed);
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                let k = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) % keys.len() as u64) as usize;
                let key = if how.no_lock { &own_key } else { &keys[k] };
                let t = Instant::now();
                let g = backend
                    .lock(key.as_str())
                    .wait(Wait::Forever)
                    .await
                    .expect("lock");
                let waited = t.elapsed();
                how.section(&inside[k], &overlaps, g.token().get()).await;
                how.release(g).await;
                if counted {
                    tally.waits.push(waited);
                    tally.cycles += 1;
                }
            }
            tally
        }));
    }
    tokio::time::sleep(WARM_UP).await;
    counting.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut tallies = Vec::new();
    for t in tasks {
        tallies.push(t.await.expect("worker"));
    }
    // Cycles begun before the stop are counted, so is the time they took.
    let elapsed = started.elapsed();
    let total: u64 = tallies.iter().map(|t| t.cycles).sum();
    let per_worker_min = tallies.iter().map(|t| t.cycles).min().unwrap_or(0);
    let per_worker_max = tallies.iter().map(|t| t.cycles).max().unwrap_or(0);
    let mut waits: Vec<Duration> = tallies.into_iter().flat_map(|t| t.waits).collect();
    waits.sort_unstable();
    Run {
        cycles: total,
        elapsed,
        waits,
        per_worker_min,
        per_worker_max,
        overlaps: overlaps.load(Ordering::SeqCst),
    }
}

async fn contended(backend: &Arc<dyn Backend>, workers: usize, secs: u64, how: &How) -> String {
    let r = run_workers(backend, workers, vec!["bench:contended".into()], secs, how).await;
    contended_line(workers, secs, &r)
}

/// The `contended` fields after `workload=contended`.
fn contended_line(workers: usize, secs: u64, r: &Run) -> String {
    format!(
        "workers={workers} secs={secs} cycles_per_s={:.0} wait_p50_us={} wait_p99_us={} per_worker_min={} per_worker_max={} overlaps={}",
        r.cycles as f64 / r.elapsed.as_secs_f64(),
        us(percentile(&r.waits, 0.50)),
        us(percentile(&r.waits, 0.99)),
        r.per_worker_min,
        r.per_worker_max,
        r.overlaps,
    )
}

async fn keys(
    backend: &Arc<dyn Backend>,
    workers: usize,
    nkeys: usize,
    secs: u64,
    how: &How,
) -> String {
    let names = (0..nkeys).map(|k| format!("bench:key:{k}")).collect();
    let r = run_workers(backend, workers, names, secs, how).await;
    format!(
        "workers={workers} keys={nkeys} secs={secs} cycles_per_s={:.0} wait_p50_us={} wait_p99_us={} overlaps={}",
        r.cycles as f64 / r.elapsed.as_secs_f64(),
        us(percentile(&r.waits, 0.50)),
        us(percentile(&r.waits, 0.99)),
        r.overlaps,
    )
}

async fn order(Path(sku): Path<String>) -> String {
    sku
}

async fn serve(app: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Connections to one server, kept for the whole run.
struct Clients {
    clients: Vec<common::Client>,
    /// Distinguishes the SKUs of every request this set sends.
    sent: u64,
}

impl Clients {
    async fn connect(addr: std::net::SocketAddr, conns: usize) -> Clients {
        let mut clients = Vec::with_capacity(conns);
        for _ in 0..conns {
            clients.push(common::Client::connect(addr).await.expect("connect"));
        }
        Clients { clients, sent: 0 }
    }

    /// Every connection sends requests back to back for `dur`, each on a SKU
    /// no other request uses; returns how many completed and the time they
    /// took (from the start until the last request in flight at `dur` is
    /// answered).
    async fn drive(&mut self, dur: Duration) -> (u64, Duration) {
        let stop = Arc::new(AtomicBool::new(false));
        let base = self.sent;
        let started = Instant::now();
        let tasks: Vec<_> = self
            .clients
            .drain(..)
            .enumerate()
            .map(|(c, mut client)| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut done = 0u64;
                    let mut path = String::with_capacity(48);
                    while !stop.load(Ordering::Relaxed) {
                        use std::fmt::Write;
                        path.clear();
                        write!(path, "/orders/sku-{base}-{c}-{done}").unwrap();
                        let reply = client.post(&path).await.expect("request");
                        assert!(reply.status.is_success(), "{} {}", reply.status, reply.body);
                        done += 1;
                    }
                    (client, done)
                })
            })
            .collect();
        tokio::time::sleep(dur).await;
        stop.store(true, Ordering::Relaxed);
        let mut total = 0;
        for t in tasks {
            let (client, done) = t.await.expect("client");
            self.clients.push(client);
            total += done;
        }
        self.sent += total;
        (total, started.elapsed())
    }
}

/// The handler a user would write instead of the library: a shared map of
/// per-key `tokio::sync::Mutex`es, the entry removed when its last user
/// leaves so that the map does not grow with every key ever seen.
type MutexMap = Arc<DashMap<String, Arc<tokio::sync::Mutex<()>>>>;

/// One user's share of a key's mutex in a [`MutexMap`]. Every clone and
/// every drop of the `Arc` in the map happens under the map's shard lock,
/// so the strong count seen there is exact: the user that leaves last
/// (count back to 1, the map's own) removes the entry. A request cancelled
/// while it waits leaves through the same `Drop`.
struct MapEntry<'a> {
    map: &'a DashMap<String, Arc<tokio::sync::Mutex<()>>>,
    key: String,
    mutex: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl<'a> MapEntry<'a> {
    fn enter(map: &'a DashMap<String, Arc<tokio::sync::Mutex<()>>>, key: &str) -> Self {
        let mutex = map.entry(key.to_owned()).or_default().value().clone();
        MapEntry {
            map,
            key: key.to_owned(),
            mutex: Some(mutex),
        }
    }

    fn mutex(&self) -> &tokio::sync::Mutex<()> {
        self.mutex.as_deref().expect("entered")
    }
}

impl Drop for MapEntry<'_> {
    fn drop(&mut self) {
        let ours = self.mutex.take();
        if let dashmap::Entry::Occupied(e) = self.map.entry(std::mem::take(&mut self.key)) {
            // Under the shard lock: no one can clone the entry meanwhile.
            drop(ours);
            if Arc::strong_count(e.get()) == 1 {
                e.remove();
            }
        }
    }
}

/// `POST /orders/{sku}` under the hand-written lock: the same handler as the
/// bare route, called while the SKU's mutex is held.
async fn order_mutex_map(State(map): State<MutexMap>, Path(sku): Path<String>) -> String {
    let entry = MapEntry::enter(&map, &sku);
    let _held = entry.mutex().lock().await;
    order(Path(sku)).await
    // `_held` unlocks, then `entry` leaves the map (reverse declaration order).
}

/// Requests per second of the `http` routes.
struct Rates {
    bare: f64,
    /// Under `LockLayer` (bare under `--calibrate`).
    locked: f64,
    /// Under the hand-written mutex map (bare under `--calibrate`), on the
    /// memory backend.
    peer: Option<f64>,
}

/// The `impl=` of the `http` workload's hand-written peer.
const HAND_MUTEX_MAP: &str = "hand-mutex-map";

/// Servers in this process, one per route, each with its own `conns`
/// connections from the same client code: the bare route, the route under
/// `LockLayer` and, on the memory backend, the route under the hand-written
/// mutex map (`impl=hand-mutex-map`). Under `--calibrate` every route is the
/// bare one, which shows how far apart identical routes measure. The phases
/// alternate in order and in reverse (A-B-B-A with two routes, A-B-C-C-B-A
/// with three), so that drift falls on every route alike; a rate is the
/// requests a route answered over the time its phases actually took.
async fn http(backend: Arc<dyn Backend>, conns: usize, secs: u64, calibrate: bool) -> Rates {
    let route = || Router::new().route("/orders/{sku}", post(order));
    // The hand-written map is a peer of the memory backend only: it locks
    // within one process.
    let with_peer = backend.name() == "memory";
    let mut addrs = vec![serve(route()).await];
    addrs.push(if calibrate {
        serve(route()).await
    } else {
        serve(route().route_layer(LockLayer::with_locker(
            Locker::from_arc(backend),
            PathParam("sku"),
        )))
        .await
    });
    let map: MutexMap = Arc::default();
    if with_peer {
        addrs.push(if calibrate {
            serve(route()).await
        } else {
            serve(
                Router::new()
                    .route("/orders/{sku}", post(order_mutex_map))
                    .with_state(map.clone()),
            )
            .await
        });
    }
    let mut routes = Vec::new();
    for addr in addrs {
        routes.push(Clients::connect(addr, conns).await);
    }
    // Warm up, then alternate short phases.
    for clients in &mut routes {
        clients.drive(Duration::from_millis(250)).await;
    }
    let phases = (secs * 10).max(2) as u32;
    let phase = Duration::from_secs(secs) / phases;
    // Requests answered and the time they took, per route.
    let mut sums = vec![(0u64, Duration::ZERO); routes.len()];
    for i in 0..phases {
        let mut turns: Vec<usize> = (0..routes.len()).collect();
        if i % 2 == 1 {
            turns.reverse();
        }
        for r in turns {
            let (n, t) = routes[r].drive(phase).await;
            sums[r].0 += n;
            sums[r].1 += t;
        }
    }
    // Every request has been answered: a map that forgets idle keys is
    // empty again, although every request used a SKU of its own.
    assert!(map.is_empty(), "the mutex map kept {} idle keys", map.len());
    let rps: Vec<f64> = sums
        .iter()
        .map(|(n, t)| *n as f64 / t.as_secs_f64())
        .collect();
    Rates {
        bare: rps[0],
        locked: rps[1],
        peer: rps.get(2).copied(),
    }
}
