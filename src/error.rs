//! The errors of acquiring and releasing a lock.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::key::{KeyError, LockKey};
use crate::mode::LockMode;
use crate::redact::redact;

/// Boxed error from a backend's client library.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Why a lock could not be acquired or released.
///
/// No secret leaves through it: the userinfo of any URL in its text
/// (`redis://:password@host`) is shown as `***` by `Display` and `Debug`,
/// and so is it in the `Display` and `Debug` of every error of its
/// [`source`](StdError::source) chain, which holds the driver's errors as
/// text.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tower_lock::{BackendExt, LockError, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let _held = backend.lock("sku-1").await.unwrap();
/// match backend.lock("sku-1").fail_fast().await {
///     Err(LockError::Busy) => println!("someone else is on it; try later"),
///     Err(e) if e.is_retryable() => println!("try later: {e}"),
///     Err(e) => panic!("a bug or misconfiguration: {e}"),
///     Ok(_) => unreachable!("the key is held"),
/// }
/// # }
/// ```
#[non_exhaustive]
pub enum LockError {
    /// The key is not a valid [`LockKey`](crate::LockKey).
    InvalidKey(KeyError),
    /// The key was held and the wait policy was
    /// [`Wait::FailFast`](crate::Wait::FailFast).
    Busy,
    /// The key was still held when the wait ran out.
    Timeout {
        /// How long the acquisition waited.
        waited: Duration,
    },
    /// Refused without waiting, by admission control
    /// ([`Locker::max_waiters`](crate::Locker::max_waiters),
    /// [`Locker::predict_waits`](crate::Locker::predict_waits)): as many
    /// requests of this process as allowed already wait for the key, or
    /// the turns of those ahead are expected to outlast this one's wait.
    Refused {
        /// Requests of this process that were waiting for the key.
        waiting: u32,
        /// How long this one was expected to wait, when the key's turns
        /// had been measured: when to try again.
        expected_wait: Option<Duration>,
    },
    /// The mode cannot be used: zero semaphore permits, or a mode the backend
    /// does not implement.
    InvalidMode(String),
    /// The backend is misconfigured: an unknown URL, a feature not built.
    Config(String),
    /// The backend cannot do what was asked (inspect its locks, list
    /// them).
    Unsupported(String),
    /// The lock was lost while held (lease not renewed, session expired).
    Lost(String),
    /// The request being served already holds `key` in a mode that cannot
    /// share with the one asked for (a read lock, then a write lock):
    /// waiting would wait for itself. See
    /// [re-entrancy](crate::Locker#re-entrancy).
    Reentry {
        /// The key.
        key: LockKey,
        /// The mode the request holds it in.
        held: LockMode,
        /// The mode asked for.
        wanted: LockMode,
    },
    /// The backend could not be reached or answered with an error.
    Backend {
        /// Which backend, e.g. `redis`.
        backend: &'static str,
        /// What was being done.
        message: String,
        /// The client library's error, if any.
        source: Option<BoxError>,
    },
}

impl LockError {
    /// A backend failure, for backend implementations.
    pub fn backend(
        backend: &'static str,
        message: impl Into<String>,
        source: impl Into<Option<BoxError>>,
    ) -> Self {
        LockError::Backend {
            backend,
            message: message.into(),
            source: source
                .into()
                .map(|source| Box::new(Redacted::new(&*source)) as BoxError),
        }
    }

    /// Whether trying again later may succeed (busy, timeout, lock lost,
    /// backend down).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            LockError::Busy
                | LockError::Timeout { .. }
                | LockError::Refused { .. }
                | LockError::Lost(_)
                | LockError::Backend { .. }
        )
    }
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Text from configuration or a driver may hold a URL.
            LockError::InvalidMode(_)
            | LockError::Config(_)
            | LockError::Unsupported(_)
            | LockError::Lost(_)
            | LockError::Backend { .. } => {
                let mut text = String::new();
                fmt::write(&mut text, format_args!("{}", Unredacted(self)))?;
                f.write_str(&redact(&text))
            }
            _ => Unredacted(self).fmt(f),
        }
    }
}

