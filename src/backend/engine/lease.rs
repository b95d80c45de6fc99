//! The lease lifecycle every remote backend shares: renewal, freshness,
//! loss, and release (awaited, or in the background with retries, counted
//! for `flush`). A backend supplies only its [`Protocol`]: how to renew and
//! how to release one lock.

// Renewal serves the Redis backends (ZooKeeper's session keeps itself
// alive), and a build may have either alone.
#![cfg_attr(not(feature = "redis"), allow(dead_code))]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::renewal::{Place, Renewable, Renewals, Timer};
use super::InFlight;
use crate::backend::{Acquired, BackendFuture, LeaseHandle};
use crate::error::LockError;
use crate::lost::{Deadline, HasLostState, LostSignal, LostState};
use crate::sync::lock;
use crate::token::FencingToken;

/// The shortest lease accepted: renewal runs every third of it.
const MIN_LEASE: Duration = Duration::from_millis(30);

/// Refuses a lease too short to renew in time.
pub(crate) fn check_lease(lease: Duration, backend: &str) -> Result<(), LockError> {
    if lease < MIN_LEASE {
        return Err(LockError::Config(format!(
            "a {backend} lease must be at least {} ms",
            MIN_LEASE.as_millis()
        )));
    }
    Ok(())
}

/// What is taken off a lease for clock drift before counting on it.
pub(crate) fn drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

/// How long a lease granted or renewed by a request sent at `sent` is known
/// to last: never counted from the answer, which may come late.
pub(crate) fn known_until(sent: Instant, lease: Duration) -> Instant {
    sent + lease - drift(lease)
}

/// What one remote backend does for one held lock.
pub(crate) trait Protocol: Send + Sync + Sized + 'static {
    /// The backend's name, for logs.
    const BACKEND: &'static str;
    /// Why a lock whose validity has passed is no longer known held.
    const EXPIRED: &'static str;

    /// The lock, for logs.
    fn describe(&self) -> &str;

    /// Extends the lease by `lease`, once. `Err` says why the lock is lost.
    fn renew(&self, lease: Duration) -> impl Future<Output = Result<(), String>> + Send;

    /// Woken when the renewal should run at once (the connection was lost).
    fn renew_now(&self) -> Option<Arc<Notify>> {
        None
    }

    /// One release. Its first poll puts it on the wire.
    fn release(&self) -> impl Future<Output = Released> + Send;

    /// After an answered release: see [`LeaseHandle::hand_off`].
    fn hand_off(&self) -> Option<crate::backend::BackendFuture<()>> {
        None
    }

    /// See [`LeaseHandle::may_hand_off`].
    fn may_hand_off(&self) -> bool {
        false
    }

    /// Releases, again after failures without an answer, until done, the
    /// lock surely gone, or `deadline` (when the lease would end anyway).
    fn release_until(
        &self,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), LockError>> + Send;
}

/// The outcome of one release.
pub(crate) struct Released {
    pub(crate) result: Result<(), LockError>,
    /// It may not have been applied everywhere: go on in the background.
    pub(crate) again: bool,
}

/// A held remote lock: its protocol state, validity, renewal and loss.
pub(crate) struct Lease<P: Protocol> {
    pub(crate) protocol: P,
    lease: Duration,
    lost: LostState,
    /// Until when the server surely keeps the lock (for ZooKeeper, the
    /// session's deadline, shared by its locks).
    valid: Arc<Deadline>,
    renewal: Mutex<Renewal>,
    releases: Arc<InFlight>,
    /// Set when the release starts: later calls do nothing.
    released: AtomicBool,
}

impl<P: Protocol> Lease<P> {
    /// A lock granted until `valid`; `releases` counts its background
    /// releases for the backend's `flush`.
    pub(crate) fn new(
        protocol: P,
        lease: Duration,
        valid: Arc<Deadline>,
        releases: Arc<InFlight>,
    ) -> Arc<Self> {
        Arc::new(Lease {
            protocol,
            lease,
            lost: LostState::new(),
            valid,
            renewal: Mutex::new(Renewal::Off),
            releases,
            released: AtomicBool::new(false),
        })
    }

    /// Renews the lease every third of it until released or lost: its
    /// renewal task starts when the first renewal is due (`renewals` waits
    /// until then), or now for a grant whose answer came late.
    pub(crate) fn keep_renewed(self: &Arc<Self>, renewals: &Arc<Renewals>) {
        self.keep_renewed_granted(renewals, self.lease)
    }

