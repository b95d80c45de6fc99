//! Helpers shared by the server tests (`mod common;` in each).
#![allow(dead_code)]

/// The torture harness's fault proxy: a holder's connections go through it,
/// and only that path fails while the server stays up for everyone else.
#[path = "../../examples/torture/fault_proxy.rs"]
pub mod fault_proxy;

/// Serves `app` on a free loopback port.
pub async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Waits until `cond` holds, checking every millisecond for at most 10 s:
/// sequencing for the test, not a timing assertion.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Checks a log of `start P`, `enter P`, `leave P` and `end P` entries from
/// two processes: each critical section is entered and left by one process
/// with no other entry between, and both processes started before either
/// ended, so they contended for the lock at the same time.
pub fn check_two_process_log(log: &[String], sections_each: usize) {
    let pids: std::collections::BTreeSet<&str> = log
        .iter()
        .filter_map(|l| l.strip_prefix("start "))
        .collect();
    assert_eq!(pids.len(), 2, "{log:?}");
    let first_end = log
        .iter()
        .position(|l| l.starts_with("end "))
        .expect("no process ended");
    let started_before = log[..first_end]
        .iter()
        .filter(|l| l.starts_with("start "))
        .count();
    assert_eq!(
        started_before, 2,
        "one process ended before the other started: they never overlapped"
    );
    let sections: Vec<&String> = log
        .iter()
        .filter(|l| l.starts_with("enter ") || l.starts_with("leave "))
        .collect();
    assert_eq!(sections.len(), 2 * 2 * sections_each);
    for pair in sections.chunks(2) {
        let (enter, leave) = (pair[0], pair[1]);
        assert!(enter.starts_with("enter "), "overlap: {pair:?}");
        assert_eq!(
            leave.strip_prefix("leave "),
            enter.strip_prefix("enter "),
            "overlap"
        );
    }
    let switches = sections
        .chunks(2)
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0][0] != w[1][0])
        .count();
    eprintln!("the lock went from one process to the other {switches} times");
}

/// Re-entrancy through `backend` under the layer: a handler re-locking its
/// own request's key, through the layer's locker and through a clone of the
/// backend, gets the request's token at once (fail-fast: waiting for itself
/// would be `Busy`); a key the handler took itself is re-entered too; and
/// once the response is ready the key is free again.
pub async fn reenters_under_the_layer<B: tower_lock::Backend + Clone>(backend: B) {
    use axum::{body::Body, extract::Path, routing::post, Extension, Router};
    use tower::ServiceExt;
    use tower_lock::{BackendExt, HeldLock, LockError, LockLayer, Locker, PathParam};

    let layer = LockLayer::new(backend.clone(), PathParam("sku")).namespace("reentry");
    let locker = layer.locker().clone();
    let clone = backend.clone();
    let app = Router::new()
        .route(
            "/orders/{sku}",
            post(
                move |locker: Locker, held: HeldLock, Path(sku): Path<String>| async move {
                    let again = locker.lock(&sku).fail_fast().await?;
                    assert_eq!(again.token(), held.token());
                    let through_clone = clone.lock(held.key()).fail_fast().await?;
                    assert_eq!(through_clone.token(), held.token());
                    let first = locker.lock("other").fail_fast().await?;
                    let second = locker.lock("other").fail_fast().await?;
                    assert_eq!(first.token(), second.token());
                    Ok::<_, LockError>("re-entered")
                },
            ),
        )
        .route_layer(layer)
        .layer(Extension(locker.clone()));
    let request = http::Request::post("/orders/A1")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, "re-entered");
    backend.flush().await;
    for key in ["A1", "other"] {
        let free = locker.lock(key).fail_fast().await;
        assert!(
            free.is_ok(),
            "{key} still held after the response: {free:?}"
        );
    }
}
