//! Axum extractors: [`HeldLock`](crate::HeldLock), the lock the
//! [`LockLayer`](crate::LockLayer) took for this request, and
//! [`Locker`](crate::Locker), to take more locks inside a handler.

mod held_lock;
mod locker;

pub use held_lock::MissingLockExtension;
