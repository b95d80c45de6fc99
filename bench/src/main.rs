//! The benchmark program: command line, workloads and output format are
//! described in `bench/README.md`.
//!
//! ```text
//! cargo run --release -p tower-lock-bench --bin bench -- --backend memory --workload uncontended --n 5000
//! cargo run --release -p tower-lock-bench --bin bench -- --backend memory --workload contended --secs 5 --workers 8
//! cargo run --release -p tower-lock-bench --bin bench -- --backend memory --workload contended --secs 5 --no-lock
//! cargo run --release -p tower-lock-bench --bin bench -- --backend memory --workload keys --secs 5 --workers 8 --keys 100
//! cargo run --release -p tower-lock-bench --bin bench -- --backend memory --workload http --secs 5 --conns 32
//! cargo run --release -p tower-lock-bench --bin bench -- --backend memory --workload http --secs 5 --conns 32 --calibrate
//! cargo run --release -p tower-lock-bench --bin bench -- --backend zk://127.0.0.1:2181 --workload floor --n 2000
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
//! `http` mounts the layer on the route's handler, `post(order.layer(lock))`;
//! `--mount route` mounts it with `Router::route_layer` instead, and the
//! run's lines (the peer's too) carry `mount=route`.
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

mod contended;
mod cycles;
mod flash_sale;
mod floors;
mod http;
mod raw_locks;
mod ring;

use contended::{contended, contended_processes, keys, run_workers};
use flash_sale::flash_sale;
use floors::floor;
use http::{http, Mount, HAND_MUTEX_MAP, LAYER_FLOOR};

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
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
    /// `flash-sale`: the layer's wait.
    wait: Duration,
    /// `flash-sale`: the cap of its admission-controlled lines.
    max_waiters: u32,
    /// Negative control: each worker locks a key of its own, so the lock
    /// excludes nobody and the overlap check must see overlaps.
    no_lock: bool,
    /// `cycles` through the backend's raw floor.
    raw: bool,
    /// `http`: serve both routes bare, to calibrate the comparison.
    calibrate: bool,
    /// `http`: where `LockLayer` is mounted, if `--mount` says.
    mount: Option<Mount>,
    /// `contended --processes`: pass a token round the processes through
    /// Redis lists instead of locking (the floor of a fair hand-off).
    ring: bool,
    /// Internal: run as one of `--processes`, logging critical sections to
    /// this file.
    section_log: Option<String>,
    /// Internal: this process's place in the `--ring`.
    ring_place: Option<ring::Place>,
}

