//! The cohort's bounds, deterministic: a scripted server whose grants say
//! how long they are valid, and paused Tokio time, so that every case
//! happens the same way each run.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Cohort, CohortOptions};
use crate::backend::{Acquired, BackendFuture, Capabilities, LeaseHandle, LockRequest};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::{LockMode, Wait};
use crate::sync::lock;
use crate::token::FencingToken;
use crate::{Backend, MemoryBackend};

/// A server: the memory backend's locks, each reserving the block of tokens
/// asked for (64 apart), and valid until a moment the test sets, as a
/// lease renewed late would be.
#[derive(Clone, Default)]
struct Server {
    locks: MemoryBackend,
    grants: Arc<AtomicU32>,
    /// The moment the current grant is valid until: 10 s after it was made,
    /// unless the test moves it (as a late renewal would).
    validity: Arc<Mutex<Option<Instant>>>,
    /// A server with no queue of waiters, whose releases others heard: a hand-off then lasts this long.
    turns: Option<Duration>,
    /// Its releases may be handed off, but nobody elsewhere hears them:
    /// their answers ask for no hand-off.
    unheard: bool,
    /// If set, how many more releases may be handed off (the rest may not,
    /// as the lease table's uncontended ones).
    hand_offs: Option<Arc<AtomicU32>>,
    /// Whether the last request came with [`LockRequest::contended`].
    contended: Arc<std::sync::atomic::AtomicBool>,
}

const VALIDITY: Duration = Duration::from_secs(10);

struct Lease {
    inner: Mutex<Option<Acquired>>,
    until: Arc<Mutex<Option<Instant>>>,
    turns: Option<Duration>,
    unheard: bool,
    hand_offs: Option<Arc<AtomicU32>>,
}

impl LeaseHandle for Lease {
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        self.inner.lock().unwrap().take();
        if self.turns.is_none() {
            return BackendFuture::ready(Ok(()));
        }
        // Answered later, as a server's release is.
        BackendFuture::new(async {
            tokio::task::yield_now().await;
            Ok(())
        })
    }

    fn valid_until(&self) -> Option<Instant> {
        *self.until.lock().unwrap()
    }

    fn hand_off(&self) -> Option<BackendFuture<()>> {
        let turn = self.turns.filter(|_| !self.unheard)?;
        Some(BackendFuture::new(tokio::time::sleep(turn)))
    }

    fn may_hand_off(&self) -> bool {
        let more = |left: &Arc<AtomicU32>| {
            left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        };
        self.turns.is_some() && self.hand_offs.as_ref().is_none_or(more)
    }
}

