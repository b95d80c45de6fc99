//! Admission control (`max_waiters`, `predict_waits`) and request deadlines
//! (`LockLayer::deadline`), in process on the memory backend, on a paused
//! clock: what is refused, when, with which answer, and that every slot a
//! waiter took is given back. The conformance suite runs the cap on every
//! remote backend.

use std::convert::Infallible;
use std::future::IntoFuture;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::task::JoinHandle;
use tower::util::BoxCloneSyncService;
use tower::{service_fn, Layer, ServiceExt};
use tower_lock::{
    BackendExt, Deadline, Header, LockBody, LockError, LockGuard, LockLayer, Locker, MemoryBackend,
};

/// Spawns an acquisition of `key` through `locker`, once it is counted.
async fn waiter(locker: &Locker, key: &'static str) -> JoinHandle<Result<LockGuard, LockError>> {
    let locker = locker.clone();
    let (asked, counted) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        // Counted (or refused) as the acquisition is made.
        let acquisition = locker.lock(key).wait(Duration::from_secs(60)).into_future();
        let _ = asked.send(());
        acquisition.await
    });
    counted.await.unwrap();
    task
}

#[tokio::test(start_paused = true)]
async fn the_waiter_past_the_cap_is_refused_at_once_and_slots_come_back() {
    let locker = Locker::new(MemoryBackend::new())
        .max_waiters(2)
        .wait(Duration::from_secs(5));
    let held = locker.lock("k").await.unwrap();
    let first = waiter(&locker, "k").await;
    let second = waiter(&locker, "k").await;
    let started = tokio::time::Instant::now();
    match locker.lock("k").await {
        Err(LockError::Refused {
            waiting: 2,
            expected_wait: None,
        }) => {}
        other => panic!("expected a refusal with two waiting, got {other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::ZERO, "refused without waiting");
    // Other keys are counted apart.
    let other = waiter(&locker, "other").await;
    assert!(other.await.unwrap().is_ok());
    // A fail-fast acquisition is no waiter: it asks and is told busy.
    let busy = locker.lock("k").fail_fast().await;
    assert!(matches!(busy, Err(LockError::Busy)), "{busy:?}");

    drop(held);
    drop(first.await.unwrap().unwrap());
    drop(second.await.unwrap().unwrap());
    // Every slot given back: two can wait again.
    let held = locker.lock("k").await.unwrap();
    let (a, b) = (waiter(&locker, "k").await, waiter(&locker, "k").await);
    assert!(matches!(
        locker.lock("k").await,
        Err(LockError::Refused { waiting: 2, .. })
    ));
    drop(held);
    drop(a.await.unwrap().unwrap());
    drop(b.await.unwrap().unwrap());
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_gives_up_or_is_dropped_frees_its_slot() {
    let locker = Locker::new(MemoryBackend::new()).max_waiters(1);
    let held = locker.lock("k").await.unwrap();
    // Times out.
    let short = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock("k").wait(Duration::from_millis(100)).await })
    };
    tokio::task::yield_now().await;
    assert!(matches!(
        locker.lock("k").await,
        Err(LockError::Refused { .. })
    ));
    assert!(matches!(
        short.await.unwrap(),
        Err(LockError::Timeout { .. })
    ));
    // Dropped while waiting (a client gone).
    let dropped = waiter(&locker, "k").await;
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    // Both slots came back: one may wait again.
    let last = waiter(&locker, "k").await;
    drop(held);
    assert!(last.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn no_waiters_allowed_is_fail_fast() {
    let locker = Locker::new(MemoryBackend::new()).max_waiters(0);
    let held = locker.lock("k").await.unwrap();
    assert!(matches!(locker.lock("k").await, Err(LockError::Busy)));
    drop(held);
    assert!(locker.lock("k").await.is_ok());
}

/// Queues `n` requests for `key` behind a holder of `hold`, each waiting
/// up to `wait`: those that get the key hold it `hold`. Their results, in
/// order.
async fn queue_behind(
    locker: &Locker,
    key: &'static str,
    n: usize,
    hold: Duration,
    wait: Duration,
) -> Vec<Result<(), LockError>> {
    let held = locker.lock(key).await.unwrap();
    let mut queued = Vec::new();
    for _ in 0..n {
        let locker = locker.clone();
        queued.push(tokio::spawn(async move {
            let guard = locker.lock(key).wait(wait).await?;
            tokio::time::sleep(hold).await;
            drop(guard);
            Ok(())
        }));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(hold).await;
    drop(held);
    let mut results = Vec::new();
    for q in queued {
        results.push(q.await.unwrap());
    }
    results
}

#[tokio::test(start_paused = true)]
async fn a_request_the_queue_would_outlast_is_refused_with_its_expected_wait() {
    let (hold, long) = (Duration::from_millis(100), Duration::from_secs(60));
    let locker = Locker::new(MemoryBackend::new()).predict_waits(true);
    let short = Duration::from_millis(250);
    // Six turns measured (each waiter's), then two more: fewer than the 8
    // samples needed when the third waiter, 300 ms from its turn, asks; it
    // is admitted and times out.
    let results = queue_behind(&locker, "k", 6, hold, long).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let results = queue_behind(&locker, "k", 3, hold, short).await;
    assert!(results[..2].iter().all(Result::is_ok), "{results:?}");
    assert!(
        matches!(results[2], Err(LockError::Timeout { .. })),
        "{results:?}"
    );

    // Now measured: the third is refused at once, told when to try.
    let held = locker.lock("k").await.unwrap();
    let (a, b) = (waiter(&locker, "k").await, waiter(&locker, "k").await);
    let started = tokio::time::Instant::now();
    match locker.lock("k").wait(short).await {
        Err(LockError::Refused {
            waiting: 2,
            expected_wait: Some(expected),
        }) => assert_eq!(expected, 3 * hold, "three turns, its own included"),
        other => panic!("expected a predicted refusal, got {other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::ZERO);
    // One that would wait longer is admitted.
    let patient = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock("k").wait(Duration::from_secs(1)).await })
    };
    tokio::task::yield_now().await;
    tokio::time::sleep(hold).await;
    drop(held);
    for w in [a, b, patient] {
        let guard = w.await.unwrap().expect("admitted ones get the lock");
        tokio::time::sleep(hold).await;
        drop(guard);
    }
    // Another key has no estimate: its third waiter is admitted.
    let results = queue_behind(&locker, "j", 3, hold, short).await;
    assert!(
        matches!(results[2], Err(LockError::Timeout { .. })),
        "{results:?}"
    );

    // The first in line is never refused on a prediction, however short
    // its wait: the key may be free, and its wait measures the key again.
    let held = locker
        .lock("k")
        .wait(Duration::from_millis(1))
        .await
        .unwrap();
    let first = locker.lock("k").wait(Duration::from_millis(50)).await;
    assert!(matches!(first, Err(LockError::Timeout { .. })), "{first:?}");
    drop(held);
}

type Served = BoxCloneSyncService<Request<()>, Response<LockBody<Full<Bytes>>>, Infallible>;

/// `layer` over a handler that takes 100 ms.
fn layer_service(layer: LockLayer) -> Served {
    BoxCloneSyncService::new(layer.layer(service_fn(|_req: Request<()>| async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let body = LockBody::wrap(Full::new(Bytes::from_static(b"served")));
        Ok::<_, Infallible>(Response::new(body))
    })))
}

async fn text(res: Response<LockBody<Full<Bytes>>>) -> String {
    let body = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

fn request(headers: &[(&str, &str)]) -> Request<()> {
    let mut req = Request::post("/").header("x-sku", "A1");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_layer_answers_a_refusal_423_or_resource_exhausted() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend.clone(), Header::new("x-sku")).max_waiters(1);
    let service = layer_service(layer.clone());
    let held = layer.locker().lock("A1").await.unwrap();
    let queued = tokio::spawn(service.clone().oneshot(request(&[])));
    tokio::task::yield_now().await;
    let refused = service.clone().oneshot(request(&[])).await.unwrap();
    assert_eq!(refused.status(), StatusCode::LOCKED);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body = text(refused).await;
    assert!(body.contains("1 request already waiting"), "{body}");

    let grpc = layer_service(layer.clone().grpc_rejections());
    let refused = grpc.oneshot(request(&[])).await.unwrap();
    assert_eq!(refused.headers()["grpc-status"], "8", "RESOURCE_EXHAUSTED");
    drop(held);
    assert_eq!(queued.await.unwrap().unwrap().status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_request_waits_no_longer_than_its_deadline() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend.clone(), Header::new("x-sku"))
        .wait(Duration::from_secs(10))
        .deadline(Deadline::header_millis("x-timeout-ms").reserve(Duration::from_millis(50)));
    let service = layer_service(layer.clone());
    let held = layer.locker().lock("A1").await.unwrap();

    // 300 ms left, 50 kept for the handler: 250 ms of waiting, then 504.
    let started = tokio::time::Instant::now();
    let res = service
        .clone()
        .oneshot(request(&[("x-timeout-ms", "300")]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(started.elapsed(), Duration::from_millis(250));
    let body = text(res).await;
    assert!(body.contains("deadline passed after 250 ms"), "{body}");

    // No time left: answered at once.
    let started = tokio::time::Instant::now();
    for left in ["0", "50"] {
        let res = service
            .clone()
            .oneshot(request(&[("x-timeout-ms", left)]))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT, "{left}");
        let body = text(res).await;
        assert!(body.contains("left no time"), "{body}");
    }
    assert_eq!(started.elapsed(), Duration::ZERO);

    // A deadline longer than the layer's wait: the layer's wait, and a 423.
    let short = LockLayer::new(backend.clone(), Header::new("x-sku"))
        .wait(Duration::from_millis(100))
        .deadline(Deadline::header_millis("x-timeout-ms"));
    let res = layer_service(short)
        .oneshot(request(&[("x-timeout-ms", "5000")]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::LOCKED);

    // Malformed: 400, naming the header.
    for bad in ["soon", "-1", "1.5"] {
        let res = service
            .clone()
            .oneshot(request(&[("x-timeout-ms", bad)]))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{bad}");
        let body = text(res).await;
        assert!(body.contains("`x-timeout-ms`"), "{body}");
    }
    // No header: the layer's wait; the lock is freed within it.
    let waiting = tokio::spawn(service.clone().oneshot(request(&[])));
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(held);
    assert_eq!(waiting.await.unwrap().unwrap().status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn grpc_calls_wait_within_grpc_timeout() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend.clone(), Header::new("x-sku"))
        .grpc_rejections()
        .deadline(Deadline::grpc_timeout());
    let service = layer_service(layer.clone());
    let held = layer.locker().lock("A1").await.unwrap();

    let started = tokio::time::Instant::now();
    let res = service
        .clone()
        .oneshot(request(&[("grpc-timeout", "500m")]))
        .await
        .unwrap();
    assert_eq!(res.headers()["grpc-status"], "4", "DEADLINE_EXCEEDED");
    assert_eq!(started.elapsed(), Duration::from_millis(500));

    let res = service
        .clone()
        .oneshot(request(&[("grpc-timeout", "0n")]))
        .await
        .unwrap();
    assert_eq!(res.headers()["grpc-status"], "4");

    let res = service
        .clone()
        .oneshot(request(&[("grpc-timeout", "500")]))
        .await
        .unwrap();
    assert_eq!(res.headers()["grpc-status"], "3", "INVALID_ARGUMENT");
    // A fail-fast layer stays fail-fast whatever the deadline.
    let fail_fast = layer_service(layer.clone().fail_fast());
    let res = fail_fast
        .oneshot(request(&[("grpc-timeout", "1S")]))
        .await
        .unwrap();
    assert_eq!(res.headers()["grpc-status"], "10", "ABORTED: busy");
    drop(held);
    let res = service
        .oneshot(request(&[("grpc-timeout", "1S")]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers().get("grpc-status").is_none());
    assert!(backend.lock("A1").fail_fast().await.is_ok(), "released");
}
