//! Admission control: how many requests of this process may wait for one
//! key ([`Locker::max_waiters`](crate::Locker::max_waiters)), and refusing
//! at once a request the queue ahead of it would outlast
//! ([`Locker::predict_waits`](crate::Locker::predict_waits)).
//!
//! Counted here, in the process, rather than asked of the server: it works
//! the same on every backend, cohort or not, and costs no round trip. A
//! server that shows its queue (ZooKeeper's children, etcd's keys under the
//! prefix, PostgreSQL's `pg_locks`) would add the other replicas' waiters,
//! at a round trip per request and only on those stores; the estimate below
//! already sees them, as time between this process's grants.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::LockError;
use crate::key::LockKey;
use crate::loom::sync::Mutex;
use crate::mode::{LockMode, Wait};
use crate::sync::lock;

/// Samples an estimate needs before it refuses anyone.
pub(crate) const MIN_SAMPLES: u32 = 8;
/// Slots of the table that keeps the estimates of keys nobody waits for
/// now: its size bounds the memory, whatever the number of keys.
const RECENT_SLOTS: usize = 1024;

/// One layer's or locker's admission policy and the queues it counts.
pub(crate) struct Admission {
    /// At most this many requests wait for one key; `None`: no cap.
    max_waiters: Option<u32>,
    /// Whether to refuse requests whose predicted wait exceeds theirs.
    predict: bool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Keys some request of this process waits for; an entry leaves when
    /// its last waiter does, so the map is as large as the queues.
    queues: HashMap<LockKey, Queue, foldhash::fast::RandomState>,
    /// Estimates of keys that had waiters, by hash; a key whose slot was
    /// taken by another starts again from no samples.
    recent: Vec<Recent>,
}

#[derive(Clone, Copy, Default)]
struct Estimate {
    /// Time between two grants of the key in this process while a request
    /// waited through the whole of it: one holder's turn, hand-off
    /// included. An exponentially weighted mean, weight 1/8 to a sample.
    turn: Duration,
    samples: u32,
    /// The last grant in this process.
    last_grant: Option<Instant>,
}

struct Queue {
    waiting: u32,
    estimate: Estimate,
}

#[derive(Clone, Copy, Default)]
struct Recent {
    hash: u64,
    estimate: Estimate,
}

impl Admission {
    /// `None` when neither a cap nor prediction is asked for: no cost then.
    pub(crate) fn new(max_waiters: Option<u32>, predict: bool) -> Option<Arc<Self>> {
        if max_waiters.is_none() && !predict {
            return None;
        }
        let recent = if predict {
            vec![Recent::default(); RECENT_SLOTS]
        } else {
            Vec::new()
        };
        Some(Arc::new(Admission {
            max_waiters,
            predict,
            state: Mutex::new(State {
                queues: HashMap::default(),
                recent,
            }),
        }))
    }

    pub(crate) fn max_waiters(&self) -> Option<u32> {
        self.max_waiters
    }

    pub(crate) fn predicts(&self) -> bool {
        self.predict
    }

    /// The wait a request gets: none at all under `max_waiters(0)`.
    pub(crate) fn wait(&self, wait: Wait) -> Wait {
        match self.max_waiters {
            Some(0) => Wait::FailFast,
            _ => wait,
        }
    }

    /// Counts a request for `key` that will wait up to `wait` as waiting,
    /// or refuses it: the cap is reached, or the turns of those ahead are
    /// expected to outlast its wait.
    pub(crate) fn admit(
        self: &Arc<Self>,
        backend: &'static str,
        key: &LockKey,
        mode: LockMode,
        wait: Wait,
    ) -> Result<Ticket, LockError> {
        let mut state = lock(&self.state);
        let State { queues, recent } = &mut *state;
        let queue = match queues.get_mut(key) {
            Some(queue) => queue,
            None => {
                let estimate = slot(recent, key).unwrap_or_default();
                queues.entry(key.clone()).or_insert(Queue {
                    waiting: 0,
                    estimate,
                })
            }
        };
        let ahead = queue.waiting;
        let e = queue.estimate;
        let expected_wait = (self.predict && e.samples >= MIN_SAMPLES)
            .then(|| e.turn.saturating_mul(ahead.saturating_add(1)));
        let over_cap = self.max_waiters.is_some_and(|max| ahead >= max);
        // Never the first in line: the key may be free, and only a request
        // that waits can measure it again (an estimate grown stale in a
        // slowdown must not shut the key for good).
        let too_long = match (expected_wait, wait) {
            (Some(expected), Wait::Timeout(wait)) => ahead > 0 && expected > wait,
            _ => false,
        };
        if over_cap || too_long {
            let reason = if over_cap {
                "max_waiters"
            } else {
                "predicted_wait"
            };
            crate::metrics::refused(backend, reason);
            if ahead == 0 {
                // Just made for this request (a prediction from `recent`).
                queues.remove(key);
            }
            return Err(LockError::Refused {
                waiting: ahead,
                expected_wait,
            });
        }
        queue.waiting += 1;
        Ok(Ticket {
            admission: self.clone(),
            key: key.clone(),
            since: Instant::now(),
            granted: false,
            // Shared modes grant several at once: their turns say little.
            measures: self.predict && matches!(mode, LockMode::Exclusive | LockMode::Write),
        })
    }

    fn leave(&self, ticket: &Ticket) {
        let (key, since, granted) = (&ticket.key, ticket.since, ticket.granted);
        let mut state = lock(&self.state);
        let State { queues, recent } = &mut *state;
        let Some(queue) = queues.get_mut(key) else {
            return;
        };
        if granted {
            let now = Instant::now();
            let e = &mut queue.estimate;
            // Waited through the whole turn before this grant: a sample.
            let last = e
                .last_grant
                .filter(|&last| ticket.measures && since <= last);
            if let Some(last) = last {
                let turn = now.saturating_duration_since(last);
                e.turn = if e.samples == 0 {
                    turn
                } else {
                    e.turn - e.turn / 8 + turn / 8
                };
                e.samples = e.samples.saturating_add(1);
            }
            e.last_grant = Some(now);
        }
        queue.waiting -= 1;
        if queue.waiting == 0 {
            let queue = queues.remove(key).expect("found above");
            if self.predict {
                let hash = hash(key);
                if let Some(r) = recent.get_mut(hash as usize % RECENT_SLOTS) {
                    *r = Recent {
                        hash,
                        estimate: queue.estimate,
                    };
                }
            }
        }
    }
}

/// The estimate kept for `key` in `recent`, if its slot is still its own.
fn slot(recent: &[Recent], key: &LockKey) -> Option<Estimate> {
    let hash = hash(key);
    let r = recent.get(hash as usize % RECENT_SLOTS)?;
    (r.hash == hash).then_some(r.estimate)
}

fn hash(key: &LockKey) -> u64 {
    // Fixed seed: slots must agree across calls.
    foldhash::fast::FixedState::with_seed(0x0074_6c6b).hash_one(key)
}

/// A request counted as waiting for its key until this is dropped;
/// [`granted`](Self::granted) first makes its wait a sample.
pub(crate) struct Ticket {
    admission: Arc<Admission>,
    key: LockKey,
    since: Instant,
    granted: bool,
    /// Whether its grant may be a sample of the key's turn.
    measures: bool,
}

impl Ticket {
    /// The request got the key: no longer waiting, and a sample of the
    /// key's turn.
    pub(crate) fn granted(mut self) {
        self.granted = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission.leave(self);
    }
}