impl Backend for Server {
    fn name(&self) -> &'static str {
        "scripted"
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        let tokens = request.tokens;
        self.contended.store(request.contended, Ordering::SeqCst);
        let grant = self.locks.acquire(request);
        let (grants, until, turns, unheard) = (
            self.grants.clone(),
            self.validity.clone(),
            self.turns,
            self.unheard,
        );
        let hand_offs = self.hand_offs.clone();
        BackendFuture::new(async move {
            let acquired = grant.await?;
            grants.fetch_add(1, Ordering::SeqCst);
            *until.lock().unwrap() = Some(Instant::now() + VALIDITY);
            let (token, lost) = (acquired.token(), acquired.lost().clone());
            let lease = Arc::new(Lease {
                inner: Mutex::new(Some(acquired)),
                until,
                turns,
                unheard,
                hand_offs,
            });
            Ok(Acquired::new(FencingToken::new(token.get() * 64), lease)
                .with_lost(lost)
                .with_tokens(tokens))
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .max_tokens(64)
            .fifo(self.turns.is_none())
            // As the PostgreSQL lease table: the next acquire of a key
            // lands after a release sent (so it would go at once).
            .ordered_release(self.turns.is_some())
    }
}

fn key() -> LockKey {
    LockKey::new("k").unwrap()
}

fn request() -> LockRequest {
    LockRequest::new(key(), LockMode::Exclusive).with_wait(Wait::Forever)
}

/// Queues `n` local waiters behind the current holder; each returns its
/// grant's token and whether it was already lost, and lets go.
async fn queue(
    cohort: &Cohort<Server>,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(FencingToken, bool)>> {
    let mut waiters = Vec::new();
    for i in 0..n {
        let backend = cohort.clone();
        waiters.push(tokio::spawn(async move {
            let held = backend.acquire(request()).await.expect("granted");
            (held.token(), held.lost().is_lost())
        }));
        while cohort.shared.local.queued("k") < i + 1 {
            tokio::task::yield_now().await;
        }
    }
    waiters
}

async fn tokens(waiters: Vec<tokio::task::JoinHandle<(FencingToken, bool)>>) -> Vec<u64> {
    let mut out = Vec::new();
    for w in waiters {
        let (token, lost) = w.await.unwrap();
        assert!(!lost, "a waiter was handed a lock already lost");
        out.push(token.get());
    }
    out
}

#[tokio::test(start_paused = true)]
async fn one_server_grant_serves_at_most_the_bound_of_holders() {
    let server = Server::default();
    let cohort = Cohort::new(server.clone(), CohortOptions::default().max_grants(3));
    let first = cohort.acquire(request()).await.unwrap();
    let waiters = queue(&cohort, 5).await;
    let first_token = first.token().get();
    drop(first);
    let tokens = tokens(waiters).await;
    // Six holders, three per grant: the fourth asked the server again.
    assert_eq!(server.grants.load(Ordering::SeqCst), 2);
    assert_eq!(
        &tokens[..2],
        &[first_token + 1, first_token + 2],
        "not consecutive within a grant"
    );
    assert!(
        tokens[2] >= first_token + 64,
        "the fourth holder had no grant of its own"
    );
    assert_eq!(server.locks.active_keys(), 0, "the server kept the key");
}

#[tokio::test(start_paused = true)]
async fn no_holder_after_the_time_bound() {
    let server = Server::default();
    let cohort = Cohort::new(
        server.clone(),
        CohortOptions::default().max_hold(Duration::ZERO),
    );
    let first = cohort.acquire(request()).await.unwrap();
    let waiters = queue(&cohort, 2).await;
    drop(first);
    tokens(waiters).await;
    assert_eq!(
        server.grants.load(Ordering::SeqCst),
        3,
        "a holder was served past the time bound"
    );
}

/// The server grants two holders take when the first lets go with `left`
/// of the lease's 10 s of validity still ahead (a renewal late, or on time).
async fn grants_with_validity_left(left: Duration) -> u32 {
    let server = Server::default();
    let cohort = Cohort::new(server.clone(), CohortOptions::default());
    let first = cohort.acquire(request()).await.unwrap();
    let waiters = queue(&cohort, 1).await;
    *server.validity.lock().unwrap() = Some(Instant::now() + left);
    drop(first);
    tokens(waiters).await;
    server.grants.load(Ordering::SeqCst)
}

#[tokio::test(start_paused = true)]
async fn a_lease_with_less_than_half_its_validity_left_is_not_handed_on() {
    let grants = grants_with_validity_left(Duration::from_secs(4)).await;
    assert_eq!(grants, 2, "a stale lease was handed on");
}

#[tokio::test(start_paused = true)]
async fn a_lease_with_more_than_half_its_validity_left_is_handed_on() {
    let grants = grants_with_validity_left(Duration::from_secs(6)).await;
    assert_eq!(grants, 1, "a fresh lease went back to the server");
}

#[tokio::test(start_paused = true)]
async fn a_lock_lost_before_the_hand_off_goes_back_to_the_server() {
    let server = Server::default();
    let cohort = Cohort::new(server.clone(), CohortOptions::default());
    let first = cohort.acquire(request()).await.unwrap();
    let waiters = queue(&cohort, 1).await;
    server.locks.break_lock("k");
    assert!(first.lost().is_lost());
    drop(first);
    // The waiter got a grant of its own, not the lost one.
    let tokens = tokens(waiters).await;
    assert_eq!(
        server.grants.load(Ordering::SeqCst),
        2,
        "a lost lock was handed on"
    );
    assert!(
        tokens[0] >= 128,
        "the waiter's token is from the lost grant"
    );
}

/// A holder dropped where no runtime runs (a blocking thread) hands its lock
/// to a local waiter whose task never runs again: the lock still goes back
/// to the server once the time bound has passed, so that other processes
/// do not wait on it for as long as it is renewed.
#[tokio::test(start_paused = true)]
async fn a_lock_parked_off_runtime_for_a_waiter_that_never_runs_goes_back() {
    let server = Server::default();
    let cohort = Cohort::new(server.clone(), CohortOptions::default());
    let first = cohort.acquire(request()).await.unwrap();
    // Queued, then never polled again (a task stuck elsewhere).
    let mut stuck = cohort.acquire(request());
    let noop = &mut std::task::Context::from_waker(std::task::Waker::noop());
    assert!(std::pin::Pin::new(&mut stuck).poll(noop).is_pending());
    std::thread::spawn(move || drop(first)).join().unwrap();
    tokio::time::sleep(CohortOptions::DEFAULT_MAX_HOLD * 2).await;
    let elsewhere = server
        .locks
        .acquire(LockRequest::new(key(), LockMode::Exclusive).with_wait(Wait::FailFast));
    assert!(
        elsewhere.await.is_ok(),
        "the lock parked for a waiter that never ran was kept from other processes"
    );
    drop(stuck);
}

/// Without a server queue, a holder that locks the key again at once (no
/// local waiter when it let go: one worker) waits for the hand-off its
/// store may ask for, as a queued waiter would; where none is asked for,
/// it does not.
#[tokio::test(start_paused = true)]
async fn the_next_acquire_after_a_release_heard_elsewhere_waits_for_the_hand_off() {
    let heard = Some(Duration::from_millis(50));
    for (turns, awaited, waited) in [
        (heard, false, true),
        (heard, true, true),
        (None, false, false),
        (None, true, false),
    ] {
        let server = Server {
            turns,
            ..Server::default()
        };
        let cohort = Cohort::new(server, CohortOptions::default());
        let held = cohort.acquire(request()).await.unwrap();
        assert_eq!(cohort.shared.local.queued("k"), 0);
        // Idle here when asked for: not told it is wanted.
        assert!(!cohort.inner().contended.load(Ordering::SeqCst));
        // Dropped (the release goes on in the background), or released
        // and answered before the next acquire is made.
        let (_, _, handle) = held.into_parts();
        if awaited {
            handle.release().await.unwrap();
        } else {
            handle.release_on_drop();
        }
        let start = tokio::time::Instant::now();
        let again = cohort.acquire(request()).await.unwrap();
        assert_eq!(start.elapsed() >= Duration::from_millis(50), waited);
        // Queued behind the hand-off here: told the store it is wanted
        // (asked only where the server keeps no queue).
        assert_eq!(cohort.inner().contended.load(Ordering::SeqCst), waited);
        drop(again);
        cohort.flush().await;
    }
}

/// A release nobody elsewhere heard hands nothing off. The holder that
/// locks the key again right behind it waited here only for that answer,
/// so it does not tell the store the key is wanted: else a key contended
/// once would keep costing each release a round trip while one worker
/// locks it again and again. A waiter queued behind a holder still does.
#[tokio::test(start_paused = true)]
async fn a_waiter_behind_a_release_nobody_heard_is_not_told_the_key_is_wanted() {
    for heard in [false, true] {
        let server = Server {
            turns: Some(Duration::from_millis(50)),
            unheard: !heard,
            ..Server::default()
        };
        // Every holder asks the server.
        let cohort = Cohort::new(server, CohortOptions::default().max_grants(1));
        for _ in 0..3 {
            let held = cohort.acquire(request()).await.unwrap();
            let (_, _, handle) = held.into_parts();
            handle.release_on_drop();
            // Queued behind the release going on in the background.
            tokens(queue(&cohort, 1).await).await;
            assert_eq!(cohort.inner().contended.load(Ordering::SeqCst), heard);
            // The word was taken, and nothing is left for nobody.
            cohort.shared.in_flight.idle().await;
            assert!(lock(&cohort.shared.batons).is_empty());
            cohort.flush().await;
        }
        let held = cohort.acquire(request()).await.unwrap();
        let waiter = queue(&cohort, 1).await;
        drop(held);
        tokens(waiter).await;
        assert!(cohort.inner().contended.load(Ordering::SeqCst));
        cohort.flush().await;
    }
}

/// Readers hold a key together: one that lets go quietly leaves no word
/// for a next holder that may never come (the last reader may let go by a
/// path that does not look).
#[tokio::test(start_paused = true)]
async fn readers_letting_go_quietly_leave_nothing_behind() {
    let server = Server {
        turns: Some(Duration::from_millis(50)),
        unheard: true,
        // The first reader's release may be handed off; the second's not.
        hand_offs: Some(Arc::new(AtomicU32::new(1))),
        ..Server::default()
    };
    let cohort = Cohort::new(server, CohortOptions::default().max_grants(1));
    let read = || LockRequest::new(key(), LockMode::Read).with_wait(Wait::Forever);
    let first = cohort.acquire(read()).await.unwrap();
    let second = cohort.acquire(read()).await.unwrap();
    drop(first);
    cohort.shared.in_flight.idle().await;
    drop(second);
    cohort.shared.in_flight.idle().await;
    assert!(cohort.shared.local.is_idle(&key()));
    assert!(
        lock(&cohort.shared.batons).is_empty(),
        "a word left for nobody"
    );
    cohort.flush().await;
}
