//! The faults the nemesis can inject, and which apply to a backend.

use std::net::SocketAddr;
use std::time::Duration;

/// A fault the nemesis can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// Both directions between clients and one server held.
    Partition,
    /// Client-to-server held; server-to-client flows.
    PartitionUp,
    /// Server-to-client held; client-to-server flows.
    PartitionDown,
    /// Connections to one server closed, new ones refused.
    Drop,
    /// Up to a quarter lease of latency on one server's traffic.
    Latency,
    /// `kill -9` of a client process (a new one takes its place).
    Kill,
    /// `SIGSTOP` of a client process (one in its critical section when
    /// there is one) for one and a half leases.
    Pause,
    /// `kill -9` of a server and a restart.
    ServerKill,
    /// `SIGSTOP` of a server for one and a half leases.
    ServerPause,
    /// Redlock: one server's wall clock stepped forward by two leases
    /// (Kleppmann's case against Redlock), emulated: see [`step_clock`].
    Clock,
    /// In process: a waiting or holding task cancelled.
    Cancel,
    /// In process: a holder panics.
    Panic,
}

const ALL: [(FaultKind, &str); 12] = [
    (FaultKind::Partition, "partition"),
    (FaultKind::PartitionUp, "partition-up"),
    (FaultKind::PartitionDown, "partition-down"),
    (FaultKind::Drop, "drop"),
    (FaultKind::Latency, "latency"),
    (FaultKind::Kill, "kill"),
    (FaultKind::Pause, "pause"),
    (FaultKind::ServerKill, "server-kill"),
    (FaultKind::ServerPause, "server-pause"),
    (FaultKind::Clock, "clock"),
    (FaultKind::Cancel, "cancel"),
    (FaultKind::Panic, "panic"),
];

impl FaultKind {
    pub fn name(self) -> &'static str {
        ALL.iter().find(|(k, _)| *k == self).expect("listed").1
    }
}

/// The faults of `list` (`all`, `none` or names joined by commas) that
/// apply to the backend `kind`; `given`: its servers were given by URL, so
/// the harness cannot kill, pause or step them.
pub fn choose(kind: &str, given: bool, list: &str) -> Result<Vec<FaultKind>, String> {
    let possible: Vec<FaultKind> = ALL
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| match (kind, k) {
            ("memory", FaultKind::Cancel | FaultKind::Panic) => true,
            ("memory", _) | (_, FaultKind::Cancel | FaultKind::Panic) => false,
            // Clients reach the Redis servers at the addresses the
            // Sentinels (or the cluster) give, not through the proxies:
            // the faults are the master's (kill, pause) and the
            // clients'.
            (
                "sentinel" | "sentinel-wait" | "cluster" | "cluster-wait",
                FaultKind::Partition
                | FaultKind::PartitionUp
                | FaultKind::PartitionDown
                | FaultKind::Drop
                | FaultKind::Latency,
            ) => false,
            (_, FaultKind::ServerKill | FaultKind::ServerPause) => !given,
            (kind, FaultKind::Clock) => kind == "redlock" && !given,
            _ => true,
        })
        .collect();
    Ok(match list {
        "all" => possible,
        "none" => Vec::new(),
        list => list
            .split(',')
            .map(|name| {
                let k = ALL
                    .iter()
                    .find(|(_, n)| *n == name)
                    .map(|(k, _)| *k)
                    .ok_or(format!("unknown fault {name:?}"))?;
                if possible.contains(&k) {
                    Ok(k)
                } else {
                    let takes: Vec<&str> = possible.iter().map(|k| k.name()).collect();
                    Err(format!(
                        "fault {name:?} does not apply to the {kind} backend (it takes: {}; \
                         server faults need servers the harness starts)",
                        takes.join(", ")
                    ))
                }
            })
            .collect::<Result<_, String>>()?,
    })
}

/// What a forward step of a Redis server's wall clock by `step` does to
/// locks: every key's time to live, which Redis counts on that clock, ends
/// `step` sooner. Emulated by shortening the TTLs, because Debian's
/// redis-server is linked with jemalloc, which libfaketime cannot run under
/// (libfaketime issue 130).
pub async fn step_clock(server: SocketAddr, root: &str, step: Duration) -> Result<(), String> {
    let client = redis::Client::open(format!("redis://{server}")).map_err(|e| e.to_string())?;
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return Ok(()); // down or restarting: nothing to step
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{{{root}-k*"))
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    let step = step.as_millis() as i64;
    for key in keys.iter().filter(|k| !k.ends_with(":fence")) {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        if ttl > 0 {
            let _: i64 = redis::cmd("PEXPIRE")
                .arg(key)
                .arg((ttl - step).max(1))
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}
