//! A local holder of a server grant, and how it lets go: to the next local
//! waiter, or back to the server (then, where the server keeps no queue,
//! after a hand-off to other processes).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use super::{watch_parked, Baton, KeptBack, ServerGrant, Shared};
use crate::backend::{Acquired, BackendFuture, LeaseHandle};
use crate::error::LockError;
use crate::loom::sync::atomic::Ordering;
use crate::loom::sync::Mutex;
use crate::mode::LockMode;
use crate::sync::lock;
use crate::Backend;

/// One local holder of a [`ServerGrant`] grant.
pub(super) struct CohortHold<B> {
    pub(super) shared: Arc<Shared<B>>,
    pub(super) remote: Arc<ServerGrant>,
    /// This holder's place in the local queue, given up after the release.
    pub(super) local: Mutex<Option<Acquired>>,
}

/// How a local holder lets go.
enum LetGo {
    /// Handed to the next local waiter.
    Passed,
    /// Back to the server; the next local waiter may go once the release is
    /// on the wire or once it is answered.
    Release(Arc<dyn LeaseHandle>, After),
    /// Nothing left to release.
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum After {
    Sent,
    /// Then [`hand_off`]; `lone`: no local waiter was queued for the lock
    /// as it was let go, and the store said it may hand off all the same.
    Answered {
        lone: bool,
    },
}

impl<B: Backend> CohortHold<B> {
    fn let_go(&self) -> LetGo {
        let (shared, r) = (&self.shared, &self.remote);
        let next = shared.local.next_in_line(&r.key);
        let passes = matches!(r.mode, LockMode::Exclusive | LockMode::Write);
        // Why the next local waiter, wanting the same mode, may not have it.
        let kept_back = (passes && next == Some(r.mode)).then(|| r.kept_back(&shared.options));
        if kept_back == Some(Some(KeptBack::NotSurelyFresh)) {
            tracing::debug!(
                target: "tower_lock::cohort",
                key = %r.key,
                "not handed to the next local waiter: the lease is not surely fresh"
            );
        }
        if kept_back == Some(None) {
            lock(&shared.batons).insert(r.key.clone(), Baton::Grant(r.clone()));
            if !r.watched.swap(true, Ordering::Relaxed) {
                watch_parked(shared, r);
            }
            // Grants the next waiter, which takes the baton.
            lock(&self.local).take();
            // It left meanwhile, or the lock was lost: nobody takes it back.
            if (shared.local.is_idle(&r.key) || r.lost.is_lost()) && shared.take_back(r) {
                r.release_on_drop();
            }
            return LetGo::Passed;
        }
        let Some(handle) = r.take_handle() else {
            return LetGo::Done;
        };
        // Without a server queue, this process's next acquire, sent as soon
        // as the release is, would land before anyone woken by the release
        // elsewhere: it waits for the answer instead, which is when those
        // others hear of the release too. So does the next to come where
        // the answer may ask for a hand-off.
        // A next acquire that waits in the server for the release may go
        // as soon as it is sent, on any connection.
        let caps = &shared.capabilities;
        let lone = !caps.fifo && next.is_none() && handle.may_hand_off();
        let after = if !caps.fifo && (next.is_some() || lone) {
            After::Answered { lone }
        } else if caps.ordered_release || caps.waits_in_server {
            After::Sent
        } else {
            After::Answered { lone: false }
        };
        LetGo::Release(handle, after)
    }

    /// Holds `local` (a queue position) until `release` is answered, in a
    /// task [`Backend::flush`] waits for.
    fn release_in_background(
        &self,
        handle: Arc<dyn LeaseHandle>,
        local: Option<Acquired>,
        lone: bool,
    ) {
        let release = handle.clone().release();
        let Some(rt) = self.shared.in_flight.runtime() else {
            drop(release);
            return;
        };
        let (shared, remote) = (self.shared.clone(), self.remote.clone());
        self.shared.in_flight.spawn(&rt, async move {
            if let Err(e) = release.await {
                tracing::warn!(error = %e, "lock release failed");
            }
            if let Some((wait, local)) = hand_off(&shared, &remote, &*handle, local, lone) {
                wait.await;
                drop(local);
            }
        });
    }

