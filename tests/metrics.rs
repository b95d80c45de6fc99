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

    // Admission control and deadlines: refusals by reason, none of them an
    // acquisition (the backend is not asked); the gauges follow holds and
    // waits.
    let locker = tower_lock::Locker::new(backend.clone())
        .max_waiters(1)
        .predict_waits(true);
    let held = locker.lock("k").await.unwrap();
    let waiter = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock("k").await.map(drop) })
    };
    tokio::task::yield_now().await;
    assert!(matches!(
        locker.lock("k").await,
        Err(LockError::Refused { .. })
    ));
    let layer = tower_lock::LockLayer::new(backend.clone(), tower_lock::Header::new("x-k"))
        .deadline(tower_lock::Deadline::header_millis("x-ms"));
    let service = tower::Layer::layer(
        &layer,
        tower::service_fn(|_: http::Request<()>| async {
            let body = tower_lock::LockBody::wrap(http_body_util::Empty::<bytes::Bytes>::new());
            Ok::<_, std::convert::Infallible>(http::Response::new(body))
        }),
    );
    let req = http::Request::post("/")
        .header("x-k", "k")
        .header("x-ms", "0");
    let res = tower::ServiceExt::oneshot(service, req.body(()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), 504);

    let snapshot = take(&snapshotter);
    assert_eq!(refused(&snapshot, "max_waiters"), 1);
    assert_eq!(refused(&snapshot, "deadline"), 1);
    assert_eq!(refused(&snapshot, "predicted_wait"), 0);
    let asked = ["acquired", "busy", "timeouts", "errors"]
        .map(|o| counter(&snapshot, &format!("tower_lock_{o}_total")));
    // Since the last snapshot (which resets the counters): the holder.
    assert_eq!(asked, [1, 0, 0, 0], "acquired, busy, timeouts, errors");
    // A snapshot resets gauges too: add them up.
    let mut held_now = gauge(&snapshot, "tower_lock_held");
    let mut waiting_now = gauge(&snapshot, "tower_lock_waiting");
    assert_eq!((held_now, waiting_now), (1.0, 1.0), "held, waiting");
    drop(held);
    waiter.await.unwrap().unwrap();
    let snapshot = take(&snapshotter);
    held_now += gauge(&snapshot, "tower_lock_held");
    waiting_now += gauge(&snapshot, "tower_lock_waiting");
    assert_eq!((held_now, waiting_now), (0.0, 0.0), "held, waiting");
}

fn refused(snapshot: &[(CompositeKey, DebugValue)], reason: &str) -> u64 {
    snapshot
        .iter()
        .filter(|(k, _)| k.key().name() == "tower_lock_refused_total")
        .filter(|(k, _)| {
            k.key()
                .labels()
                .any(|l| l.key() == "reason" && l.value() == reason)
        })
        .map(|(_, v)| match v {
            DebugValue::Counter(n) => *n,
            other => panic!("not a counter: {other:?}"),
        })
        .sum()
}

fn gauge(snapshot: &[(CompositeKey, DebugValue)], name: &str) -> f64 {
    snapshot
        .iter()
        .filter(|(k, _)| k.kind() == MetricKind::Gauge && k.key().name() == name)
        .map(|(_, v)| match v {
            DebugValue::Gauge(g) => g.into_inner(),
            other => panic!("{name} is not a gauge: {other:?}"),
        })
        .sum()
}
