//! Renewal put off until it is due: most locks are released long before a
//! third of their lease has passed (a request holds one for milliseconds,
//! a lease lasts seconds), and a task spawned for each would be spawned,
//! timed and aborted for nothing. One timer per backend watches the leases
//! not yet due and starts a lease's own renewal task (`lease::renew`) when
//! its first renewal comes due, or at once for all of them when the
//! backend asks (a lost connection).

// Serves the backends that renew leases (Redis, the PostgreSQL lease
// table), and a build may have neither.
#![cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::sync::lock;

/// A lease whose renewal a [`Renewals`] timer starts.
pub(crate) trait Renewable: Send + Sync {
    /// Spawns the lease's renewal task, whose first renewal goes at once,
    /// unless released meanwhile.
    fn start_renewal(self: Arc<Self>);
}

/// Where a lease waits in [`Renewals`]: its due time and a number.
pub(crate) type Place = (Instant, u64);

/// The leases of one backend waiting for their first renewal, and the one
/// timer that starts them.
pub(crate) struct Renewals {
    due: Arc<Mutex<Due>>,
    /// An earlier lease came, or the backend is gone: the timer looks again.
    wake: Arc<Notify>,
    /// Told when every lease should renew at once (a lost connection).
    renew_now: Option<Arc<Notify>>,
    /// The runtime the backend was made on: the timer runs on the current
    /// one, else there.
    home: Option<tokio::runtime::Handle>,
}

#[derive(Default)]
struct Due {
    leases: BTreeMap<Place, Weak<dyn Renewable>>,
    numbered: u64,
    timer: Option<JoinHandle<()>>,
}

impl Renewals {
    /// A backend's renewals; `renew_now`, when told, starts every waiting
    /// lease's renewal at once.
    pub(crate) fn new(renew_now: Option<Arc<Notify>>) -> Arc<Self> {
        Arc::new(Renewals {
            due: Arc::default(),
            wake: Arc::default(),
            renew_now,
            home: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// Starts `lease`'s renewal at `at`, unless [`cancel`](Self::cancel)led
    /// first.
    pub(crate) fn add(&self, at: Instant, lease: Weak<dyn Renewable>) -> Place {
        let mut due = lock(&self.due);
        due.numbered += 1;
        let place = (at, due.numbered);
        let first = due.leases.first_key_value().is_none_or(|(p, _)| place < *p);
        due.leases.insert(place, lease);
        // A timer ends with its runtime: then one starts on this one.
        if due.timer.as_ref().is_none_or(JoinHandle::is_finished) {
            let Some(rt) = tokio::runtime::Handle::try_current()
                .ok()
                .or_else(|| self.home.clone())
            else {
                // No runtime at all: nothing could renew it.
                return place;
            };
            let timer = watch(
                Arc::downgrade(&self.due),
                self.wake.clone(),
                self.renew_now.clone(),
            );
            due.timer = Some(rt.spawn(timer));
        } else if first {
            self.wake.notify_one();
        }
        place
    }

    /// Forgets a lease released before its renewal came due.
    pub(crate) fn cancel(&self, place: Place) {
        lock(&self.due).leases.remove(&place);
    }

    /// How many leases wait (for tests).
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        lock(&self.due).leases.len()
    }
}

impl Drop for Renewals {
    fn drop(&mut self) {
        if let Some(timer) = lock(&self.due).timer.take() {
            timer.abort();
        }
    }
}

/// The timer: starts each lease's renewal when due, every one at
/// `renew_now`.
async fn watch(due: Weak<Mutex<Due>>, wake: Arc<Notify>, renew_now: Option<Arc<Notify>>) {
    let mut ready = Vec::new();
    loop {
        // Armed before looking, so that a call between the look and the
        // wait is not missed.
        let now_all = renew_now.as_ref().map(|notify| notify.notified());
        tokio::pin!(now_all);
        if let Some(now_all) = now_all.as_mut().as_pin_mut() {
            now_all.enable();
        }
        let next = {
            let Some(due) = due.upgrade() else { return };
            let mut due = lock(&due);
            let now = Instant::now();
            while let Some(entry) = due.leases.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                ready.push(entry.remove());
            }
            due.leases.first_key_value().map(|(place, _)| place.0)
        };
        // Started without the lock held: a lease locks its own state, and
        // a release locks that state first, then this one's.
        for lease in ready.drain(..) {
            if let Some(lease) = lease.upgrade() {
                lease.start_renewal();
            }
        }
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let now_all = async {
            match now_all.as_mut().as_pin_mut() {
                Some(now_all) => now_all.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            _ = wake.notified() => {}
            _ = now_all => {
                let Some(due) = due.upgrade() else { return };
                let all = std::mem::take(&mut lock(&due).leases);
                for lease in all.into_values() {
                    if let Some(lease) = lease.upgrade() {
                        lease.start_renewal();
                    }
                }
            }
        }
    }
}
