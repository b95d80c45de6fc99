//! The one way this crate takes its `std` mutexes.

use crate::loom::sync::{Mutex, MutexGuard};

/// Locks `m`, poisoned or not.
///
/// Nothing this crate does while holding one of its locks should panic, but
/// a panic there (in a waker, a user's hook) must not turn into a second
/// panic in every later caller: the key, session or lease behind the lock
/// would then never be released. The data is still consistent: every
/// critical section leaves it valid at each step.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