    /// Gives up `local`, this holder's place in the local queue, once
    /// [`hand_off`] allows.
    fn hand_off(&self, handle: &dyn LeaseHandle, local: Option<Acquired>, lone: bool) {
        let Some((wait, local)) = hand_off(&self.shared, &self.remote, handle, local, lone) else {
            return;
        };
        match self.shared.in_flight.runtime() {
            Some(rt) => self.shared.in_flight.spawn(&rt, async move {
                wait.await;
                drop(local);
            }),
            None => drop(local),
        }
    }
}

impl<B: Backend> LeaseHandle for CohortHold<B> {
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        let (handle, after) = match self.let_go() {
            LetGo::Passed | LetGo::Done => {
                lock(&self.local).take();
                return BackendFuture::ready(Ok(()));
            }
            LetGo::Release(handle, after) => (handle, after),
        };
        let mut release = handle.clone().release();
        if let Some(result) = release.take_ready() {
            lock(&self.local).take();
            return BackendFuture::ready(result);
        }
        BackendFuture::new(async move {
            match after {
                After::Sent => {
                    // Sent after one poll: the next local acquire, sent
                    // now, lands after it (ordered requests) or waits in
                    // the server for it (etcd's queue, `GET_LOCK`).
                    let first = poll_once(&mut release);
                    lock(&self.local).take();
                    match first {
                        Poll::Ready(result) => result,
                        Poll::Pending => release.await,
                    }
                }
                After::Answered { lone } => {
                    let result = release.await;
                    let local = lock(&self.local).take();
                    // The holder's release is done; its place in the local
                    // queue may be kept a while longer, in the background.
                    self.hand_off(&*handle, local, lone);
                    result
                }
            }
        })
    }

    fn release_on_drop(self: Arc<Self>) {
        let (handle, after) = match self.let_go() {
            LetGo::Passed | LetGo::Done => {
                lock(&self.local).take();
                return;
            }
            LetGo::Release(handle, after) => (handle, after),
        };
        let After::Answered { lone } = after else {
            // Returns once the release is on the wire.
            handle.release_on_drop();
            lock(&self.local).take();
            return;
        };
        let local = lock(&self.local).take();
        self.release_in_background(handle, local, lone);
    }

    fn valid_until(&self) -> Option<Instant> {
        lock(&self.remote.handle).as_ref()?.valid_until()
    }
}

/// What this process's next waiter for `key` waits for after a release
/// (holding `local`, the releasing holder's place in the queue, keeps it
/// waiting): nothing, unless waiters elsewhere heard the release
/// ([`LeaseHandle::hand_off`]). They ask for the lock as the answer comes,
/// and without a server queue the first to ask wins, which would nearly
/// always be the next waiter here, already running; so it waits for the
/// lock to come back instead, and processes take turns. Gives `local` up
/// at once where there is no wait (leaving the next holder here word that
/// it waited only for the answer, where the release was lone), else
/// returns it with the wait.
fn hand_off<B: Backend>(
    shared: &Shared<B>,
    remote: &ServerGrant,
    handle: &dyn LeaseHandle,
    local: Option<Acquired>,
    lone: bool,
) -> Option<(BackendFuture<()>, Acquired)> {
    let local = local?;
    let key = &remote.key;
    if !(lone || shared.local.next_in_line(key).is_some()) {
        return None;
    }
    match handle.hand_off() {
        Some(wait) => Some((wait, local)),
        // One holder at a time: the next one here is granted after the
        // word is left, and takes it. Of several readers, the others may
        // let go later, by another path, and leave it to nobody.
        None if lone && matches!(remote.mode, LockMode::Exclusive | LockMode::Write) => {
            shared.let_go_quietly(key, local);
            None
        }
        None => None,
    }
}

/// One poll, which puts a release on the wire.
fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    Pin::new(fut).poll(&mut Context::from_waker(std::task::Waker::noop()))
}
