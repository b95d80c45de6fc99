//! `cycles`: what one lock and its release cost the client, for
//! `scripts/count-instructions.sh` to count with callgrind (a count that
//! does not drift with the machine, where the `http` ratios move by
//! several points between runs). A thousand cycles to warm up, then `n`,
//! one key after another, each key new: through the library (a guard
//! dropped, as the layer does, with the default wait), or with `--raw`
//! through the backend's raw floor (`raw_locks`: the `http` workload's
//! `rps_floor` commands, its release sent in a task of its own, as
//! there). The script runs it with `n` and `2n` and divides the
//! difference by `n`: start-up and warm-up cancel out.

use std::process::ExitCode;
use std::sync::Arc;

use tower_lock::BackendExt;

use crate::raw_locks::{self, RawLock};

const WARM_UP: u64 = 1000;

pub(super) async fn cycles(url: &str, n: usize, raw: bool) -> ExitCode {
    let n = n as u64;
    let keys = || (0..WARM_UP + n).map(|i| format!("cycle-{i}"));
    if raw {
        let raw = match RawLock::open(url).await {
            Ok(Some(raw)) => Arc::new(raw),
            Ok(None) => return usage("the memory backend has no raw floor"),
            Err(e) => return usage(&e),
        };
        for key in keys() {
            match raw.acquire(&key).await {
                // Sent in a task of its own, as the `http` floor's release
                // (and the library's, from a dropped guard) is.
                Ok(held) => drop(tokio::spawn(raw.clone().released_later(held))),
                Err(e) => return usage(&format!("the raw floor: {e}")),
            }
        }
        raw_locks::released().await;
    } else {
        let backend = match tower_lock::backend::connect(url).await {
            Ok(backend) => backend,
            Err(e) => return usage(&e.to_string()),
        };
        for key in keys() {
            if let Err(e) = backend.lock(key.as_str()).await {
                return usage(&format!("locking {key}: {e}"));
            }
        }
        backend.flush().await;
    }
    let name = if raw { "raw-floor" } else { "tower-lock" };
    println!("impl={name} workload=cycles n={n}");
    ExitCode::SUCCESS
}

fn usage(e: &str) -> ExitCode {
    eprintln!("bench: {e}");
    ExitCode::from(2)
}
