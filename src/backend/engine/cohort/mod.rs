//! Lock cohorting: one process's waiters queue locally, only the head asks
//! the server, and a held lock passes between local waiters up to a bound.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::InFlight;
use crate::backend::{
    Acquired, BackendFuture, BreakScope, Broken, Capabilities, Inspection, LeaseHandle, LockRequest,
};
use crate::error::LockError;
use crate::key::LockKey;
use crate::loom::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use crate::loom::sync::Mutex;
use crate::lost::LostSignal;
use crate::mode::{LockMode, Wait};
use crate::sync::lock;
use crate::token::FencingToken;
use crate::{Backend, MemoryBackend};

mod hold;
mod options;
use hold::CohortHold;
pub use options::CohortOptions;

/// Lock cohorting in front of any [`Backend`] (Dice, Marathe and Shavit,
/// *Lock Cohorting*, PPoPP 2012).
///
/// Within the process, acquisitions of a key queue in arrival order, in
/// their [mode](LockMode) (readers share, a semaphore admits its permits),
/// and only the head of the queue asks the wrapped backend. When a holder of
/// an exclusive or write lock releases it while the next local waiter wants
/// the same, the lock is handed over without a round trip: the key never
/// free on the server in between, its lease and renewal carried on. Each
/// local holder still gets a fencing token of its own, the next of a block
/// the server grant reserved ([`LockRequest::tokens`]), so tokens keep
/// rising across holders here and elsewhere.
///
/// The lock goes back to the server when the local queue runs dry, when the
/// bound is reached ([`CohortOptions`]: so many holders, or so long since the
/// server granted it), or when its lease is no longer surely fresh: a lock
/// that may have expired on the server (a renewal late, the process paused)
/// is never handed on, nor one reported lost. Where the server does not
/// queue waiters ([`Capabilities::fifo`] false: Redis, the PostgreSQL lease
/// table), the next local waiter then waits for the release's answer before
/// it asks for the lock again (so does the next to come, where the store
/// [may hand off](LeaseHandle::may_hand_off) any release); and if the
/// answer says waiters in
/// other processes heard the release ([`LeaseHandle::hand_off`]), until
/// they have had their turn (or a short grace has passed), so that
/// processes take turns rather than race. ZooKeeper's queue is fair on its
/// own.
///
/// The remote backends use it unless told not to (`cohort(CohortOptions::off())`
/// in their options).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::backend::{Cohort, CohortOptions};
/// use tower_lock::{Backend, BackendExt, MemoryBackend};
///
/// // Any backend can be wrapped; the remote ones are, already.
/// let backend = Cohort::new(MemoryBackend::new(), CohortOptions::default());
/// let first = backend.lock("sku-1").await?;
/// let t = first.token();
/// drop(first);
/// assert!(backend.lock("sku-1").await?.token() > t);
/// # Ok(()) }
/// ```
pub struct Cohort<B> {
    shared: Arc<Shared<B>>,
}

impl<B> Clone for Cohort<B> {
    fn clone(&self) -> Self {
        Cohort {
            shared: self.shared.clone(),
        }
    }
}

impl<B: fmt::Debug> fmt::Debug for Cohort<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cohort")
            .field("backend", &self.shared.backend)
            .field("options", &self.shared.options)
            .finish_non_exhaustive()
    }
}

struct Shared<B> {
    backend: B,
    options: CohortOptions,
    capabilities: Capabilities,
    /// The local queue: only its head asks the backend.
    local: MemoryBackend,
    /// What a local holder left for the next one, by key.
    batons: Mutex<HashMap<LockKey, Baton>>,
    /// Releases this layer awaits itself (handing a lock back fairly).
    in_flight: Arc<InFlight>,
}

impl<B: Backend> Cohort<B> {
    /// Wraps `backend`.
    pub fn new(backend: B, options: CohortOptions) -> Self {
        let capabilities = backend.capabilities();
        Cohort {
            shared: Arc::new(Shared {
                backend,
                options,
                capabilities,
                local: MemoryBackend::new(),
                batons: Mutex::new(HashMap::new()),
                in_flight: Arc::default(),
            }),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.shared.backend
    }

    /// The bound it was made with.
    pub fn options(&self) -> CohortOptions {
        self.shared.options
    }
}

impl<B: Backend> Backend for Cohort<B> {
    fn name(&self) -> &'static str {
        self.shared.backend.name()
    }

