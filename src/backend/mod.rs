//! The backend abstraction: what a lock store must do, and nothing more.
//!
//! A [`Backend`] acquires one key in one [`LockMode`]; everything else (keys
//! from requests, timeouts, several keys at once, tracing, HTTP) is built once,
//! on top, by [`Locker`](crate::Locker), [`BackendExt`](crate::BackendExt) and
//! [`LockLayer`](crate::LockLayer).
//!
//! # Why the trait is object safe
//!
//! Services pick their backend at run time (`--backend redis://...`), and the
//! layer, the extractors and the guards should have one type whichever store
//! is behind them: `LockLayer`, not `LockLayer<RedisBackend<...>>`. So
//! [`Backend::acquire`] returns a [`BackendFuture`]: a finished result when the
//! backend could decide at once (the memory backend's uncontended path, which
//! then allocates no future), a boxed future otherwise. A network round trip
//! costs a thousand times more than that box, so remote backends lose nothing.
//!
//! # Contract for implementors
//!
//! - `acquire` may start work eagerly; dropping the returned future, or the
//!   [`Acquired`] it produced, must undo everything: leave the wait queue, delete
//!   the half-made node, release the granted lock. The core relies on that for
//!   timeouts and for clients that go away.
//! - With [`Wait::FailFast`], answer
//!   [`LockError::Busy`] after one attempt. Otherwise wait until granted; the
//!   core enforces [`LockRequest::wait`] by dropping the future, and a backend
//!   may use it to bound its own re-checks.
//! - Every grant gets a [`FencingToken`] strictly greater than the previous
//!   grant's of the same key. A grant asked for [`LockRequest::tokens`] may
//!   reserve that many consecutive tokens (say how many with
//!   [`Acquired::with_tokens`]): all of them greater than any earlier grant's
//!   and smaller than any later grant's.
//! - A lease that the backend cannot keep fires the [`LostTrigger`]
//!   behind [`Acquired::with_lost`], promptly and before the lease would let
//!   anyone else in, where the store allows it.
//! - Only the modes [`Backend::capabilities`] lists are asked for: the core
//!   refuses the others with [`LockError::InvalidMode`] before calling the
//!   backend.
//!
//! # How remote backends and cohorting plug in
//!
//! A remote backend (Redis, ZooKeeper) implements `acquire` with its
//! protocol, returns a [`LeaseHandle`] that stops the renewal and deletes the
//! remote state, and fires the lost trigger when the lease cannot be kept.
//! Because release is asynchronous there, the default
//! [`LeaseHandle::release_on_drop`] hands the release to the Tokio runtime.
//!
//! Lock cohorting (one process's waiters queue locally, only the head contends
//! remotely, the remote lock passes between local waiters up to a bound) is
//! [`Cohort`], a `Backend` that wraps another. What it needs from the backend
//! it wraps, and why, is all in this module:
//!
//! - [`LockRequest::tokens`] and [`Acquired::tokens`]: one remote grant
//!   serves several local holders, each with a fencing token of its own, so
//!   the grant reserves a block of them.
//! - [`LeaseHandle::valid_until`]: a lock is handed to the next local holder
//!   only while its lease is surely fresh, never one that may have expired on
//!   the server while the process was paused.
//! - [`Capabilities::ordered_release`]: a release sent is ordered before the
//!   backend's later requests, so the next local waiter may send its acquire
//!   as soon as the release is on the wire instead of a round trip later.
//! - [`Capabilities::waits_in_server`]: the same shortcut where the release
//!   and the next acquire go on different connections, but the acquire
//!   waits in the server for the release (MariaDB's `GET_LOCK`, etcd's
//!   queue of contender keys).
//! - [`Capabilities::fifo`]: whether the server queues waiters from every
//!   process in order. Where it does not, a process that gives a lock back
//!   with waiters of its own lets them ask again only once the release is
//!   answered, when waiters elsewhere hear of it too.
//! - [`Capabilities::supports`]: the modes the backend has.
//!
//! The core and the layer do not change.
//!
//! # Writing a backend
//!
//! A store of your own is a type implementing [`Backend`], in your own
//! crate; everything it needs is in this module. The steps, as the worked
//! example takes them (`examples/toy-backend` in the repository: exclusive
//! locks on Tokio mutexes, a hundred lines, read it whole):
//!
//! 1. **Acquire.** Turn a [`LockRequest`] into an [`Acquired`]: a
//!    [`FencingToken`] above every earlier grant of the key, and a
//!    [`LeaseHandle`] that gives the lock back. Answer at once where you
//!    can ([`BackendFuture::ready`]: no allocation), with
//!    [`BackendFuture::new`] where you must wait.
//! 2. **Cancel.** The core drops your future when the wait runs out or the
//!    client goes away: whatever the future started (a place in a queue, a
//!    node, a grant that raced the drop) must go with it, from `Drop` or a
//!    task [`Backend::flush`] waits for.
//! 3. **Release.** [`LeaseHandle::release`] is called at most once, and
//!    its future may be dropped before it ends: the lock must be released
//!    all the same, and only once. Release only what this grant owns (its
//!    token, node, revision or row owner), never the key by name, and
//!    never send a second release after one was sent.
//! 4. **Lost.** If the store can take a lock away (a lease, a session),
//!    give the grant a lost signal ([`Acquired::with_lost`]) and fire its
//!    [`LostTrigger`] before anyone else can be granted the key.
//! 5. **Say what you can do.** [`Backend::capabilities`]: the modes you
//!    have (the core refuses the others), and what [`Cohort`] may rely on
//!    if you wrap yourself in one. [`Backend::instance_id`] if clones
//!    share their locks, so that a request re-locking its key re-enters.
//! 6. **Check it.** The repository's conformance suite
//!    (`server-tests/tests/common/contract.rs`) is what every backend here
//!    passes: exclusion across processes with rising tokens, taking turns,
//!    re-entrancy, release on every end of a request, arrival order,
//!    cancellation after every poll of every operation, a cut-off holder
//!    told first, nothing left behind. A backend is one `Subject` (how to
//!    open it, how to see what it left on its server) and one line,
//!    `conformance!(subject)`; `server-tests/tests/toy.rs` is the toy's.

#[cfg(doc)]
use crate::{Backend, FencingToken, LockError, LockMode, Wait};

mod capabilities;
pub(crate) mod contract;
mod engine;
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub mod etcd;
mod future;
#[cfg(any(feature = "zookeeper", feature = "postgres", feature = "etcd"))]
mod identity;
mod inspect;
pub(crate) mod memory;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
mod registry;
mod request;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql;
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub mod zookeeper;

pub use capabilities::Capabilities;
cfg_remote! {
    #[cfg_attr(
        docsrs,
        doc(cfg(any(
            feature = "redis",
            feature = "zookeeper",
            feature = "postgres",
            feature = "mysql",
            feature = "etcd"
        )))
    )]
    pub use engine::RemoteBackend;
}
pub use crate::lost::{HasLostState, LostState, LostTrigger};
pub use contract::{Acquired, LeaseHandle};
pub use engine::{Cohort, CohortOptions};
pub use future::BackendFuture;
pub use inspect::{BreakScope, Broken, Holder, Inspection};
pub use registry::connect;
pub use request::{LockRequest, DEFAULT_LEASE};
