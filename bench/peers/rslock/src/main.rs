//! rslock (LockManager over one instance, or its Redlock over several)
//! measured like tower-lock's bench program: same workloads, same output
//! format. Defaults as rslock ships them. Every release is `lm.unlock(&l)`
//! awaited: one round trip that waits for the server's answer.
//!
//! `contended` runs W tasks on a multi-threaded tokio runtime, each looping
//! acquire -> critical section -> release on one key. The critical section
//! counts the holders inside (an AtomicUsize, no lock around the check; an
//! overlap when someone else was inside), then yields once
//! (`--hold-us 0`, the default) or sleeps `--hold-us` µs, so that a second
//! holder could run while the first is inside. Cycles begun in the first
//! 500 ms are a warm-up and not counted; `cycles_per_s` is the counted cycles
//! over the time they took (end of warm-up until the last of them ended).
//! Overlaps are counted over the whole run. `--no-lock` is the negative
//! control: the same loop without acquiring or releasing; it must report
//! overlaps>0. `uncontended` times N acquire+release after 50 untimed ones.
//! `--section-log FILE`: one of several processes on the key, run by
//! `bench/peers/processes.py` (see `peer_harness.py` for the log's lines).

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rslock::LockManager;

fn us(d: Duration) -> String {
    let v = d.as_secs_f64() * 1e6;
    if v < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.0}")
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_owned())
}

fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// Appends `what pid unix_ns` to the section log, in one write.
fn log_section(file: Option<&std::fs::File>, what: char) {
    if let Some(mut file) = file {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let line = format!("{what} {} {}\n", std::process::id(), now.as_nanos());
        file.write_all(line.as_bytes()).expect("section log");
    }
}

const TTL: Duration = Duration::from_secs(30);

/// Cycles begun this long after the workers start are the first counted, as
/// in tower-lock's bench program.
const WARM_UP: Duration = Duration::from_millis(500);

fn main() -> ExitCode {
    let url = arg("--backend", "redis://127.0.0.1:6379");
    let workload = arg("--workload", "uncontended");
    let no_lock = flag("--no-lock");
    let hold = match arg("--hold-us", "0").parse::<u64>() {
        Ok(h) => Duration::from_micros(h),
        Err(e) => {
            eprintln!("rslock-peer-bench: --hold-us: {e}");
            return ExitCode::from(2);
        }
    };
    let section_log = std::env::args().any(|a| a == "--section-log").then(|| {
        let path = arg("--section-log", "");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map(Arc::new)
    });
    let section_log = match section_log.transpose() {
        Ok(log) => log,
        Err(e) => {
            eprintln!("rslock-peer-bench: --section-log: {e}");
            return ExitCode::from(2);
        }
    };
    if (no_lock || section_log.is_some()) && workload != "contended" {
        eprintln!("rslock-peer-bench: --no-lock and --section-log apply to the contended workload");
        return ExitCode::from(2);
    }
    let rt = if workload == "uncontended" {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    }
    .enable_all()
    .build()
    .unwrap();
    let line = rt.block_on(async {
        // redlock://h1:p1,h2:p2,... is rslock's own algorithm over several servers.
        let urls: Vec<String> = match url.strip_prefix("redlock://") {
            Some(list) => list.split(',').map(|a| format!("redis://{a}")).collect(),
            None => vec![url.clone()],
        };
        let lm = Arc::new(LockManager::new(urls));
        match workload.as_str() {
            "uncontended" => {
                let n: usize = arg("--n", "5000").parse().unwrap();
                for _ in 0..50 {
                    let l = lm.acquire_no_guard("bench:rslock:u", TTL).await.unwrap();
                    lm.unlock(&l).await;
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    let l = lm.acquire_no_guard("bench:rslock:u", TTL).await.unwrap();
                    lm.unlock(&l).await;
                    v.push(t.elapsed());
                }
                v.sort();
                format!("n={n} p50_us={} p99_us={}", us(pct(&v, 0.5)), us(pct(&v, 0.99)))
            }
            "contended" => {
                let workers: usize = arg("--workers", "8").parse().unwrap();
                let secs: u64 = arg("--secs", "5").parse().unwrap();
                let stop = Arc::new(AtomicBool::new(false));
                let counting = Arc::new(AtomicBool::new(false));
                let inside = Arc::new(AtomicUsize::new(0));
                let overlaps = Arc::new(AtomicU64::new(0));
                let mut tasks = Vec::new();
                for _ in 0..workers {
                    let log = section_log.clone();
                    let (lm, stop, counting, inside, overlaps) = (
                        lm.clone(),
                        stop.clone(),
                        counting.clone(),
                        inside.clone(),
                        overlaps.clone(),
                    );
                    tasks.push(tokio::spawn(async move {
                        let (mut cycles, mut waits) = (0u64, Vec::new());
                        while !stop.load(Ordering::Relaxed) {
                            let counted = counting.load(Ordering::Relaxed);
                            let t = Instant::now();
                            let l = if no_lock {
                                None
                            } else {
                                Some(lm.acquire_no_guard("bench:rslock:c", TTL).await.unwrap())
                            };
                            let waited = t.elapsed();
                            log_section(log.as_deref(), 'E');
                            // The critical section: no lock around the check.
                            if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            if hold.is_zero() {
                                tokio::task::yield_now().await;
                            } else {
                                tokio::time::sleep(hold).await;
                            }
                            inside.fetch_sub(1, Ordering::SeqCst);
                            log_section(log.as_deref(), 'L');
                            if let Some(l) = l {
                                lm.unlock(&l).await;
                            }
                            if counted {
                                waits.push(waited);
                                cycles += 1;
                            }
                        }
                        (cycles, waits)
                    }));
                }
                tokio::time::sleep(WARM_UP).await;
                counting.store(true, Ordering::Relaxed);
                let started = Instant::now();
                tokio::time::sleep(Duration::from_secs(secs)).await;
                stop.store(true, Ordering::Relaxed);
                let mut counts = Vec::new();
                let mut waits = Vec::new();
                for t in tasks {
                    let (c, w) = t.await.unwrap();
                    counts.push(c);
                    waits.extend(w);
                }
                // Cycles begun before the stop are counted, so is the time they took.
                let elapsed = started.elapsed().as_secs_f64();
                waits.sort();
                format!(
                    "workers={workers} secs={secs} cycles_per_s={:.0} wait_p50_us={} wait_p99_us={} per_worker_min={} per_worker_max={} overlaps={}",
                    counts.iter().sum::<u64>() as f64 / elapsed,
                    us(pct(&waits, 0.5)),
                    us(pct(&waits, 0.99)),
                    counts.iter().min().unwrap(),
                    counts.iter().max().unwrap(),
                    overlaps.load(Ordering::SeqCst),
                )
            }
            other => panic!("unknown workload {other}"),
        }
    });
    let backend = if url.starts_with("redlock://") {
        "redlock"
    } else {
        "redis"
    };
    let name = if no_lock { "no-lock-rslock" } else { "rslock" };
    println!("impl={name} backend={backend} workload={workload} {line}");
    ExitCode::SUCCESS
}
