//! [`BackendFuture`]: a result known at once, or a boxed future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The future a backend returns: a result known at once, or a boxed future.
///
/// The ready form lets a backend that can decide synchronously (the memory
/// backend, uncontended) skip a heap allocation per call.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tower_lock::backend::BackendFuture;
///
/// let mut now = BackendFuture::ready(1);
/// assert!(now.is_ready());
/// assert_eq!(now.take_ready(), Some(1));
///
/// let later = BackendFuture::new(async { 2 });
/// assert!(!later.is_ready());
/// assert_eq!(later.await, 2);
/// # }
/// ```
///
/// A backend that wraps another keeps the inner one's ready results ready.
/// This one counts grants; it forwards [`flush`](super::Backend::flush) and
/// [`instance_id`](super::Backend::instance_id) too, since its locks are the inner
/// backend's:
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use tower_lock::backend::{Acquired, BackendFuture, LockRequest};
/// use tower_lock::{Backend, BackendExt, LockError, MemoryBackend};
///
/// struct Counted<B> {
///     inner: B,
///     grants: Arc<AtomicU64>,
/// }
///
/// impl<B: Backend> Backend for Counted<B> {
///     fn name(&self) -> &'static str {
///         self.inner.name()
///     }
///
///     fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
///         let grants = self.grants.clone();
///         let count = move |result: &Result<Acquired, LockError>| {
///             if result.is_ok() {
///                 grants.fetch_add(1, Ordering::Relaxed);
///             }
///         };
///         let mut fut = self.inner.acquire(request);
///         if let Some(result) = fut.take_ready() {
///             count(&result);
///             return BackendFuture::ready(result);
///         }
///         BackendFuture::new(async move {
///             let result = fut.await;
///             count(&result);
///             result
///         })
///     }
///
///     fn flush(&self) -> BackendFuture<()> {
///         self.inner.flush()
///     }
///
///     fn instance_id(&self) -> usize {
///         self.inner.instance_id()
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), LockError> {
/// let grants = Arc::new(AtomicU64::new(0));
/// let backend = Counted { inner: MemoryBackend::new(), grants: grants.clone() };
/// backend.lock("a").await?.release().await?;
/// backend.lock("b").await?.release().await?;
/// assert_eq!(grants.load(Ordering::Relaxed), 2);
/// # Ok(()) }
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct BackendFuture<T>(Repr<T>);

enum Repr<T> {
    Ready(Option<T>),
    Boxed(Pin<Box<dyn Future<Output = T> + Send>>),
}

impl<T> BackendFuture<T> {
    /// A future that is already finished.
    pub fn ready(value: T) -> Self {
        BackendFuture(Repr::Ready(Some(value)))
    }

    /// Boxes `fut`.
    pub fn new(fut: impl Future<Output = T> + Send + 'static) -> Self {
        BackendFuture(Repr::Boxed(Box::pin(fut)))
    }

    /// Whether the future was made finished (and not yet taken).
    pub fn is_ready(&self) -> bool {
        matches!(self.0, Repr::Ready(Some(_)))
    }

    /// The value, if the future was made finished.
    pub fn take_ready(&mut self) -> Option<T> {
        match &mut self.0 {
            Repr::Ready(v) => v.take(),
            Repr::Boxed(_) => None,
        }
    }
}

// Never pins `T`: the ready value is moved out, the boxed future is pinned by
// its box.
impl<T> Unpin for BackendFuture<T> {}

impl<T> Future for BackendFuture<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.0 {
            Repr::Ready(v) => Poll::Ready(v.take().expect("BackendFuture polled after completion")),
            Repr::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl<T> fmt::Debug for BackendFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Repr::Ready(_) => "BackendFuture::Ready",
            Repr::Boxed(_) => "BackendFuture::Boxed",
        })
    }
}
