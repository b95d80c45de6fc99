//! This process's view (`tower_lock::admin`): held keys and waiting
//! acquisitions listed while they last, and nothing left once they end.
//! One test: tracking is process-wide.

use std::time::Duration;

use axum::body::Body;
use http::Request;
use tower::ServiceExt;
use tower_lock::{admin, BackendExt, LockMode, MemoryBackend};

fn held(view: &admin::ProcessLocks, key: &str) -> Vec<(LockMode, u64, u32)> {
    view.held
        .iter()
        .filter(|h| h.key.as_str() == key)
        .map(|h| (h.mode, h.token.get(), h.holders))
        .collect()
}

fn waiting(view: &admin::ProcessLocks, key: &str) -> u32 {
    view.waiting
        .iter()
        .filter(|w| w.key.as_str() == key)
        .map(|w| w.waiting)
        .sum()
}

#[tokio::test(start_paused = true)]
async fn held_keys_and_waiters_are_listed_while_they_last() {
    let backend = MemoryBackend::new();
    let before = backend.lock("before").await.unwrap();
    let app = admin::router::<()>();
    assert!(admin::snapshot().tracking);
    assert!(
        held(&admin::snapshot(), "before").is_empty(),
        "taken before tracking"
    );
    drop(before);

    let a = backend.lock("a\"b").await.unwrap();
    let r1 = backend.lock("r").read().await.unwrap();
    let r2 = backend.lock("r").read().await.unwrap();
    let waiter = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.lock("a\"b").await.map(|g| g.token()) })
    };
    let gives_up = {
        let backend = backend.clone();
        tokio::spawn(async move {
            backend
                .lock("a\"b")
                .wait(Duration::from_millis(100))
                .await
                .err()
        })
    };
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let view = admin::snapshot();
    assert_eq!(
        held(&view, "a\"b"),
        [(LockMode::Exclusive, a.token().get(), 1)]
    );
    let reads = held(&view, "r");
    assert_eq!(reads.iter().map(|r| r.2).sum::<u32>(), 2, "{reads:?}");
    assert_eq!(waiting(&view, "a\"b"), 2);
    assert_eq!(view.held[0].held_for, Duration::from_millis(50));

    // The same as JSON, over the router.
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "application/json");
    let body = axum::body::to_bytes(res.into_body(), 1 << 16)
        .await
        .unwrap();
    let json = String::from_utf8(body.to_vec()).unwrap();
    assert!(json.starts_with("{\"tracking\":true,\"held\":["), "{json}");
    let entry = format!(
        "{{\"key\":\"a\\\"b\",\"backend\":\"memory\",\"mode\":\"exclusive\",\"token\":{},\"held_ms\":50,\"holders\":1}}",
        a.token().get()
    );
    assert!(json.contains(&entry), "{json}");
    assert!(
        json.contains("{\"key\":\"a\\\"b\",\"backend\":\"memory\",\"waiting\":2}"),
        "{json}"
    );

    // The one that gives up leaves the list; the other is granted.
    assert!(gives_up.await.unwrap().is_some());
    assert_eq!(waiting(&admin::snapshot(), "a\"b"), 1);
    let token = a.token();
    a.release().await.unwrap();
    let next = waiter.await.unwrap().unwrap();
    assert!(next > token);
    drop((r1, r2));
    let view = admin::snapshot();
    assert!(view.held.is_empty(), "{view:?}");
    assert!(view.waiting.is_empty(), "{view:?}");
}
