//! Sabotage: a backend that breaks one promise on purpose. A run with it
//! must fail; that it does shows the checker can see that break (the
//! harness's negative controls, as `--no-lock` is the bench's).
//! `--sabotage NAME` wraps every client's backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tower_lock::backend::{Acquired, BackendFuture, Capabilities, LeaseHandle, LockRequest};
use tower_lock::{Backend, FencingToken, LockError};

/// How long an `ignore-lease` lock lasts: far below the workers' holds.
const EXPIRES_AFTER: Duration = Duration::from_millis(2);

/// The promise broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    /// The lock is released as soon as it is granted; the holder is not
    /// told.
    EarlyRelease,
    /// Every grant of a key carries the token of its first grant.
    SameToken,
    /// The holder is never told its lock was lost.
    NoLost,
    /// The lock is let go 2 ms after its grant, untold, as a lease far
    /// shorter than the hold, left to expire without renewal, would be.
    IgnoreLease,
}

impl Sabotage {
    pub const ALL: [Sabotage; 4] = [
        Sabotage::EarlyRelease,
        Sabotage::SameToken,
        Sabotage::NoLost,
        Sabotage::IgnoreLease,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Sabotage::EarlyRelease => "early-release",
            Sabotage::SameToken => "same-token",
            Sabotage::NoLost => "no-lost",
            Sabotage::IgnoreLease => "ignore-lease",
        }
    }

    pub fn parse(name: &str) -> Result<Sabotage, String> {
        Sabotage::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                let all: Vec<_> = Sabotage::ALL.iter().map(|s| s.name()).collect();
                format!("--sabotage: {name:?} is not one of {}", all.join(", "))
            })
    }
}

/// `inner`, with one promise broken.
pub struct Sabotaged {
    inner: Arc<dyn Backend>,
    how: Sabotage,
    /// Each key's first token (`SameToken`).
    first: Arc<Mutex<HashMap<String, FencingToken>>>,
}

impl Sabotaged {
    pub fn wrap(inner: Arc<dyn Backend>, how: Option<Sabotage>) -> Arc<dyn Backend> {
        match how {
            None => inner,
            Some(how) => Arc::new(Sabotaged {
                inner,
                how,
                first: Arc::default(),
            }),
        }
    }
}

/// Holds the real lock until released (or dropped).
struct Keep(Mutex<Option<Acquired>>);

impl Keep {
    fn new(acquired: Option<Acquired>) -> Arc<Keep> {
        Arc::new(Keep(Mutex::new(acquired)))
    }

    fn let_go(&self) {
        let taken = self.0.lock().unwrap().take();
        drop(taken);
    }
}

impl LeaseHandle for Keep {
    fn release(self: Arc<Self>) -> BackendFuture<Result<(), LockError>> {
        self.let_go();
        BackendFuture::ready(Ok(()))
    }
}

impl Backend for Sabotaged {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        let (how, first) = (self.how, self.first.clone());
        let key = request.key.as_str().to_owned();
        let granted = self.inner.acquire(request);
        BackendFuture::new(async move {
            let real = granted.await?;
            let (token, lost) = (real.token(), real.lost().clone());
            Ok(match how {
                Sabotage::EarlyRelease => {
                    drop(real);
                    Acquired::new(token, Keep::new(None))
                }
                Sabotage::SameToken => {
                    let token = *first.lock().unwrap().entry(key).or_insert(token);
                    Acquired::new(token, Keep::new(Some(real))).with_lost(lost)
                }
                Sabotage::NoLost => Acquired::new(token, Keep::new(Some(real))),
                Sabotage::IgnoreLease => {
                    let keep = Keep::new(Some(real));
                    let later = keep.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(EXPIRES_AFTER).await;
                        later.let_go();
                    });
                    Acquired::new(token, keep)
                }
            })
        })
    }

    fn flush(&self) -> BackendFuture<()> {
        self.inner.flush()
    }

    fn instance_id(&self) -> usize {
        self.inner.instance_id()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}
