//! Metrics through the `metrics` facade (feature `metrics`); without the
//! feature every function here is empty. The names and labels are listed in
//! the crate docs' "Metrics" section (`src/lib.md`): keep the two in step.

use std::time::Duration;

/// An acquisition ended with `outcome` after waiting `waited`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
#[inline]
pub(crate) fn acquisition(backend: &'static str, outcome: &'static str, waited: Duration) {
    #[cfg(feature = "metrics")]
    {
        use metrics::{counter, histogram};
        let name = match outcome {
            "acquired" => "tower_lock_acquired_total",
            "busy" => "tower_lock_busy_total",
            "timeout" => "tower_lock_timeouts_total",
            "lost" => "tower_lock_lost_total",
            _ => "tower_lock_errors_total",
        };
        counter!(name, "backend" => backend).increment(1);
        histogram!("tower_lock_wait_seconds", "backend" => backend, "outcome" => outcome)
            .record(waited.as_secs_f64());
    }
}

/// A lock of `backend` was released (or dropped) after being held for
/// `hold`; `lost` says whether it had been lost (asked only with the
/// feature).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
#[inline]
pub(crate) fn released(backend: &'static str, lost: impl FnOnce() -> bool, hold: Option<Duration>) {
    #[cfg(feature = "metrics")]
    {
        use metrics::{counter, histogram};
        if let Some(hold) = hold {
            histogram!("tower_lock_hold_seconds", "backend" => backend).record(hold.as_secs_f64());
        }
        if lost() {
            counter!("tower_lock_lost_total", "backend" => backend).increment(1);
        }
    }
}