    /// [`keep_renewed`](Self::keep_renewed) for a lock the server holds for
    /// `granted`, which may be shorter than the lease (a Redis release's
    /// direct grant): its first renewal is due a third of `granted` in, as
    /// a lease of that length would be, and renews to the whole lease.
    pub(crate) fn keep_renewed_granted(self: &Arc<Self>, renewals: &Arc<Renewals>, granted: Duration) {
        let wait = renewal_due_in(granted.min(self.lease), self.valid.left());
        let mut renewal = lock(&self.renewal);
        *renewal = match wait.is_zero() {
            true => Renewal::Running(tokio::spawn(renew(Arc::downgrade(self)))),
            false => {
                let at = tokio::time::Instant::now() + wait;
                let me: std::sync::Weak<dyn Renewable> = Arc::downgrade(self) as _;
                let (timer, place) = renewals.add(at, me);
                Renewal::Waiting(timer, place)
            }
        };
    }

    /// The lock as the backend hands it out, with `tokens` reserved from
    /// `token` on.
    pub(crate) fn acquired(self: Arc<Self>, token: FencingToken, tokens: u32) -> Acquired {
        let lost = LostSignal::new(self.clone());
        Acquired::new(token, self)
            .with_lost(lost)
            .with_tokens(tokens)
    }

    fn stop_renewal(&self) {
        match std::mem::replace(&mut *lock(&self.renewal), Renewal::Off) {
            Renewal::Off => {}
            Renewal::Waiting(timer, place) => timer.cancel(place),
            Renewal::Running(task) => task.abort(),
        }
    }

    /// Releases in the background, retrying until the lease would end.
    fn release_later(self: Arc<Self>) {
        let deadline = Instant::now() + self.lease;
        let releases = self.releases.clone();
        let what = P::BACKEND;
        release_in_background(
            async move { self.protocol.release_until(deadline).await },
            &releases,
            what,
        );
    }
}

/// Where a lease's renewal is.
enum Renewal {
    /// Not renewed (yet, or any more: released).
    Off,
    /// Waiting in a backend's [`Renewals`] until its first renewal is due.
    Waiting(Arc<Timer>, Place),
    Running(JoinHandle<()>),
}

impl<P: Protocol> Renewable for Lease<P> {
    fn start_renewal(self: Arc<Self>) {
        let mut renewal = lock(&self.renewal);
        // Released meanwhile: nothing to renew.
        if let Renewal::Waiting(..) = *renewal {
            *renewal = Renewal::Running(tokio::spawn(renew(Arc::downgrade(&self))));
        }
    }
}

impl<P: Protocol> HasLostState for Lease<P> {
    fn lost_state(&self) -> &LostState {
        &self.lost
    }

    /// A holder that runs again after a pause past its lease is told at
    /// once, before the renewal task gets to run.
    fn expired(&self) -> Option<String> {
        self.valid.passed().then(|| P::EXPIRED.to_owned())
    }
}

impl<P: Protocol> LeaseHandle for Lease<P> {
    /// Waits for the answer. Dropped before it (the caller gave up
    /// waiting), even unpolled, the same release goes on in the background:
    /// never a second one, which could free a lock the same session or
    /// owner took since (a PostgreSQL or MariaDB lock is released by name).
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        if self.released.swap(true, Ordering::AcqRel) {
            return BackendFuture::ready(Ok(()));
        }
        self.stop_renewal();
        let releases = self.releases.clone();
        BackendFuture::new(Finishing {
            release: Some(Box::pin(async move {
                let Released { result, again } = self.protocol.release().await;
                if again {
                    self.release_later();
                }
                result
            })),
            releases,
            backend: P::BACKEND,
        })
    }

    /// Puts the release on the wire and leaves its answer (and any retry)
    /// to a task that the backend's `flush` waits for.
    fn release_on_drop(self: Arc<Self>) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        self.stop_renewal();
        self.release_later();
    }

    fn valid_until(&self) -> Option<Instant> {
        Some(self.valid.get())
    }

    fn hand_off(&self) -> Option<BackendFuture<()>> {
        self.protocol.hand_off()
    }

    fn may_hand_off(&self) -> bool {
        self.protocol.may_hand_off()
    }
}

type ReleaseFuture = Pin<Box<dyn Future<Output = Result<(), LockError>> + Send>>;

/// An awaited release. Dropped before its answer, it hands itself (the
/// one release, wherever it got to) to the background, where the backend's
/// `flush` waits for it.
struct Finishing {
    release: Option<ReleaseFuture>,
    releases: Arc<InFlight>,
    backend: &'static str,
}

