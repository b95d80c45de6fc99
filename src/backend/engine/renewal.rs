//! Renewal put off until it is due: most locks are released long before a
//! third of their lease has passed (a request holds one for milliseconds,
//! a lease lasts seconds), and a task spawned for each would be spawned,
//! timed and aborted for nothing. A backend keeps one timer per runtime
//! that holds its leases; it watches the leases not yet due and starts a
//! lease's own renewal task (`lease::renew`) on that runtime when its first
//! renewal comes due, or at once for all of them when the backend asks (a
//! lost connection).

// Serves the backends that renew leases (Redis, the PostgreSQL lease
// table), and a build may have neither.
#![cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::sync::lock;

/// A lease whose renewal a [`Timer`] starts.
pub(crate) trait Renewable: Send + Sync {
    /// Spawns the lease's renewal task, whose first renewal goes at once,
    /// unless released meanwhile.
    fn start_renewal(self: Arc<Self>);
}

/// Where a lease waits in a [`Timer`]: its due time and a number.
pub(crate) type Place = (Instant, u64);

/// A backend's leases waiting for their first renewal.
///
/// One timer per runtime: a lease's renewal runs on the runtime that took
/// it, by that runtime's clock, and a runtime that stops being driven (a
/// `block_on` facade between calls) or shuts down holds back only its own.
pub(crate) struct Renewals {
    timers: Mutex<Vec<Arc<Timer>>>,
    /// Told when every lease should renew at once (a lost connection).
    renew_now: Option<Arc<Notify>>,
}

/// The leases of one runtime waiting for their first renewal, and the task
/// that starts them.
pub(crate) struct Timer {
    runtime: tokio::runtime::Id,
    due: Mutex<Due>,
    /// An earlier lease came: the task looks again.
    wake: Arc<Notify>,
}

#[derive(Default)]
struct Due {
    leases: BTreeMap<Place, Weak<dyn Renewable>>,
    numbered: u64,
    task: Option<JoinHandle<()>>,
    /// When the task wakes next by itself; `None` while it waits for a
    /// lease. A lease due no earlier needs no wake-up: with one lease
    /// held at a time (one request after another), telling the task of
    /// each was a wake-up, a look and a new timer per lock.
    armed: Option<Instant>,
    /// When the last lease added comes due: when the task wakes if it
    /// finds none left (see `watch`).
    last: Option<Instant>,
    /// How many times the task looked for leases due.
    #[cfg(test)]
    looks: u64,
}

impl Renewals {
    /// A backend's renewals; `renew_now`, when told, starts every waiting
    /// lease's renewal at once.
    pub(crate) fn new(renew_now: Option<Arc<Notify>>) -> Arc<Self> {
        Arc::new(Renewals {
            timers: Mutex::default(),
            renew_now,
        })
    }

    /// Starts `lease`'s renewal at `at` (by the current runtime's clock) on
    /// the current runtime, unless [`cancel`](Timer::cancel)led first.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub(crate) fn add(&self, at: Instant, lease: Weak<dyn Renewable>) -> (Arc<Timer>, Place) {
        let rt = Handle::current();
        let timer = {
            let mut timers = lock(&self.timers);
            // A runtime shut down: its timer ended with it.
            timers.retain(|t| !t.ended());
            match timers.iter().find(|t| t.runtime == rt.id()) {
                Some(timer) => timer.clone(),
                None => {
                    let timer = Arc::new(Timer {
                        runtime: rt.id(),
                        due: Mutex::default(),
                        wake: Arc::default(),
                    });
                    let task = rt.spawn(watch(
                        Arc::downgrade(&timer),
                        timer.wake.clone(),
                        self.renew_now.clone(),
                    ));
                    lock(&timer.due).task = Some(task);
                    timers.push(timer.clone());
                    timer
                }
            }
        };
        let place = timer.add(at, lease);
        (timer, place)
    }

    /// How many leases wait (for tests).
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        lock(&self.timers)
            .iter()
            .map(|t| lock(&t.due).leases.len())
            .sum()
    }

    /// How many times the timers looked for leases due (for tests).
    #[cfg(test)]
    pub(crate) fn looks(&self) -> u64 {
        lock(&self.timers).iter().map(|t| lock(&t.due).looks).sum()
    }
}

impl Timer {
    fn add(&self, at: Instant, lease: Weak<dyn Renewable>) -> Place {
        let mut due = lock(&self.due);
        due.numbered += 1;
        let place = (at, due.numbered);
        due.last = Some(at);
        due.leases.insert(place, lease);
        // The task looks again when it wakes, before `at`; told now, it
        // looks at once (a permit, if it is not waiting yet).
        if due.armed.is_none_or(|armed| at < armed) {
            self.wake.notify_one();
        }
        place
    }

    /// Forgets a lease released before its renewal came due.
    pub(crate) fn cancel(&self, place: Place) {
        lock(&self.due).leases.remove(&place);
    }

    fn ended(&self) -> bool {
        lock(&self.due)
            .task
            .as_ref()
            .is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.due).task.take() {
            task.abort();
        }
    }
}