    fn acquire(&self, request: LockRequest) -> BackendFuture<Result<Acquired, LockError>> {
        if !self.shared.options.enabled {
            // The wrapped backend's future as it is, not boxed again.
            return self.shared.backend.acquire(request);
        }
        self.acquire_with(request, |backend, request| backend.acquire(request))
    }

    /// Releases the locks left for local waiters that have not taken them
    /// yet (they acquire anew; word of a quiet release goes too), then
    /// waits for this layer's releases and the wrapped backend's.
    fn flush(&self) -> BackendFuture<()> {
        let parked: Vec<_> = lock(&self.shared.batons).drain().collect();
        for (_, baton) in parked {
            baton.release_on_drop();
        }
        let shared = self.shared.clone();
        BackendFuture::new(async move {
            shared.in_flight.idle().await;
            shared.backend.flush().await;
        })
    }

    fn instance_id(&self) -> usize {
        self.shared.backend.instance_id()
    }

    fn capabilities(&self) -> Capabilities {
        // Local grants take one token each.
        self.shared.capabilities.max_tokens(1)
    }

    // The store's view: a lock this cohort passes on shows as its grant.
    fn inspect(&self, key: LockKey) -> BackendFuture<Result<Inspection, LockError>> {
        self.shared.backend.inspect(key)
    }

    fn list(&self, prefix: &str) -> BackendFuture<Result<Vec<LockKey>, LockError>> {
        self.shared.backend.list(prefix)
    }

    fn break_lock(
        &self,
        key: LockKey,
        scope: BreakScope,
    ) -> BackendFuture<Result<Broken, LockError>> {
        self.shared.backend.break_lock(key, scope)
    }
}

impl<B: Backend> Cohort<B> {
    /// [`Backend::acquire`], with `remote` asking the wrapped backend: a
    /// backend that wraps its store itself (`RemoteBackend`) passes the
    /// store's own future, which then lives inside this one, where the
    /// wrapped backend's would be a second allocation per lock.
    pub(crate) fn acquire_with<F, R>(
        &self,
        request: LockRequest,
        remote: R,
    ) -> BackendFuture<Result<Acquired, LockError>>
    where
        F: Future<Output = Result<Acquired, LockError>> + Send + 'static,
        R: FnOnce(&B, LockRequest) -> F + Send + 'static,
    {
        if !self.shared.options.enabled {
            return BackendFuture::new(remote(&self.shared.backend, request));
        }
        BackendFuture::new(self.shared.clone().acquire(request, remote))
    }
}

impl<B: Backend> Shared<B> {
    async fn acquire<F, R>(
        self: Arc<Self>,
        request: LockRequest,
        remote: R,
    ) -> Result<Acquired, LockError>
    where
        F: Future<Output = Result<Acquired, LockError>> + Send + 'static,
        R: FnOnce(&B, LockRequest) -> F + Send + 'static,
    {
        // The core enforces a timed wait by dropping this future.
        let wait = match request.wait {
            Wait::FailFast => Wait::FailFast,
            _ => Wait::Forever,
        };
        let mut local = LocalWait {
            wait: self
                .local
                .acquire(LockRequest::new(request.key.clone(), request.mode).with_wait(wait)),
            unclaimed: Some(Unclaimed {
                shared: &self,
                key: &request.key,
            }),
            waited: false,
        };
        let granted = (&mut local).await;
        // Held or waited for here already: others want the key (a hint for
        // a store without a queue), unless the wait was only for the answer
        // to a release that asked for no hand-off (`Baton::Quiet`, below).
        let mut contended = !self.capabilities.fifo && local.waited;
        drop(local);
        let local = granted?;
        // No await from the local grant to here: a lock left for this key's
        // next local holder is ours to take.
        let baton = lock(&self.batons).remove(&request.key);
        match baton {
            Some(Baton::Grant(remote)) => {
                if remote.mode == request.mode
                    && remote.lease == request.lease
                    && remote.may_pass_on(&self.options)
                {
                    return Ok(self.grant(remote, local));
                }
                remote.release_on_drop();
            }
            // Waited here only for a release nobody else wanted.
            Some(Baton::Quiet) => contended = false,
            None => {}
        }
        let tokens = match request.mode {
            LockMode::Exclusive | LockMode::Write => {
                self.options.max_grants.min(self.capabilities.max_tokens)
            }
            _ => 1,
        };
        let (key, mode, lease) = (request.key.clone(), request.mode, request.lease);
        let request = request.with_tokens(tokens).with_contended(contended);
        let acquired = remote(&self.backend, request).await?;
        Ok(self.grant(
            Arc::new(ServerGrant::new(acquired, key, mode, lease)),
            local,
        ))
    }

