//! The engine every remote backend shares, written once: the local queue
//! and hand-off ([`Cohort`]), the lease's renewal, loss and release
//! (`lease`), one timer per backend for the renewals not yet due
//! (`renewal`), the releases in flight that `flush` waits for (`in_flight`),
//! and [`RemoteBackend`], which puts them in front of a store's acquire
//! path. A store supplies only that path ([`Store`]) and, for each lock it
//! grants, how to renew and release it (`lease::Protocol`).

mod cohort;
#[cfg(any(
    feature = "zookeeper",
    feature = "postgres",
    feature = "mysql",
    feature = "etcd"
))]
pub(crate) mod holds;
mod in_flight;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod owner;
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) mod retry;

pub use cohort::{Cohort, CohortOptions};
pub(crate) use in_flight::InFlight;

cfg_remote! {
    pub(crate) mod lease;
    mod remote;
    pub(crate) mod renewal;

    pub use remote::RemoteBackend;
    pub(crate) use remote::Store;
}
