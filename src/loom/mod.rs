//! The synchronisation types of the in-process core, swapped for loom's
//! under `--cfg loom` (as tokio's `src/loom/` does), so that the models in
//! `src/loom/models/` can explore every interleaving of the lost signal,
//! the memory backend and the cohort.
//!
//! Swapped: mutexes and atomics, the places where threads meet. Not
//! swapped: `Arc`. loom's cannot be coerced to a trait object (the core
//! hands out `Arc<dyn HasLostState>` and `Arc<dyn LeaseHandle>`), so
//! reference counts are std's and go unpermuted; the memory backend's reuse
//! of a hold rests on `Arc::get_mut`, whose answer std guarantees.
//!
//! The models are public functions (hidden), run as tests by the
//! `tower-lock-loom` workspace member:
//! `RUSTFLAGS="--cfg loom" cargo test -p tower-lock-loom --release`. This
//! package's own tests cannot run them: its dev-dependencies do not build
//! under `--cfg loom`. The remote backends are not built there either:
//! their drivers are not modelled.

#[cfg(loom)]
pub mod models;

pub(crate) mod sync {
    #[cfg(loom)]
    pub(crate) use loom::sync::{Mutex, MutexGuard};
    #[cfg(not(loom))]
    pub(crate) use std::sync::{Mutex, MutexGuard};

    pub(crate) mod atomic {
        #[cfg(loom)]
        pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, Ordering};
        #[cfg(not(loom))]
        pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    }
}
