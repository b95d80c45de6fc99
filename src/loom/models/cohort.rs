//! The cohort's hand-off: a holder letting go parks the server's grant for
//! the next local waiter (a baton) and grants that waiter locally; the
//! waiter takes the baton if the grant is still fresh and not lost. Racing
//! it: the server revoking the grant (its lost signal fires and the key is
//! free on the server), and a waiter arriving as it happens.

use std::sync::Arc;

use super::{exclusive, model};
use crate::backend::{Acquired, BackendFuture, Capabilities, Cohort, CohortOptions, LockRequest};
use crate::error::LockError;
use crate::loom::sync::atomic::{AtomicU32, Ordering};
use crate::mode::Wait;
use crate::token::FencingToken;
use crate::{Backend, MemoryBackend};

/// A server that reserves a block of tokens per grant, as the remote
/// backends do, so that the cohort hands the lock on: the memory backend's
/// locks with tokens spaced 64 apart.
#[derive(Clone)]
struct Server(MemoryBackend);

impl Backend for Server {
    fn name(&self) -> &'static str {
        "model"
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        let tokens = request.tokens;
        let grant = self.0.acquire(request);
        BackendFuture::new(async move {
            let (token, lost, handle) = grant.await?.into_parts();
            Ok(Acquired::new(FencingToken::new(token.get() * 64), handle)
                .with_lost(lost)
                .with_tokens(tokens))
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().max_tokens(64).fifo(true)
    }
}

/// A holder through the cohort: checks that it is alone, and that no other
/// process could take the key from the server while it believes it holds
/// it (unless it has been told it lost it).
fn hold(held: &Acquired, server: &MemoryBackend, inside: &AtomicU32) {
    assert_eq!(
        inside.fetch_add(1, Ordering::SeqCst),
        0,
        "two local holders at once"
    );
    let elsewhere = loom::future::block_on(server.acquire(exclusive(Wait::FailFast)));
    if elsewhere.is_ok() {
        assert!(
            held.lost().is_lost(),
            "another process took the key while its holder here was not told it was lost"
        );
    }
    drop(elsewhere);
    inside.fetch_sub(1, Ordering::SeqCst);
}

/// A holder lets go while a local waiter is queued, another waiter arrives
/// and the server revokes the grant, in any order: at most one local holder
/// at a time; a holder that is not told its lock was lost is the only
/// holder on the server too; every waiter is granted; tokens rise; and once
/// all have gone, neither the server nor the local queue keeps an entry.
pub fn a_hand_off_racing_a_revocation_and_a_new_waiter_keeps_exclusion() {
    model(|| {
        let server = MemoryBackend::new();
        let cohort = Cohort::new(Server(server.clone()), CohortOptions::default());
        let inside = Arc::new(AtomicU32::new(0));
        let first =
            loom::future::block_on(cohort.acquire(exclusive(Wait::Forever))).expect("a free key");
        let first_token = first.token();

        let waiter = |cohort: Cohort<Server>, server: MemoryBackend, inside: Arc<AtomicU32>| {
            move || {
                let held = loom::future::block_on(cohort.acquire(exclusive(Wait::Forever)))
                    .expect("granted");
                hold(&held, &server, &inside);
                let token = held.token();
                drop(held);
                token
            }
        };
        let queued = loom::thread::spawn(waiter(cohort.clone(), server.clone(), inside.clone()));
        let arriving = loom::thread::spawn(waiter(cohort.clone(), server.clone(), inside.clone()));
        let revoking = loom::thread::spawn({
            let server = server.clone();
            move || {
                server.break_lock("k");
            }
        });

        hold(&first, &server, &inside);
        drop(first);
        let tokens = [queued.join().unwrap(), arriving.join().unwrap()];
        revoking.join().unwrap();
        assert!(
            tokens.iter().all(|t| *t > first_token),
            "tokens went backwards"
        );
        assert_ne!(tokens[0], tokens[1], "one token for two holders");
        assert_eq!(server.active_keys(), 0, "the server kept the key");
        drop(cohort);
    });
}