impl Future for Finishing {
    type Output = Result<(), LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let release = self
            .release
            .as_mut()
            .expect("a release polled after it finished");
        let result = std::task::ready!(release.as_mut().poll(cx));
        self.release = None;
        Poll::Ready(result)
    }
}

impl Drop for Finishing {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release_in_background(release, &self.releases, self.backend);
        }
    }
}

/// Renews a lease every third of it until released or lost; a renewal that
/// fails, times out (after a third of the lease) or finds the lock gone
/// fires the lost signal, before the lease ends.
///
/// Both are counted from the lease's validity, not from when the loop
/// started: a grant whose answer came late (held back by the network) is
/// known valid for less than a lease, maybe for no time at all. Its first
/// renewal is sent at once, and a renewal not answered by the end of the
/// validity fires the signal then, before the server can grant the lock to
/// anyone else.
///
/// Spawned when the first renewal is due: it goes at once.
async fn renew<P: Protocol>(lease: Weak<Lease<P>>) {
    let Some((period, full)) = lease.upgrade().map(|l| (l.lease / 3, l.lease)) else {
        return;
    };
    let mut due = true;
    loop {
        let Some((now, left)) = lease
            .upgrade()
            .map(|l| (l.protocol.renew_now(), l.valid.left()))
        else {
            return;
        };
        // Due a third of a lease after the last grant or renewal was sent
        // (valid from then for the lease less the drift), not after its
        // answer: after a late answer the next renewal goes at once, and its
        // timeout ends some third of a lease before the validity, not at
        // its very end, where only the drift (a few ms) would be left for
        // the signal to reach a holder on a busy machine. At once for a
        // late grant.
        let wait = match std::mem::take(&mut due) {
            true => Duration::ZERO,
            false => renewal_due_in(full, left),
        };
        match now {
            Some(now) => tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = now.notified() => {}
            },
            None => tokio::time::sleep(wait).await,
        }
        let Some(l) = lease.upgrade() else {
            return;
        };
        let sent = Instant::now();
        let within = period.min(l.valid.left());
        let reason = match tokio::time::timeout(within, l.protocol.renew(l.lease)).await {
            Ok(Ok(())) => {
                l.valid.extend(known_until(sent, l.lease));
                continue;
            }
            Ok(Err(reason)) => reason,
            Err(_) if within < period => P::EXPIRED.to_owned(),
            Err(_) => "renewing the lease timed out".to_owned(),
        };
        tracing::warn!(
            backend = P::BACKEND,
            key = l.protocol.describe(),
            reason,
            "lock lost"
        );
        l.lost.fire(reason);
        return;
    }
}

/// How long until a lease of `lease`, known valid for `left` more, is due
/// its next renewal.
fn renewal_due_in(lease: Duration, left: Duration) -> Duration {
    left.saturating_sub((lease - drift(lease)).saturating_sub(lease / 3))
}

