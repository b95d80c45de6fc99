//! [`RemoteBackend`]: the one [`Backend`] implementation of every remote
//! store, the [`Cohort`] in front of the store's acquire path.

use std::future::Future;
use std::sync::Arc;

use super::{Cohort, CohortOptions, InFlight};
use crate::Backend;
use crate::backend::{
    Acquired, BackendFuture, BreakScope, Broken, Capabilities, Inspection, LockRequest,
};
use crate::error::LockError;
use crate::key::LockKey;

/// What a remote store supplies to the engine: its acquire path. Each lock
/// it grants is a `Lease` of the store's `Protocol`, which renews and
/// releases it; the engine does the rest.
pub(crate) trait Store: Send + Sync + 'static {
    /// The backend's name ([`Backend::name`]).
    const NAME: &'static str;

    /// Takes one lock from the server, as [`Backend::acquire`] describes.
    fn acquire(
        self: Arc<Self>,
        request: LockRequest,
    ) -> impl Future<Output = Result<Acquired, LockError>> + Send + 'static;

    /// The releases it has sent and not yet seen answered.
    fn releases(&self) -> &Arc<InFlight>;

    /// What the store offers ([`Backend::capabilities`]), before cohorting.
    fn capabilities(&self) -> Capabilities;

    /// Who holds `key`, as [`Backend::inspect`] describes; by default not
    /// supported.
    fn inspect(
        self: Arc<Self>,
        key: LockKey,
    ) -> impl Future<Output = Result<Inspection, LockError>> + Send + 'static {
        let _ = key;
        std::future::ready(Err(LockError::Unsupported(format!(
            "the {} backend cannot inspect its locks",
            Self::NAME
        ))))
    }

    /// The held keys starting with `prefix`, as [`Backend::list`]
    /// describes; by default not supported.
    fn list(
        self: Arc<Self>,
        prefix: String,
    ) -> impl Future<Output = Result<Vec<LockKey>, LockError>> + Send + 'static {
        let _ = prefix;
        std::future::ready(Err(LockError::Unsupported(format!(
            "the {} backend cannot list its locks",
            Self::NAME
        ))))
    }

    /// Frees `key`, as [`Backend::break_lock`] describes; by default not
    /// supported.
    fn break_lock(
        self: Arc<Self>,
        key: LockKey,
        scope: BreakScope,
    ) -> impl Future<Output = Result<Broken, LockError>> + Send + 'static {
        let _ = (key, scope);
        std::future::ready(Err(LockError::Unsupported(format!(
            "the {} backend cannot break its locks",
            Self::NAME
        ))))
    }
}

/// A remote backend: the engine (the process's local queue and hand-off,
/// lease renewal, the lost signal, release and `flush`) in front of one
/// store. Every remote backend is one, named after its store:
/// `RedisBackend` is `RemoteBackend<RedisStore>`, and so on; each store's
/// module documents its backend, its options and what it guarantees.
///
/// Clones share the connections, the local queue and the locks.
pub struct RemoteBackend<S> {
    cohort: Cohort<Direct<S>>,
}

impl<S> Clone for RemoteBackend<S> {
    fn clone(&self) -> Self {
        RemoteBackend {
            cohort: self.cohort.clone(),
        }
    }
}

// Each method here is crate-private; `Store` is the crate's own.
#[allow(private_bounds)]
impl<S: Store> RemoteBackend<S> {
    /// The backend of `store`, cohorted as `cohort` says.
    pub(crate) fn new(store: S, cohort: CohortOptions) -> Self {
        RemoteBackend {
            cohort: Cohort::new(Direct(Arc::new(store)), cohort),
        }
    }

    /// The same store with another cohort bound: the locks it holds stay
    /// with the old bound's backend.
    #[cfg(feature = "redis")]
    pub(crate) fn recohorted(&self, cohort: CohortOptions) -> Self {
        RemoteBackend {
            cohort: Cohort::new(Direct(self.cohort.inner().0.clone()), cohort),
        }
    }

    /// The store behind the engine.
    pub(crate) fn store(&self) -> &S {
        &self.cohort.inner().0
    }

    /// How this process's waiters share a lock.
    pub(crate) fn cohort_options(&self) -> CohortOptions {
        self.cohort.options()
    }
}

impl<S: Store> Backend for RemoteBackend<S> {
    fn name(&self) -> &'static str {
        S::NAME
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        // The store's future inside the cohort's: one allocation per lock.
        self.cohort
            .acquire_with(request, |direct, request| direct.0.clone().acquire(request))
    }

    /// Also releases the locks passed on to local waiters that have not
    /// taken them yet (they acquire anew).
    fn flush(&self) -> BackendFuture<()> {
        self.cohort.flush()
    }

    fn instance_id(&self) -> usize {
        // Clones share the cohort and the connection, and so their locks.
        self.cohort.instance_id()
    }

    fn capabilities(&self) -> Capabilities {
        self.cohort.capabilities()
    }

    /// Asks the server: a lock this process's cohort passes between its
    /// waiters shows as the server holds it (the grant, its token).
    fn inspect(&self, key: LockKey) -> BackendFuture<Result<Inspection, LockError>> {
        BackendFuture::new(self.cohort.inner().0.clone().inspect(key))
    }

    fn list(&self, prefix: &str) -> BackendFuture<Result<Vec<LockKey>, LockError>> {
        BackendFuture::new(self.cohort.inner().0.clone().list(prefix.to_owned()))
    }

    fn break_lock(
        &self,
        key: LockKey,
        scope: BreakScope,
    ) -> BackendFuture<Result<Broken, LockError>> {
        BackendFuture::new(self.cohort.inner().0.clone().break_lock(key, scope))
    }
}

/// The store spoken to directly, each acquisition a request of its own: what
/// the cohort wraps.
struct Direct<S>(Arc<S>);

impl<S: Store> Backend for Direct<S> {
    fn name(&self) -> &'static str {
        S::NAME
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        BackendFuture::new(self.0.clone().acquire(request))
    }

    fn flush(&self) -> BackendFuture<()> {
        self.0.releases().flushed()
    }

    fn instance_id(&self) -> usize {
        Arc::as_ptr(&self.0).cast::<()>() as usize
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
}
