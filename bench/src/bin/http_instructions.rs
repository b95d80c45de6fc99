//! The `http` workload's routes called through tower in one process, no
//! sockets: run under `valgrind --tool=callgrind`, the instructions a
//! request costs on each route, a count that does not drift with the
//! machine's load. `scripts/count-instructions.sh` runs every route twice
//! and prints the difference per request.
//!
//! ```text
//! cargo build --release -p tower-lock-bench --bin http_instructions
//! valgrind --tool=callgrind target/release/http_instructions layer-handler 10000
//! ```
//!
//! The routes are [`tower_lock_bench::routes`]'; `--routes` lists them,
//! one a line.

use std::process::ExitCode;

use tower_lock_bench::routes::{app, serve, ROUTES};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--routes") {
        println!("{}", ROUTES.join("\n"));
        return ExitCode::SUCCESS;
    }
    let (Some(mut app), Some(Ok(n))) = (
        args.first().and_then(|r| app(r)),
        args.get(1).map(|n| n.parse::<u64>()),
    ) else {
        eprintln!(
            "usage: http_instructions <{}> <requests> | --routes",
            ROUTES.join(" | ")
        );
        return ExitCode::from(2);
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    runtime.block_on(serve(&mut app, 0, n));
    ExitCode::SUCCESS
}