/// Releases from a destructor: puts `release` (which retries on its own) on
/// the wire and leaves the answer to a task that the backend's `flush`
/// waits for. A failure is logged.
///
/// Dropped where no runtime runs (a blocking thread, after the runtime
/// ended), the release is not polled here, where a driver's timers and
/// sockets would panic: it runs on the runtime the backend was made on,
/// or, with that one gone, never, and the lock ends with its connections.
pub(crate) fn release_in_background(
    release: impl Future<Output = Result<(), LockError>> + Send + 'static,
    in_flight: &Arc<InFlight>,
    backend: &'static str,
) {
    let failed = move |e: LockError| {
        tracing::warn!(backend, error = %e, "releasing a lock failed; it ends with its lease");
    };
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        // No current runtime, so this is the backend's own, if it still runs.
        match in_flight.runtime() {
            Some(home) => {
                in_flight.spawn(&home, async move { release.await.unwrap_or_else(failed) })
            }
            None => tracing::warn!(
                backend,
                "lock dropped outside a Tokio runtime; it is not released and will expire with its lease"
            ),
        }
        return;
    };
    let mut release = Box::pin(release);
    let first = release
        .as_mut()
        .poll(&mut Context::from_waker(std::task::Waker::noop()));
    match first {
        Poll::Ready(result) => result.unwrap_or_else(failed),
        Poll::Pending => in_flight.spawn(&rt, async move { release.await.unwrap_or_else(failed) }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;
    use crate::lost::LostSignal;

    /// A lock whose first `answered` renewals are answered after `answer`,
    /// and no later one (the network holds them), counted.
    struct Fake {
        answered: u32,
        answer: Duration,
        renewals: Arc<AtomicU32>,
    }

    impl Protocol for Fake {
        const BACKEND: &'static str = "fake";
        const EXPIRED: &'static str = "no renewal answered within the lease";

        fn describe(&self) -> &str {
            "k"
        }

        async fn renew(&self, _lease: Duration) -> Result<(), String> {
            if self.renewals.fetch_add(1, Ordering::SeqCst) >= self.answered {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(self.answer).await;
            Ok(())
        }

        async fn release(&self) -> Released {
            Released {
                result: Ok(()),
                again: false,
            }
        }

        async fn release_until(&self, _deadline: Instant) -> Result<(), LockError> {
            Ok(())
        }
    }

    fn held(
        answers: bool,
        lease: Duration,
        valid_for: Duration,
    ) -> (Arc<Lease<Fake>>, Arc<AtomicU32>) {
        let renewals = Arc::new(AtomicU32::new(0));
        let fake = Fake {
            answered: if answers { u32::MAX } else { 0 },
            answer: Duration::ZERO,
            renewals: renewals.clone(),
        };
        let valid = Arc::new(Deadline::new(Instant::now() + valid_for));
        let held = Lease::new(fake, lease, valid, Arc::default());
        held.keep_renewed(&Renewals::new(None));
        (held, renewals)
    }

    /// A grant whose answer came late is known valid for less than a lease:
    /// a holder waiting on the lost signal hears of it by the end of that
    /// validity, not a third of a lease later, when the server may long
    /// have given the lock to someone else.
    // Paused time: the renewal's sleeps and timeout run on Tokio's clock,
    // which the test moves, so what is counted does not drift with load.
    #[tokio::test(start_paused = true)]
    async fn a_grant_answered_late_is_told_lost_by_the_end_of_its_validity() {
        let (lease, left) = (Duration::from_secs(3), Duration::from_millis(100));
        let started = tokio::time::Instant::now();
        let (held, renewals) = held(false, lease, left);
        let signal = LostSignal::new(held.clone());
        // When a holder waiting on the signal is woken (a poll after the
        // validity would see it lost, but nothing may poll until then).
        let told = tokio::spawn(async move {
            signal.lost().await;
            tokio::time::Instant::now()
        });
        tokio::time::sleep(lease / 3).await;
        assert!(told.is_finished(), "not told by the end of the validity");
        let told = told.await.unwrap() - started;
        assert!(told >= left, "told before the validity ended");
        // Sent at once: it might have kept the lock.
        assert_eq!(renewals.load(Ordering::Relaxed), 1);
    }

    /// A grant answered in time is renewed every third of its lease, not
    /// more often.
    #[tokio::test(start_paused = true)]
    async fn a_fresh_grant_is_renewed_every_third_of_its_lease() {
        let lease = Duration::from_millis(300);
        let (held, renewals) = held(true, lease, lease);
        tokio::time::sleep(Duration::from_millis(350)).await;
        let sent = renewals.load(Ordering::Relaxed);
        assert_eq!(sent, 3, "renewals in 350 ms of a 300 ms lease");
        assert!(!LostSignal::new(held).is_lost());
    }

    /// A lock released before its first renewal is due never had a
    /// renewal task, and leaves nothing waiting for one.
    #[tokio::test]
    async fn a_lock_released_before_its_first_renewal_leaves_nothing_behind() {
        let renewals = Renewals::new(None);
        let count = Arc::new(AtomicU32::new(0));
        let fake = Fake {
            answered: u32::MAX,
            answer: Duration::ZERO,
            renewals: count.clone(),
        };
        let lease = Duration::from_secs(30);
        let valid = Arc::new(Deadline::new(Instant::now() + lease));
        let held = Lease::new(fake, lease, valid, Arc::default());
        held.keep_renewed(&renewals);
        assert_eq!(renewals.waiting(), 1);
        assert!(matches!(*lock(&held.renewal), Renewal::Waiting(..)));
        held.clone().release().await.unwrap();
        assert_eq!(renewals.waiting(), 0, "a released lease still waits");
        assert!(matches!(*lock(&held.renewal), Renewal::Off));
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }

    /// Leases taken one after another, each released before the next (one
    /// request at a time): the timer is not woken for each, only when one
    /// comes due before the time it already sleeps until.
    #[tokio::test]
    async fn leases_taken_one_at_a_time_do_not_wake_the_timer_each() {
        let renewals = Renewals::new(None);
        let lease = Duration::from_secs(30);
        for _ in 0..50 {
            let fake = Fake {
                answered: u32::MAX,
                answer: Duration::ZERO,
                renewals: Arc::default(),
            };
            let valid = Arc::new(Deadline::new(Instant::now() + lease));
            let held = Lease::new(fake, lease, valid, Arc::default());
            held.keep_renewed(&renewals);
            held.release().await.unwrap();
            // The timer's task runs between two locks, as it would.
            tokio::task::yield_now().await;
        }
        assert_eq!(renewals.waiting(), 0);
        let looks = renewals.looks();
        assert!(looks <= 3, "the timer looked {looks} times for 50 leases");
    }

    /// Told to renew now (a lost connection), every lease waiting for its
    /// first renewal renews at once, not when it would have been due.
    #[tokio::test]
    async fn renew_now_renews_the_leases_not_yet_due_at_once() {
        let now = Arc::new(Notify::new());
        let renewals = Renewals::new(Some(now.clone()));
        let count = Arc::new(AtomicU32::new(0));
        let lease = Duration::from_secs(30);
        let mut held = Vec::new();
        for _ in 0..2 {
            let fake = Fake {
                answered: u32::MAX,
                answer: Duration::ZERO,
                renewals: count.clone(),
            };
            let valid = Arc::new(Deadline::new(Instant::now() + lease));
            let lock = Lease::new(fake, lease, valid, Arc::default());
            lock.keep_renewed(&renewals);
            held.push(lock);
        }
        // Until the timer waits, a call would find nobody to tell; due in
        // 20 s otherwise.
        let asked = Instant::now();
        while count.load(Ordering::SeqCst) < 2 {
            now.notify_waiters();
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(asked.elapsed() < Duration::from_secs(5), "not renewed");
        }
        assert_eq!(renewals.waiting(), 0);
        for lock in held {
            lock.release().await.unwrap();
        }
    }

    /// A backend shared by two runtimes: a lease taken on one is renewed
    /// there, although the other, which took a lease first, is no longer
    /// driven (a `block_on` facade between calls).
    #[test]
    fn a_lease_is_renewed_on_its_own_runtime() {
        let renewals = Renewals::new(None);
        let lease = Duration::from_millis(300);
        let fresh = |count: &Arc<AtomicU32>| {
            let fake = Fake {
                answered: u32::MAX,
                answer: Duration::ZERO,
                renewals: count.clone(),
            };
            let valid = Arc::new(Deadline::new(Instant::now() + lease));
            Lease::new(fake, lease, valid, Arc::default())
        };
        let current = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        let (idle, busy) = (current(), current());
        let (first, second) = (Arc::default(), Arc::default());
        let a = idle.block_on(async {
            let a = fresh(&first);
            a.keep_renewed(&renewals);
            a
        });
        busy.block_on(async {
            let b = fresh(&second);
            b.keep_renewed(&renewals);
            tokio::time::sleep(Duration::from_millis(400)).await;
            assert!(second.load(Ordering::SeqCst) >= 1, "not renewed");
            b.release().await.unwrap();
        });
        assert_eq!(first.load(Ordering::SeqCst), 0, "renewed undriven");
        drop(a);
    }

    const LEASE: Duration = Duration::from_millis(600);
    const PERIOD: Duration = Duration::from_millis(200);

    /// Granted by a request sent `since` ago, renewed from now on: when the
    /// lost signal fires, and when the lease was known to end. Real time
    /// (the lease reads the clock itself), and margins of half a period.
    async fn lost_at(since: Duration, answered: u32, answer: Duration) -> (Instant, Instant) {
        let sent = Instant::now() - since;
        let valid = Arc::new(Deadline::new(known_until(sent, LEASE)));
        let fake = Fake {
            answer,
            answered,
            renewals: Default::default(),
        };
        let held = Lease::new(fake, LEASE, valid.clone(), Arc::new(InFlight::default()));
        held.keep_renewed(&Renewals::new(None));
        let signal = LostSignal::new(held.clone());
        // Woken by the renewal task only: `is_lost` is not looked at.
        signal.lost().await;
        (Instant::now(), valid.get())
    }

    /// A renewal answered just within its time (199 ms of 200), then none:
    /// told well before the lease it won ends (the next renewal is due a
    /// period after that one was sent, not after its answer).
    #[tokio::test]
    async fn a_renewal_answered_late_then_none_is_told_lost_before_the_lease_ends() {
        let (lost, valid) = lost_at(Duration::ZERO, 1, Duration::from_millis(199)).await;
        assert!(
            lost + PERIOD / 2 <= valid,
            "told {:?} before the lease ended",
            valid.saturating_duration_since(lost)
        );
    }
}
