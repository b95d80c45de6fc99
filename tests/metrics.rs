//! The `metrics` feature: what a recorder sees for acquisitions, waits,
//! holds, busy keys, timeouts and lost locks. Built with `--features metrics`
//! (the test command builds every feature).
#![cfg(feature = "metrics")]

use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use tower_lock::{BackendExt, LockError, MemoryBackend};

fn counter(snapshot: &[(CompositeKey, DebugValue)], name: &str) -> u64 {
    snapshot
        .iter()
        .filter(|(k, _)| k.kind() == MetricKind::Counter && k.key().name() == name)
        .map(|(k, v)| {
            let labels: Vec<_> = k.key().labels().map(|l| (l.key(), l.value())).collect();
            assert!(
                labels.contains(&("backend", "memory")),
                "{name}: {labels:?}"
            );
            match v {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            }
        })
        .sum()
}

fn samples(snapshot: &[(CompositeKey, DebugValue)], name: &str, outcome: Option<&str>) -> Vec<f64> {
    snapshot
        .iter()
        .filter(|(k, _)| k.kind() == MetricKind::Histogram && k.key().name() == name)
        .filter(|(k, _)| {
            outcome.is_none_or(|o| {
                k.key()
                    .labels()
                    .any(|l| l.key() == "outcome" && l.value() == o)
            })
        })
        .flat_map(|(_, v)| match v {
            DebugValue::Histogram(values) => {
                values.iter().map(|v| v.into_inner()).collect::<Vec<f64>>()
            }
            other => panic!("{name} is not a histogram: {other:?}"),
        })
        .collect()
}

fn take(snapshotter: &Snapshotter) -> Vec<(CompositeKey, DebugValue)> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(k, _, _, v)| (k, v))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn acquisitions_waits_holds_and_failures_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");

    let backend = MemoryBackend::new();
    let first = backend.lock("k").await.unwrap();
    let busy = backend.lock("k").fail_fast().await;
    assert!(matches!(busy, Err(LockError::Busy)));
    let timeout = backend.lock("k").wait(Duration::from_millis(50)).await;
    assert!(matches!(timeout, Err(LockError::Timeout { .. })));
    let waiter = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.lock("k").wait(Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(first);
    let second = waiter.await.unwrap().unwrap();
    // Lost while held: the operator breaks it.
    assert_eq!(backend.break_lock("k"), 1);
    assert!(second.is_lost());
    drop(second);

    let snapshot = take(&snapshotter);
    assert_eq!(counter(&snapshot, "tower_lock_acquired_total"), 2);
    assert_eq!(counter(&snapshot, "tower_lock_busy_total"), 1);
    assert_eq!(counter(&snapshot, "tower_lock_timeouts_total"), 1);
    assert_eq!(counter(&snapshot, "tower_lock_lost_total"), 1);
    assert_eq!(counter(&snapshot, "tower_lock_errors_total"), 0);
    let waits = samples(&snapshot, "tower_lock_wait_seconds", Some("acquired"));
    assert_eq!(waits.len(), 2, "{waits:?}");
    assert!(
        waits.iter().any(|&w| w >= 0.2),
        "the waiter waited 200 ms: {waits:?}"
    );
    let timeouts = samples(&snapshot, "tower_lock_wait_seconds", Some("timeout"));
    assert!(timeouts.iter().all(|&w| w >= 0.05), "{timeouts:?}");
    let holds = samples(&snapshot, "tower_lock_hold_seconds", None);
    assert_eq!(holds.len(), 2, "{holds:?}");
    assert!(
        holds.iter().any(|&h| h >= 0.25),
        "the first was held 250 ms: {holds:?}"
    );
}
