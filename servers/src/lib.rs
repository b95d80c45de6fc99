//! The servers the project's harnesses run the lock backends against, and
//! the fault proxy between a client and a server: one home for both,
//! used by the torture harness (`torture/`) and the server tests
//! (`server-tests/`).
//!
//! - [`Server`]: one server of a [`Kind`] on free loopback ports, in a
//!   directory of its own; [`Server::start_cluster`],
//!   [`Server::start_sentinel_group`] and [`Server::start_redis_cluster`]
//!   start several that form one deployment. Each can be killed,
//!   restarted on the same ports and data, and paused
//!   ([`Server::signal`]); a client process can be stopped and dated
//!   ([`stop_pid`]).
//! - [`redis_groups::Failover`]: which server of a Sentinel group or a
//!   Cluster is master, and when a failover is over.
//! - [`fault_proxy::FaultProxy`]: a TCP proxy that drops, freezes (one way
//!   or both) and delays what passes, to cut one link while the server
//!   stays up for everyone else.

pub mod fault_proxy;
pub mod redis_groups;
mod server;

pub use server::{signal_pid, stop_pid, Kind, Server, SENTINEL_MASTER};

/// Now, on the system-wide monotonic clock, in nanoseconds: the one clock
/// every process on the machine shares, so that events from many
/// processes order in one history.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to; CLOCK_MONOTONIC exists
    // on every Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
