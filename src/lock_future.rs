//! [`LockFuture`]: one acquisition under way, from the backend's future to
//! a [`LockGuard`], with its wait, re-entrancy, tracing and metrics.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};
use tracing::field::Empty;

use crate::admission::{Admission, Ticket};
use crate::backend::{Acquired, BackendFuture, LockRequest};
use crate::error::LockError;
use crate::guard::{HeldLock, LockGuard};
use crate::key::LockKey;
use crate::mode::{LockMode, Wait};
use crate::Backend;

/// Future of one acquisition: waits at most until its deadline, and leaves
/// the backend's queue if dropped.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::future::IntoFuture;
/// use std::time::Duration;
/// use tower_lock::{BackendExt, LockFuture, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let _held = backend.lock("k").await?;
/// // A nameable future, e.g. to race against shutdown.
/// let waiting: LockFuture = backend.lock("k").into_future();
/// tokio::select! {
///     guard = waiting => println!("got it: {:?}", guard.map(|g| g.token())),
///     _ = tokio::time::sleep(Duration::from_millis(10)) => println!("gave up; the request is withdrawn"),
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// Cancel safe: dropping it before it completes withdraws the request, and a
/// lock granted in the meantime is released.
#[must_use = "futures do nothing unless polled"]
pub struct LockFuture {
    state: Option<Acquiring>,
    // Boxed: only a waiting acquisition with a timeout needs a timer, and an
    // unboxed `Sleep` would make every `LockFuture` large and `!Unpin`.
    sleep: Option<Pin<Box<Sleep>>>,
    /// The result of an acquisition decided before the backend was asked:
    /// a nested guard on a lock the request already holds, or a refusal.
    decided: Option<Result<LockGuard, LockError>>,
    /// The backend of the layer's lock a decided nested guard re-entered:
    /// that guard holds nothing of its own, so it is given only to a poll
    /// from a request that holds the lock.
    borrowed_from: Option<usize>,
}

struct Acquiring {
    acquire: BackendFuture<Result<Acquired, LockError>>,
    /// What the guard or the error is made of once the backend answers.
    meta: Meta,
    wait: Wait,
    /// A deadline shared with other acquisitions (`lock_all`); otherwise one
    /// is set from `wait` when the acquisition first has to wait, so that an
    /// uncontended lock reads no clock.
    deadline: Option<Instant>,
    /// When the acquisition first had to wait; `None` while it never did.
    waiting_since: Option<Instant>,
    /// Counts it in the `tower_lock_waiting` gauge.
    _waiting: Option<crate::metrics::Waiting>,
    /// Lists it in this process's view ([`crate::admin`]).
    _listed: Option<crate::admin::Waiting>,
}

/// What [`finish`] makes a guard or an error of: kept apart from the
/// waiting state, so that the layer's grant decided at once (the memory
/// backend, uncontended) never builds, moves or drops that state.
struct Meta {
    key: Option<LockKey>,
    mode: LockMode,
    backend: &'static str,
    /// [`Backend::instance_id`], for re-entrancy.
    backend_id: usize,
    /// Whether the lock joins the request's list for re-entrancy: not a
    /// layer's own, which its own scope lists (recorded in the scope it was
    /// taken from, a sub-request's would be the parent request's).
    record: bool,
    span: tracing::Span,
    /// Counts the acquisition among its key's waiters, under admission
    /// control.
    ticket: Option<Ticket>,
}

impl LockFuture {
    /// Starts acquiring `key`. `deadline` overrides the one `wait` implies
    /// (a multi-key acquisition shares one).
    pub(crate) fn start<B: Backend + ?Sized>(
        backend: &B,
        key: LockKey,
        mode: LockMode,
        wait: Wait,
        deadline: Option<Instant>,
        lease: Duration,
        admission: Option<&Arc<Admission>>,
    ) -> Self {
        let request = Start {
            key,
            mode,
            wait,
            deadline,
            lease,
            admission,
            record: true,
        };
        match acquiring(backend, request) {
            Started::Later(state) => Self::waiting(state),
            Started::Now(decided) => {
                let borrowed = matches!(&decided, Ok(guard) if guard.is_borrowed());
                LockFuture {
                    borrowed_from: borrowed.then(|| backend.instance_id()),
                    ..Self::decided(decided)
                }
            }
        }
    }

    /// Starts the layer's own acquisition, which its scope lists, so it is
    /// not recorded in the request's list (a sub-request's would land in the
    /// parent's). The result at once when the backend decided without
    /// waiting (the memory backend, uncontended; an invalid mode), else the
    /// future to wait on: the layer then calls the inner service at once,
    /// without a second state.
    pub(crate) fn begin_unrecorded<B: Backend + ?Sized>(
        backend: &B,
        key: LockKey,
        mode: LockMode,
        wait: Wait,
        lease: Duration,
        admission: Option<&Arc<Admission>>,
    ) -> Started<LockFuture> {
        let request = Start {
            key,
            mode,
            wait,
            deadline: None,
            lease,
            admission,
            record: false,
        };
        match acquiring(backend, request) {
            Started::Later(state) => Started::Later(Self::waiting(state)),
            Started::Now(now) => Started::Now(now),
        }
    }

