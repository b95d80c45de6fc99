//! loom models of the in-process core: each explores every interleaving of
//! a few threads (up to a preemption bound) and fails on any in which the
//! property named by the test's name does not hold, or a thread waits for
//! a wake-up that never comes (loom reports a deadlock).
//!
//! - `lost`: the lost signal firing against a waiter subscribing and checking.
//! - `memory`: the memory backend's acquire, release and cancelled wait on
//!   one key.
//! - `cohort`: the cohort's hand-off racing the lost signal and a newly
//!   arriving waiter.

pub mod cohort;
pub mod lost;
pub mod memory;

use std::future::Future;
use std::task::{Context, Poll};

use crate::backend::LockRequest;
use crate::key::LockKey;
use crate::mode::{LockMode, Wait};

/// The models' bound on preemptions: every bug loom's authors report is
/// found within two or three, and the state space stays small enough for
/// the test command.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

fn key() -> LockKey {
    LockKey::new("k").expect("a valid key")
}

fn exclusive(wait: Wait) -> LockRequest {
    LockRequest::new(key(), LockMode::Exclusive).with_wait(wait)
}

/// Polls `fut` once, with a waker that does nothing.
fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    std::pin::Pin::new(fut).poll(&mut Context::from_waker(std::task::Waker::noop()))
}
