//! A run's result: its summary line (the fields `torture/README.md`
//! describes), the guarantees it broke, and examples of each.

use std::collections::BTreeMap;

use crate::history::History;
use crate::register::Register;
use crate::Args;

/// The result of a run.
pub struct Summary {
    pub line: String,
    pub broken: Vec<&'static str>,
    pub examples: Vec<String>,
    pub seed: u64,
    /// The history, when a guarantee broke (see [`History::dump`]).
    pub history: Option<String>,
}

#[allow(clippy::too_many_arguments)]
pub fn summarize(
    args: &Args,
    backend: &str,
    seed: u64,
    history: &History,
    register: &Register,
    counts: BTreeMap<&'static str, u64>,
    leaked: u64,
    unavailable: u64,
    outside: &[&str],
) -> Summary {
    let v = history.check(outside);
    let t = register.tally();
    let faults: u64 = counts.values().sum();
    let by_kind: Vec<String> = counts.iter().map(|(k, n)| format!("{k}:{n}")).collect();
    let margin = v
        .worst_margin_ms
        .map_or("none".into(), |m| format!("{m:.0}"));
    let resume = v
        .told_after_resume_ms
        .map_or("none".into(), |m| format!("{m:.0}"));
    let recovery = v
        .kill_recovery_ms
        .map_or("none".into(), |m| format!("{m:.0}"));
    // A cluster's line says so, as the bench's do.
    let servers = match args.backend.as_str() {
        "etcd3" | "zk3" => " servers=3",
        "sentinel" => " servers=3 sentinels=3",
        "sentinel-wait" => " servers=3 sentinels=3 wait_replicas=2",
        "cluster" => " servers=6 masters=3",
        "cluster-wait" => " servers=6 masters=3 wait_replicas=1",
        "postgres-table" => " mode=lease-table",
        "redis" if args.quarantine => " quarantine=1",
        _ => "",
    };
    let sabotage = args
        .sabotage
        .map_or(String::new(), |s| format!(" sabotage={}", s.name()));
    let line = format!(
        "impl=tower-lock backend={backend} workload=torture{servers} secs={} processes={} workers={} keys={} \
         lease_ms={} seed={seed} holds={} holds_by_mode={} faults={faults} faults_by_kind={} told_lost={} \
         stale_refused={} overlaps_unwarned={} overlaps_paused={} overlaps_outside={} stale_accepted={} lost_updates={} \
         leaked={leaked} unavailable_keys={unavailable} tokens_backwards={} tokens_backwards_outside={} failed_acquisitions={} handoffs_kept_back={} writes_accepted={} \
         worst_margin_ms={margin} told_after_resume_ms={resume} kill_recovery_ms={recovery}{sabotage}",
        args.secs,
        args.processes,
        args.workers,
        args.keys,
        args.lease.as_millis(),
        v.holds,
        v.by_mode
            .iter()
            .map(|(mode, n)| format!("{mode}:{n}"))
            .collect::<Vec<_>>()
            .join(","),
        if by_kind.is_empty() { "none".into() } else { by_kind.join(",") },
        v.told_lost,
        t.stale_refused,
        v.overlaps_unwarned,
        v.overlaps_paused,
        v.overlaps_outside,
        t.stale_accepted,
        t.lost_updates,
        v.tokens_backwards,
        v.tokens_backwards_outside,
        history.failed_acquisitions,
        history.kept_back,
        t.writes_accepted,
    );
    let mut broken = Vec::new();
    if v.overlaps_unwarned > 0 {
        broken.push("overlaps_unwarned");
    }
    if t.stale_accepted > 0 {
        broken.push("stale_accepted");
    }
    if t.lost_updates > 0 {
        broken.push("lost_updates");
    }
    if leaked > 0 {
        broken.push("leaked");
    }
    if unavailable > 0 {
        broken.push("unavailable_keys");
    }
    // Redlock's tokens rise only while its servers' counters agree (its
    // module documentation): reported, not promised.
    if v.tokens_backwards > 0 && backend != "redlock" {
        broken.push("tokens_backwards");
    }
    if v.holds == 0 {
        broken.push("no hold at all");
    }
    let history =
        (!broken.is_empty() || std::env::var_os("TORTURE_KEEP").is_some()).then(|| history.dump());
    Summary {
        line,
        broken,
        examples: v
            .examples
            .into_iter()
            .chain(v.token_examples)
            .chain(t.examples)
            .collect(),
        seed,
        history,
    }
}
