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

/// An acquisition was refused before it waited, by admission control:
/// `reason` is `max_waiters`, `predicted_wait` or `deadline`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
#[inline]
pub(crate) fn refused(backend: &'static str, reason: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_lock_refused_total", "backend" => backend, "reason" => reason)
        .increment(1);
}

/// A lock of `backend` is now held (`+1.0`) or no longer (`-1.0`).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
#[inline]
pub(crate) fn held(backend: &'static str, delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tower_lock_held", "backend" => backend).increment(delta);
}

/// An acquisition of `backend` waiting: counted in `tower_lock_waiting`
/// from its making to its drop. Zero-sized without the feature.
pub(crate) struct Waiting {
    #[cfg(feature = "metrics")]
    backend: &'static str,
}

impl Waiting {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    #[inline]
    pub(crate) fn start(backend: &'static str) -> Self {
        #[cfg(feature = "metrics")]
        {
            metrics::gauge!("tower_lock_waiting", "backend" => backend).increment(1.0);
            Waiting { backend }
        }
        #[cfg(not(feature = "metrics"))]
        Waiting {}
    }
}

#[cfg(feature = "metrics")]
impl Drop for Waiting {
    fn drop(&mut self) {
        metrics::gauge!("tower_lock_waiting", "backend" => self.backend).decrement(1.0);
    }
}