const USAGE: &str = "usage: bench --backend <memory|redis://..|redlock://..|zk://..> \
--workload <uncontended|contended|keys|http|flash-sale|floor|cycles> [--n N] [--secs S] [--workers W] \
[--keys K] [--conns C] [--processes P] [--release drop|await] [--hold-us H] [--no-lock] [--raw] \
[--calibrate] [--mount handler|route] [--wait-ms W] [--max-waiters M] [--ring]";

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
        wait: Duration::from_secs(2),
        max_waiters: 32,
        no_lock: false,
        raw: false,
        calibrate: false,
        mount: None,
        ring: false,
        section_log: None,
        ring_place: None,
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
            "--ring-place" => a.ring_place = Some(ring::Place::parse(&value()?)?),
            "--ring" => a.ring = true,
            "--hold-us" => a.hold = Duration::from_micros(num(&flag, value()?)?),
            "--wait-ms" => a.wait = Duration::from_millis(num(&flag, value()?)?),
            "--max-waiters" => a.max_waiters = num(&flag, value()?)?,
            "--no-lock" => a.no_lock = true,
            "--raw" => a.raw = true,
            "--calibrate" => a.calibrate = true,
            "--mount" => {
                a.mount = match value()?.as_str() {
                    "handler" => Some(Mount::Handler),
                    "route" => Some(Mount::Route),
                    other => return Err(format!("--mount: {other:?} is not handler or route")),
                }
            }
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
    if a.raw && a.workload != "cycles" {
        return Err("--raw applies to the cycles workload".into());
    }
    if a.ring
        && (a.workload != "contended"
            || a.processes < 2
            || a.workers != 1
            || a.no_lock
            || !a.backend.starts_with("redis://"))
    {
        return Err(
            "--ring applies to the contended workload on a redis:// backend, with --processes and \
             --workers 1, without --no-lock"
                .into(),
        );
    }
    if a.calibrate && a.workload != "http" {
        return Err("--calibrate applies to the http workload".into());
    }
    if a.mount.is_some() && (a.workload != "http" || a.calibrate) {
        return Err("--mount applies to the http workload, without --calibrate".into());
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
    let mut builder = if matches!(args.workload.as_str(), "uncontended" | "floor" | "cycles") {
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
    // Unnamed (`query_typed`): through a pooler in transaction mode a
    // prepared statement may not be on the session that runs it, the
    // query would fail, and the run would take the pooler for the server
    // (and prepare its floor's statements: "prepared statement does not
    // exist").
    let server_port: Option<i32> = match client
        .query_typed("SELECT current_setting('port')::int", &[])
        .await
    {
        Ok(rows) => rows.first().and_then(|row| row.get(0)),
        Err(e) => {
            eprintln!("bench: cannot tell whether {plain:?} leads to a pooler: {e}");
            std::process::exit(2);
        }
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
    if args.workload == "cycles" {
        return cycles::cycles(&args.backend, args.n, args.raw).await;
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
        let r = match args.ring_place {
            Some(place) => match ring::run(&args.backend, place, args.secs, &how).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("bench: {e}");
                    return ExitCode::FAILURE;
                }
            },
            None => {
                let keys = vec!["bench:contended".into()];
                run_workers(&backend, args.workers, keys, args.secs, &how).await
            }
        };
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
    if args.workload == "flash-sale" {
        let servers = servers_setting(&args.backend);
        let (conns, secs, hold) = (args.conns, args.secs, args.hold);
        for line in flash_sale(
            backend.clone(),
            conns,
            secs,
            hold,
            args.wait,
            args.max_waiters,
        )
        .await
        {
            println!("impl=tower-lock backend={name} workload=flash-sale{servers} {line}");
        }
        backend.flush().await;
        return ExitCode::SUCCESS;
    }
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
            let raw = match raw_locks::RawLock::open(&args.backend).await {
                Ok(raw) => raw.map(Arc::new),
                Err(e) => {
                    eprintln!("bench: the raw floor: {e}");
                    return ExitCode::from(2);
                }
            };
            let rates = http(
                backend.clone(),
                args.conns,
                args.secs,
                args.calibrate,
                args.mount.unwrap_or(Mount::Handler),
                raw,
            )
            .await;
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
                // its `rps_locked` is the rate of its route. It belongs to
                // the run, so it carries the run's mount too.
                Some(peer) => {
                    let mount = args.mount.map_or("", Mount::tag);
                    let mut lines = format!(
                        "impl={HAND_MUTEX_MAP} backend={name} workload=http{mount} {}",
                        line(peer)
                    );
                    if let Some(floor) = rates.floor {
                        lines.push_str(&format!(
                            "\nimpl={LAYER_FLOOR} backend={name} workload=http{mount} {}",
                            line(floor)
                        ));
                    }
                    peer_line = Some(lines);
                    line(rates.locked)
                }
                // A remote backend's floor goes on the library's line.
                None => match rates.raw {
                    Some(raw) => format!(
                        "{} rps_floor={raw:.0} ratio_floor={:.3}",
                        line(rates.locked),
                        rates.locked / raw
                    ),
                    None => line(rates.locked),
                },
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
    } else if args.ring {
        "ring-floor"
    } else if args.calibrate {
        "bare-vs-bare"
    } else {
        "tower-lock"
    };
    // A line measured with `--release await` or `--mount route` says so;
    // `drop` and `handler` are the defaults.
    let setting = if args.await_release && args.workload != "http" {
        " release=await"
    } else {
        args.mount.map_or("", Mount::tag)
    };
    let servers = servers_setting(&args.backend);
    println!(
        "impl={implementation} backend={name} workload={}{setting}{servers} {line}",
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