    /// The next local holder of `remote`.
    fn grant(self: &Arc<Self>, remote: Arc<ServerGrant>, local: Acquired) -> Acquired {
        let n = remote.given.fetch_add(1, Ordering::Relaxed);
        let token = FencingToken::new(remote.first + u64::from(n));
        let lost = remote.lost.clone();
        let hold = Arc::new(CohortHold {
            shared: self.clone(),
            remote,
            local: Mutex::new(Some(local)),
        });
        Acquired::new(token, hold).with_lost(lost)
    }

    /// Takes `remote` back from the baton slot, if it is still there.
    fn take_back(&self, remote: &Arc<ServerGrant>) -> bool {
        let mut batons = lock(&self.batons);
        match batons.get(&remote.key) {
            Some(Baton::Grant(parked)) if Arc::ptr_eq(parked, remote) => {
                batons.remove(&remote.key);
                true
            }
            _ => false,
        }
    }

    /// Gives up `local` after a lone release whose answer asked for no
    /// hand-off (nobody elsewhere was known to want the key), telling the
    /// next holder here that it waited only for that answer: the key is
    /// not wanted, and its release need not wait for an answer before this
    /// process asks again.
    fn let_go_quietly(&self, key: &LockKey, local: Acquired) {
        lock(&self.batons)
            .entry(key.clone())
            .or_insert(Baton::Quiet);
        drop(local);
        // Nobody was waiting to take the mark.
        if self.local.is_idle(key) {
            let mut batons = lock(&self.batons);
            if matches!(batons.get(key), Some(Baton::Quiet)) {
                batons.remove(key);
            }
        }
    }
}

/// What a local holder leaves for the next local holder of its key.
enum Baton {
    /// A server grant to carry on.
    Grant(Arc<ServerGrant>),
    /// The lock went back to the server, and its answer asked for no
    /// hand-off: the next holder here waited only for that answer.
    Quiet,
}

impl Baton {
    fn release_on_drop(self) {
        if let Baton::Grant(remote) = self {
            remote.release_on_drop();
        }
    }
}

/// One grant from the wrapped backend, served to local holders in turn.
struct ServerGrant {
    /// The backend's hold; taken when the lock goes back to the server.
    handle: Mutex<Option<Arc<dyn LeaseHandle>>>,
    lost: LostSignal,
    key: LockKey,
    mode: LockMode,
    lease: Duration,
    /// The first reserved fencing token, and how many there are.
    first: u64,
    tokens: u32,
    /// Local holders served so far.
    given: AtomicU32,
    /// Set once a watch for it being left parked is running.
    watched: AtomicBool,
    /// When the server granted it: the time bound counts from here.
    granted_at: Instant,
    /// How long the lease was known valid when granted: a renewal on time
    /// keeps well over half of that ahead.
    validity: Option<Duration>,
}

impl ServerGrant {
    fn new(acquired: Acquired, key: LockKey, mode: LockMode, lease: Duration) -> ServerGrant {
        let granted_at = Instant::now();
        let validity = acquired
            .valid_until()
            .map(|v| v.saturating_duration_since(granted_at));
        let tokens = acquired.tokens();
        let (token, lost, handle) = acquired.into_parts();
        ServerGrant {
            handle: Mutex::new(Some(handle)),
            lost,
            key,
            mode,
            lease,
            first: token.get(),
            tokens,
            given: AtomicU32::new(0),
            watched: AtomicBool::new(false),
            granted_at,
            validity,
        }
    }

    /// Whether another local holder may have it without asking the server:
    /// tokens and time left, not lost, and the lease surely fresh.
    fn may_pass_on(&self, options: &CohortOptions) -> bool {
        self.kept_back(options).is_none()
    }

