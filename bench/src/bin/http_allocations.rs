//! The heap allocations a request costs on each route of the `http`
//! workload ([`tower_lock_bench::routes`]), counted by a global allocator:
//! a count that does not drift with the machine. Each route serves `N`
//! requests to warm up (maps and buffers reach their size), then `N` more,
//! counted; prints one line per route with its allocations per request and
//! over the bare route's. `scripts/count-instructions.sh` runs it after the
//! instruction counts, in a process of its own (the counting would inflate
//! them).
//!
//! ```text
//! cargo run --release -p tower-lock-bench --bin http_allocations [N]
//! ```

use std::process::ExitCode;

use tower_lock_bench::counting::{allocations, Counting};
use tower_lock_bench::routes::{app, serve, ROUTES};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn main() -> ExitCode {
    let n = match std::env::args().nth(1).map(|n| n.parse::<u64>()) {
        None => 10_000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: http_allocations [requests, at least 1]");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let mut bare = None;
    for route in ROUTES {
        let mut app = app(route).expect("a known route");
        let per = runtime.block_on(async {
            serve(&mut app, 0, n).await;
            let before = allocations();
            serve(&mut app, n, n).await;
            (allocations() - before) as f64 / n as f64
        });
        let bare = *bare.get_or_insert(per);
        println!(
            "route={route} requests={n} allocations_per_request={per:.2} over_bare={:.2}",
            per - bare
        );
    }
    ExitCode::SUCCESS
}
