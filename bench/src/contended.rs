//! `contended` and `keys`: workers on one key or many, in one process or
//! several, counting overlaps.

use super::*;
use crate::ring::Place;

/// `contended --processes P`: P copies of this program run W workers each
/// on the same key; this one adds up their tallies and checks their
/// critical sections for overlap through the shared section log.
pub(super) async fn contended_processes(args: &Args) -> Result<String, String> {
    let log = std::env::temp_dir().join(format!("tower-lock-bench-{}.log", std::process::id()));
    std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let (secs, workers) = (args.secs.to_string(), args.workers.to_string());
    let release = if args.await_release { "await" } else { "drop" };
    let hold = args.hold.as_micros().to_string();
    let mut children = Vec::new();
    for index in 0..args.processes {
        let ring = args.ring.then(|| {
            [
                "--ring-place".into(),
                Place::new(index, args.processes).arg(),
            ]
        });
        let child = tokio::process::Command::new(&exe)
            .args(["--backend", &args.backend, "--workload", "contended"])
            .args(["--secs", &secs, "--workers", &workers, "--release", release])
            .args(["--hold-us", &hold])
            .args(args.no_lock.then_some("--no-lock"))
            .args(ring.into_iter().flatten())
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
pub(super) struct Run {
    pub(super) cycles: u64,
    /// The time the counted cycles took.
    pub(super) elapsed: Duration,
    pub(super) waits: Vec<Duration>,
    pub(super) per_worker_min: u64,
    pub(super) per_worker_max: u64,
    pub(super) overlaps: u64,
}

/// Cycles that start within this long of the workers' start are not counted,
/// in this program and in every peer's: connections, caches and the JIT warm
/// up first.
pub(super) const WARM_UP: Duration = Duration::from_millis(500);

/// `workers` tasks loop for `secs` seconds after [`WARM_UP`]: pick one of
/// `keys` (a fixed pseudo-random sequence per worker), acquire, run the
/// critical section, release. Under `--no-lock` each worker locks a key of
/// its own instead (same round trips, no exclusion between workers) while
/// the section still counts holders of the key it picked.
pub(super) async fn run_workers(
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

pub(super) async fn contended(
    backend: &Arc<dyn Backend>,
    workers: usize,
    secs: u64,
    how: &How,
) -> String {
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

pub(super) async fn keys(
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