    /// Why another local holder may not have it, if it may not.
    fn kept_back(&self, options: &CohortOptions) -> Option<KeptBack> {
        if self.given.load(Ordering::Relaxed) >= self.tokens
            || self.granted_at.elapsed() >= options.max_hold
        {
            return Some(KeptBack::Bound);
        }
        if self.lost.is_lost() {
            return Some(KeptBack::Lost);
        }
        let handle = lock(&self.handle);
        let Some(handle) = handle.as_ref() else {
            return Some(KeptBack::Released);
        };
        match (handle.valid_until(), self.validity) {
            (Some(until), Some(validity))
                if until.saturating_duration_since(Instant::now()) > validity / 2 =>
            {
                None
            }
            (None, _) => None,
            _ => Some(KeptBack::NotSurelyFresh),
        }
    }

    fn take_handle(&self) -> Option<Arc<dyn LeaseHandle>> {
        lock(&self.handle).take()
    }

    /// Gives the lock back to the server from a destructor.
    fn release_on_drop(&self) {
        if let Some(handle) = self.take_handle() {
            handle.release_on_drop();
        }
    }
}

impl Drop for ServerGrant {
    fn drop(&mut self) {
        // Every path takes the handle first; this is the net under them.
        self.release_on_drop();
    }
}

/// Why a grant is not handed to the next local waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeptBack {
    /// Its tokens or its time ([`CohortOptions`]) are spent.
    Bound,
    Lost,
    /// Already on its way back to the server.
    Released,
    /// Less than half its lease's validity left: a renewal is late, or the
    /// process was paused. Logged at DEBUG (target `tower_lock::cohort`).
    NotSurelyFresh,
}

/// The wait for this process's queue of a key. Its fields drop in order: a
/// waiter that goes away after it was granted gives the grant back first,
/// and then a lock handed to it, with nobody left to take it, goes back to
/// the server.
struct LocalWait<'a, B: Backend> {
    wait: BackendFuture<Result<Acquired, LockError>>,
    unclaimed: Option<Unclaimed<'a, B>>,
    /// It was not granted at its first poll: the key was held or waited
    /// for here.
    waited: bool,
}

struct Unclaimed<'a, B: Backend> {
    shared: &'a Shared<B>,
    key: &'a LockKey,
}

impl<B: Backend> Future for LocalWait<'_, B> {
    type Output = Result<Acquired, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Poll::Ready(result) = Pin::new(&mut self.wait).poll(cx) else {
            self.waited = true;
            return Poll::Pending;
        };
        self.unclaimed = None;
        Poll::Ready(result)
    }
}

impl<B: Backend> Drop for Unclaimed<'_, B> {
    fn drop(&mut self) {
        if self.shared.local.is_idle(self.key) {
            let baton = lock(&self.shared.batons).remove(self.key);
            if let Some(baton) = baton {
                baton.release_on_drop();
            }
        }
    }
}

/// Gives `remote` back to the server if it is still parked when its time
/// bound ([`CohortOptions::max_hold`]) runs out. The waiter it was left for
/// may never run to take it (a lock future nobody polls any more), and
/// other processes must not wait on it for as long as it is renewed. One
/// timer per server grant, not per hand-off: past the bound it is never
/// parked again.
fn watch_parked<B: Backend>(shared: &Arc<Shared<B>>, remote: &Arc<ServerGrant>) {
    let Some(deadline) = remote.granted_at.checked_add(shared.options.max_hold) else {
        return;
    };
    // Off-runtime (a guard dropped on a blocking thread), the runtime the
    // cohort was made on keeps the watch.
    let Some(rt) = shared.in_flight.runtime() else {
        return;
    };
    let (shared, remote) = (Arc::downgrade(shared), Arc::downgrade(remote));
    rt.spawn(async move {
        tokio::time::sleep_until(deadline.into()).await;
        let (Some(shared), Some(remote)) = (shared.upgrade(), remote.upgrade()) else {
            return;
        };
        if shared.take_back(&remote) {
            tracing::debug!(key = %remote.key, "a lock left for a local waiter that never took it goes back to the server");
            remote.release_on_drop();
        }
    });
}

#[cfg(test)]
mod tests;
