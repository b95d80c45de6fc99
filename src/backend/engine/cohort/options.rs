//! [`CohortOptions`]: how far a cohort passes a lock between local waiters.

use std::time::Duration;

#[cfg(doc)]
use super::Cohort;
#[cfg(doc)]
use crate::backend::Capabilities;

/// How far a [`Cohort`] passes a lock between local waiters before it gives
/// the lock back to the server.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tower_lock::backend::CohortOptions;
///
/// // Fairer to other processes: at most 8 local holders or 10 ms per round.
/// let fairer = CohortOptions::default().max_grants(8).max_hold(Duration::from_millis(10));
/// assert_eq!(fairer.grants(), 8);
/// // Every acquisition asks the server, as a plain client does.
/// assert!(!CohortOptions::off().is_enabled());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CohortOptions {
    pub(super) enabled: bool,
    pub(super) max_grants: u32,
    pub(super) max_hold: Duration,
}

impl CohortOptions {
    /// Local holders one server grant may serve by default.
    pub const DEFAULT_MAX_GRANTS: u32 = 32;
    /// How long, from the server's grant, a lock may keep passing between
    /// local holders by default.
    pub const DEFAULT_MAX_HOLD: Duration = Duration::from_millis(50);

    /// No local queue and no passing on: each acquisition goes to the server.
    pub fn off() -> Self {
        CohortOptions {
            enabled: false,
            ..Self::default()
        }
    }

    /// At most `grants` local holders per server grant (at least 1; 1 means
    /// waiters still queue locally, but every holder asks the server). The
    /// backend may allow fewer: see [`Capabilities::max_tokens`].
    pub fn max_grants(mut self, grants: u32) -> Self {
        self.max_grants = grants.max(1);
        self
    }

    /// No new local holder once `hold` has passed since the server granted
    /// the lock: other processes get their turn at least this often.
    pub fn max_hold(mut self, hold: Duration) -> Self {
        self.max_hold = hold;
        self
    }

    /// Whether cohorting is on.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The grant bound.
    pub fn grants(&self) -> u32 {
        self.max_grants
    }
}

impl Default for CohortOptions {
    fn default() -> Self {
        CohortOptions {
            enabled: true,
            max_grants: Self::DEFAULT_MAX_GRANTS,
            max_hold: Self::DEFAULT_MAX_HOLD,
        }
    }
}