impl fmt::Debug for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            LockError::InvalidKey(e) => format!("InvalidKey({e:?})"),
            LockError::Busy => "Busy".to_owned(),
            LockError::Timeout { waited } => format!("Timeout {{ waited: {waited:?} }}"),
            LockError::Refused {
                waiting,
                expected_wait,
            } => format!("Refused {{ waiting: {waiting}, expected_wait: {expected_wait:?} }}"),
            LockError::InvalidMode(m) => format!("InvalidMode({m:?})"),
            LockError::Config(m) => format!("Config({m:?})"),
            LockError::Unsupported(m) => format!("Unsupported({m:?})"),
            LockError::Lost(m) => format!("Lost({m:?})"),
            LockError::Reentry { key, held, wanted } => {
                format!("Reentry {{ key: {key:?}, held: {held:?}, wanted: {wanted:?} }}")
            }
            LockError::Backend {
                backend,
                message,
                source,
            } => format!(
                "Backend {{ backend: {backend:?}, message: {message:?}, source: {source:?} }}"
            ),
        };
        f.write_str(&redact(&text))
    }
}

/// The error's text as written, before [`redact`].
struct Unredacted<'a>(&'a LockError);

impl fmt::Display for Unredacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            LockError::InvalidKey(e) => write!(f, "invalid lock key: {e}"),
            LockError::Busy => f.write_str("lock is held by someone else"),
            LockError::Timeout { waited } => {
                write!(
                    f,
                    "timed out after {} ms waiting for the lock",
                    waited.as_millis()
                )
            }
            LockError::Refused {
                waiting,
                expected_wait,
            } => {
                let requests = if *waiting == 1 { "request" } else { "requests" };
                write!(
                    f,
                    "refused without waiting: {waiting} {requests} already waiting for the lock"
                )?;
                match expected_wait {
                    Some(d) => write!(f, ", expected to be free in {} ms", d.as_millis()),
                    None => Ok(()),
                }
            }
            LockError::InvalidMode(m) => write!(f, "invalid lock mode: {m}"),
            LockError::Config(m) => write!(f, "lock backend misconfigured: {m}"),
            LockError::Unsupported(m) => write!(f, "not supported: {m}"),
            LockError::Lost(reason) => write!(f, "lock lost: {reason}"),
            LockError::Reentry { key, held, wanted } => write!(
                f,
                "this request already holds the lock on {key:?} in {held} mode; \
                 taking it in {wanted} mode would wait for itself"
            ),
            LockError::Backend {
                backend,
                message,
                source,
            } => {
                write!(f, "{backend} lock backend unavailable: {message}")?;
                if let Some(source) = source {
                    write!(f, ": {source}")?;
                }
                Ok(())
            }
        }
    }
}

impl StdError for LockError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            LockError::InvalidKey(e) => Some(e),
            LockError::Backend {
                source: Some(s), ..
            } => Some(&**s),
            _ => None,
        }
    }
}

impl From<KeyError> for LockError {
    fn from(e: KeyError) -> Self {
        LockError::InvalidKey(e)
    }
}

/// A driver's error and its sources, as text without the userinfo of any
/// URL: taken once, when the error is made, so that its whole source chain
/// is redacted too (the driver's own types are not kept).
struct Redacted {
    display: String,
    debug: String,
    source: Option<Box<Redacted>>,
}

impl Redacted {
    fn new(error: &(dyn StdError + 'static)) -> Redacted {
        Redacted {
            display: redact(&error.to_string()).into_owned(),
            debug: redact(&format!("{error:?}")).into_owned(),
            source: error.source().map(|s| Box::new(Redacted::new(s))),
        }
    }
}

impl fmt::Display for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display)
    }
}

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.debug)
    }
}

impl StdError for Redacted {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn StdError + 'static))
    }
}