/// The timer's task: starts each lease's renewal when due, every one at
/// `renew_now`. Ends with its [`Timer`] (the backend and its last waiting
/// lease gone) or its runtime.
async fn watch(timer: Weak<Timer>, wake: Arc<Notify>, renew_now: Option<Arc<Notify>>) {
    let mut ready = Vec::new();
    // How many leases had been added at the last look.
    let mut seen = 0;
    loop {
        // Armed before looking, so that a call between the look and the
        // wait is not missed.
        let now_all = renew_now.as_ref().map(|notify| notify.notified());
        tokio::pin!(now_all);
        if let Some(now_all) = now_all.as_mut().as_pin_mut() {
            now_all.enable();
        }
        let Some(this) = timer.upgrade() else { return };
        let next = {
            let mut due = lock(&this.due);
            let now = Instant::now();
            while let Some(entry) = due.leases.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                ready.push(entry.remove());
            }
            #[cfg(test)]
            {
                due.looks += 1;
            }
            // Kept when the lease it was set for is released: that wake-up
            // costs one look, where telling the task of every new lease
            // cost one each. With none left but some added since the last
            // look (each released before this look: one request after
            // another), until the last would have come due: the next, as
            // long, is due later, and needs no wake-up. Once such a sleep
            // passes with none added, the task waits to be told.
            let next = match due.leases.first_key_value() {
                Some((place, _)) => Some(place.0),
                None if due.numbered != seen => due.last,
                None => None,
            };
            seen = due.numbered;
            due.armed = next;
            next
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
        // Not kept while waiting: the timer ends once nothing else holds it.
        drop(this);
        tokio::select! {
            _ = sleep => {}
            _ = wake.notified() => {}
            _ = now_all => {
                let Some(this) = timer.upgrade() else { return };
                let all = std::mem::take(&mut lock(&this.due).leases);
                for lease in all.into_values() {
                    if let Some(lease) = lease.upgrade() {
                        lease.start_renewal();
                    }
                }
            }
        }
    }
}

/// Random sequences of leases added, released, and time passing, under
/// tokio's paused clock: no renewal starts later than it is due (the timer
/// is told of a lease only when it would not look before the lease's time).
/// Seen red with the timer never told, and with its wake-up time kept when
/// it finds nothing to wake for.
#[cfg(test)]
mod due_tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use tokio::sync::Notify;
    use tokio::time::{Duration, Instant};

    use super::{Renewable, Renewals};

    struct Fake {
        at: Instant,
        started: Mutex<Option<Instant>>,
    }

    impl Renewable for Fake {
        fn start_renewal(self: Arc<Self>) {
            *self.started.lock().unwrap() = Some(Instant::now());
        }
    }

    /// xorshift: the same sequence for a seed on every run.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    fn paused() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    async fn scenario(renewals: Arc<Renewals>, seed: u64) {
        let mut rng = Rng(seed);
        let (mut held, mut started) = (Vec::new(), Vec::new());
        for _ in 0..400 {
            match rng.next() % 6 {
                0 | 1 => {
                    let at = Instant::now() + Duration::from_micros(500 + rng.next() % 80_000);
                    let fake = Arc::new(Fake {
                        at,
                        started: Mutex::new(None),
                    });
                    let weak: std::sync::Weak<dyn Renewable> = Arc::downgrade(&fake) as _;
                    let (timer, place) = renewals.add(at, weak);
                    held.push((fake, timer, place));
                }
                2 if !held.is_empty() => {
                    let (fake, timer, place) = held.swap_remove(rng.next() as usize % held.len());
                    if fake.started.lock().unwrap().is_none() {
                        timer.cancel(place);
                    } else {
                        started.push(fake);
                    }
                }
                3 => tokio::task::yield_now().await,
                4 => tokio::time::sleep(Duration::from_micros(rng.next() % 30_000)).await,
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        started.extend(held.into_iter().map(|(fake, _, _)| fake));
        for fake in started {
            let at = fake.started.lock().unwrap().expect("renewal never started");
            // The timer's granularity: a millisecond.
            assert!(
                at <= fake.at + Duration::from_millis(1),
                "seed {seed}: started {:?} late",
                at - fake.at
            );
        }
    }

    #[test]
    fn no_renewal_starts_late() {
        for seed in 1..200u64 {
            paused().block_on(scenario(Renewals::new(None), seed * 7919));
        }
    }

    /// With the backend's renew-now signal told at random times too.
    #[test]
    fn no_renewal_starts_late_when_told_to_renew_now() {
        for seed in 1..200u64 {
            paused().block_on(async {
                let now = Arc::new(Notify::new());
                let stop = Arc::new(AtomicBool::new(false));
                let teller = tokio::spawn({
                    let (now, stop) = (now.clone(), stop.clone());
                    async move {
                        let mut rng = Rng(seed ^ 0x9e37);
                        while !stop.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_micros(rng.next() % 40_000)).await;
                            now.notify_waiters();
                        }
                    }
                });
                scenario(Renewals::new(Some(now)), seed * 6007).await;
                stop.store(true, Ordering::Relaxed);
                teller.await.unwrap();
            });
        }
    }
}