    /// The future of an acquisition the backend has not decided yet.
    fn waiting(state: Acquiring) -> Self {
        LockFuture {
            state: Some(state),
            sleep: None,
            decided: None,
            borrowed_from: None,
        }
    }

    pub(crate) fn failed(error: LockError) -> Self {
        Self::decided(Err(error))
    }

    /// The future of an acquisition decided before any wait.
    fn decided(decided: Result<LockGuard, LockError>) -> Self {
        LockFuture {
            state: None,
            sleep: None,
            decided: Some(decided),
            borrowed_from: None,
        }
    }
}

/// What an acquisition starts from.
struct Start<'a> {
    key: LockKey,
    mode: LockMode,
    wait: Wait,
    deadline: Option<Instant>,
    lease: Duration,
    admission: Option<&'a Arc<Admission>>,
    record: bool,
}

/// An acquisition just started: decided before any wait, or `W` to finish.
pub(crate) enum Started<W> {
    /// Granted (or re-entered) or refused without waiting.
    Now(Result<LockGuard, LockError>),
    /// To be finished: it may have to wait.
    Later(W),
}

/// The checks and the backend call every acquisition starts with: the
/// state to finish or wait on, or what was decided before asking the
/// backend (a re-entered guard, an invalid mode).
fn acquiring<B: Backend + ?Sized>(backend: &B, start: Start<'_>) -> Started<Acquiring> {
    let (key, mode, deadline, admission) = (start.key, start.mode, start.deadline, start.admission);
    let wait = admission.map_or(start.wait, |a| a.wait(start.wait));
    if let LockMode::Semaphore { permits: 0 } = mode {
        return Started::Now(Err(LockError::InvalidMode(
            "a semaphore needs at least one permit".into(),
        )));
    }
    if !backend.capabilities().supports(mode) {
        return Started::Now(Err(LockError::InvalidMode(format!(
            "the {} backend has no {mode} locks",
            backend.name()
        ))));
    }
    let backend_id = backend.instance_id();
    // A request that already holds the key must not wait for itself.
    if let Some(now) = crate::reentry::reenter(backend_id, &key, mode) {
        return Started::Now(now);
    }
    // The backend counts a shared deadline's remainder as its wait.
    let backend_wait = match (deadline, wait) {
        (Some(d), Wait::Timeout(_)) => Wait::Timeout(d.saturating_duration_since(Instant::now())),
        _ => wait,
    };
    let name = backend.name();
    // Counted among the key's waiters before the backend is asked: a
    // refused request never touches it. One that cannot wait is no waiter.
    let ticket = match admission {
        Some(a) if backend_wait != Wait::FailFast => {
            match a.admit(name, &key, mode, backend_wait) {
                Ok(ticket) => Some(ticket),
                Err(e) => return Started::Now(Err(e)),
            }
        }
        _ => None,
    };
    let span = tracing::debug_span!(
        "lock",
        key = %key,
        backend = name,
        mode = mode.as_str(),
        wait_us = Empty,
        hold_us = Empty,
        outcome = Empty,
    );
    let request = LockRequest {
        key: key.clone(),
        mode,
        wait: backend_wait,
        lease: start.lease,
        tokens: 1,
        contended: false,
    };
    // Entering a span no subscriber wanted does nothing, at a price.
    let mut acquire = if span.is_disabled() {
        backend.acquire(request)
    } else {
        span.in_scope(|| backend.acquire(request))
    };
    let meta = Meta {
        key: Some(key),
        mode,
        backend: name,
        backend_id,
        record: start.record,
        span,
        // Kept even when granted at once: that grant starts the next turn.
        ticket,
    };
    // The layer's own lock, decided at once, is finished here. Any other
    // is finished where it is polled, as one that waited is: it joins the
    // re-entrancy list of the request that polls it (not of one that made
    // it and gave it to a task), and its lost signal is looked at then.
    if !meta.record {
        if let Some(result) = acquire.take_ready() {
            return Started::Now(finish(meta, None, result));
        }
    }
    // Queued from now, whenever the future is first polled.
    let waiting = !acquire.is_ready();
    let key = meta.key.as_ref().expect("set above");
    Started::Later(Acquiring {
        _listed: waiting.then(|| crate::admin::Waiting::start(name, key)),
        acquire,
        meta,
        wait,
        deadline,
        waiting_since: waiting.then(Instant::now),
        _waiting: waiting.then(|| crate::metrics::Waiting::start(name)),
    })
}

