//! rslock (LockManager over one instance) measured like tower-lock's bench
//! program: same workloads, same output format. Defaults as rslock ships them.

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

const TTL: Duration = Duration::from_secs(30);

fn main() {
    let url = arg("--backend", "redis://127.0.0.1:6379");
    let workload = arg("--workload", "uncontended");
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
                let inside = Arc::new(AtomicUsize::new(0));
                let overlaps = Arc::new(AtomicU64::new(0));
                let mut tasks = Vec::new();
                for _ in 0..workers {
                    let (lm, stop, inside, overlaps) =
                        (lm.clone(), stop.clone(), inside.clone(), overlaps.clone());
                    tasks.push(tokio::spawn(async move {
                        let (mut cycles, mut waits) = (0u64, Vec::new());
                        while !stop.load(Ordering::Relaxed) {
                            let t = Instant::now();
                            let l = lm.acquire_no_guard("bench:rslock:c", TTL).await.unwrap();
                            waits.push(t.elapsed());
                            if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            inside.fetch_sub(1, Ordering::SeqCst);
                            lm.unlock(&l).await;
                            cycles += 1;
                        }
                        (cycles, waits)
                    }));
                }
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
    println!("impl=rslock backend={backend} workload={workload} {line}");
}
