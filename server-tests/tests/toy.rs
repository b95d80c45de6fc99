//! The toy backend of the backend author's guide (`examples/toy-backend`,
//! written as a third party would) under the conformance suite, and the
//! suite's negative controls: the same backend made to break the contract
//! one way at a time, each caught.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::contract::{InProcess, KeysKept};
use tower_lock::backend::{Acquired, BackendFuture, Capabilities, LeaseHandle, LockRequest};
use tower_lock::{Backend, FencingToken, LockError, LockKey};
use toy_backend::ToyBackend;

impl KeysKept for ToyBackend {
    fn keys_kept(&self) -> usize {
        self.keys()
    }

    fn inspects(&self) -> bool {
        false
    }
}

mod conformance {
    use crate::common::contract::InProcess;
    crate::common::contract::conformance!(InProcess(toy_backend::ToyBackend::new()));
}

// ---- negative controls ------------------------------------------------

/// One way to break the contract.
#[derive(Clone, Copy)]
enum Flaw {
    /// Every grant on a key of its own: no exclusion.
    GrantsTwice,
    /// Tokens that fall from grant to grant.
    TokensFall,
    /// A release that never gives the lock back.
    NeverReleases,
}

/// The toy backend with one flaw.
#[derive(Clone)]
struct Sabotaged {
    toy: ToyBackend,
    flaw: Flaw,
    grants: Arc<AtomicU64>,
}

impl Sabotaged {
    fn new(flaw: Flaw) -> InProcess<Sabotaged> {
        InProcess(Sabotaged {
            toy: ToyBackend::new(),
            flaw,
            grants: Arc::default(),
        })
    }
}

impl KeysKept for Sabotaged {
    fn keys_kept(&self) -> usize {
        self.toy.keys()
    }

    fn inspects(&self) -> bool {
        false
    }
}

/// A grant wrapped with another token, or kept forever.
struct Wrapped(Mutex<Option<Acquired>>, bool);

impl LeaseHandle for Wrapped {
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        let inner = self.0.lock().unwrap().take();
        if self.1 {
            // Never given back.
            std::mem::forget(inner);
        }
        BackendFuture::ready(Ok(()))
    }
}

impl Backend for Sabotaged {
    fn name(&self) -> &'static str {
        "sabotaged"
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        let n = self.grants.fetch_add(1, Ordering::Relaxed);
        let request = match self.flaw {
            Flaw::GrantsTwice => {
                let key = LockKey::new(&format!("{}-{n}", request.key.as_str())).unwrap();
                LockRequest::new(key, request.mode).with_wait(request.wait)
            }
            _ => request,
        };
        let flaw = self.flaw;
        let inner = self.toy.acquire(request);
        BackendFuture::new(async move {
            let acquired = inner.await?;
            let token = match flaw {
                Flaw::TokensFall => FencingToken::new(u64::MAX / 2 - n),
                _ => acquired.token(),
            };
            let keep = matches!(flaw, Flaw::NeverReleases);
            let handle = Wrapped(Mutex::new(Some(acquired)), keep);
            Ok(Acquired::new(token, Arc::new(handle)))
        })
    }

    fn instance_id(&self) -> usize {
        self.toy.instance_id()
    }

    fn capabilities(&self) -> Capabilities {
        self.toy.capabilities()
    }
}

#[test]
#[should_panic(expected = "two holders")]
fn the_suite_catches_a_backend_that_grants_a_held_key() {
    common::contract::excludes_across_processes_with_rising_tokens(&Sabotaged::new(
        Flaw::GrantsTwice,
    ));
}

#[test]
#[should_panic(expected = "tokens not increasing")]
fn the_suite_catches_tokens_that_fall() {
    common::contract::excludes_across_processes_with_rising_tokens(&Sabotaged::new(
        Flaw::TokensFall,
    ));
}

#[test]
#[should_panic(expected = "still held")]
fn the_suite_catches_a_release_that_frees_nothing() {
    common::contract::every_end_of_a_request_releases_its_lock(&Sabotaged::new(
        Flaw::NeverReleases,
    ));
}