/// Turns the backend's answer into a guard or an error, and traces it.
/// `waiting_since`: when it first had to wait, if it did.
fn finish(
    mut state: Meta,
    waiting_since: Option<Instant>,
    result: Result<Acquired, LockError>,
) -> Result<LockGuard, LockError> {
    if let (Ok(_), Some(ticket)) = (&result, state.ticket.take()) {
        ticket.granted();
    }
    let waited = waiting_since.map_or(Duration::ZERO, |t| t.elapsed());
    // A disabled span still looks each field up by name.
    let traced = !state.span.is_disabled();
    if traced {
        state.span.record("wait_us", waited.as_micros() as u64);
    }
    // A grant that was revoked before anyone saw it is no grant.
    let result = match result {
        Ok(acquired) if acquired.lost().is_lost() => {
            let reason = acquired.lost().reason().unwrap_or("lock lost").to_owned();
            drop(acquired);
            Err(LockError::Lost(reason))
        }
        other => other,
    };
    let outcome = match &result {
        Ok(_) => "acquired",
        Err(LockError::Busy) => "busy",
        Err(LockError::Timeout { .. }) => "timeout",
        Err(LockError::Lost(_)) => "lost",
        Err(_) => "error",
    };
    if traced {
        state.span.record("outcome", outcome);
    }
    crate::metrics::acquisition(state.backend, outcome, waited);
    match result {
        Ok(acquired) => {
            let (token, lost, handle) = acquired.into_parts();
            tracing::debug!(parent: &state.span, token = token.get(), "lock acquired");
            let held = HeldLock {
                key: state.key.expect("key present when acquiring"),
                mode: state.mode,
                token,
                waited,
                backend: state.backend,
                lost,
            };
            let mut guard = LockGuard::new(held, handle, state.span);
            if state.record {
                crate::reentry::record(&mut guard, state.backend_id);
            }
            Ok(guard)
        }
        Err(e) => {
            tracing::debug!(parent: &state.span, error = %e, "lock not acquired");
            Err(e)
        }
    }
}

impl Future for LockFuture {
    type Output = Result<LockGuard, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(decided) = this.decided.take() {
            // Made in a request for its layer's key, awaited elsewhere (a
            // task the handler spawned): the layer's lock is not this
            // poller's, and a nested guard would hold nothing.
            if let (Some(id), Ok(guard)) = (this.borrowed_from, &decided) {
                if !crate::reentry::holds_layer_lock(id, guard.held()) {
                    return Poll::Ready(Err(LockError::Lost(
                        "this acquisition re-entered the lock of the request it was made in, \
                         and was awaited outside that request: make it where it is awaited"
                            .into(),
                    )));
                }
            }
            return Poll::Ready(decided);
        }
        let state = this
            .state
            .as_mut()
            .expect("LockFuture polled after completion");
        let acquire = &mut state.acquire;
        let result = match Pin::new(&mut *acquire).poll(cx) {
            Poll::Ready(r) => r,
            Poll::Pending => {
                let since = *state.waiting_since.get_or_insert_with(Instant::now);
                let deadline = match (state.deadline, state.wait) {
                    (Some(d), _) => d,
                    (None, Wait::Timeout(d)) => match since.checked_add(d) {
                        Some(deadline) => *state.deadline.insert(deadline),
                        // Too far to represent: as good as forever.
                        None => return Poll::Pending,
                    },
                    (None, Wait::FailFast | Wait::Forever) => return Poll::Pending,
                };
                if this.sleep.is_none() {
                    if tokio::runtime::Handle::try_current().is_err() {
                        let e = LockError::Config(
                            "waiting for a lock with a timeout needs a Tokio runtime with timers"
                                .into(),
                        );
                        return Poll::Ready(this.finish(Err(e)));
                    }
                    this.sleep = Some(Box::pin(tokio::time::sleep_until(deadline)));
                }
                let sleep = this.sleep.as_mut().expect("set above");
                ready!(sleep.as_mut().poll(cx));
                // A grant may have landed between the two polls: take it
                // rather than report a timeout and release it.
                match Pin::new(acquire).poll(cx) {
                    Poll::Ready(r) => r,
                    Poll::Pending => Err(LockError::Timeout {
                        waited: since.elapsed(),
                    }),
                }
            }
        };
        Poll::Ready(this.finish(result))
    }
}

impl LockFuture {
    /// The key, while the future has not completed.
    fn key(&self) -> Option<&LockKey> {
        match (&self.state, &self.decided) {
            (Some(state), _) => state.meta.key.as_ref(),
            (None, Some(Ok(guard))) => Some(guard.key()),
            (None, _) => None,
        }
    }

    /// Finishes the acquisition under way with the backend's `result`.
    fn finish(&mut self, result: Result<Acquired, LockError>) -> Result<LockGuard, LockError> {
        // Dropping the rest of the state drops a pending backend future:
        // that withdraws the request (the backend contract).
        let Acquiring {
            meta,
            waiting_since,
            ..
        } = self
            .state
            .take()
            .expect("LockFuture polled after completion");
        finish(meta, waiting_since, result)
    }
}

impl fmt::Debug for LockFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockFuture")
            .field("key", &self.key())
            .finish_non_exhaustive()
    }
}
