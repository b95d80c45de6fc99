//! The plain tower example (`examples/plain_tower.rs`), in process: its
//! self-test over real HTTP, plus the layer's answers a hyper user sees.

// The example, with its `main` (unused here).
#[path = "../examples/plain_tower.rs"]
#[allow(dead_code)]
mod plain_tower;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::StatusCode;
use tokio::net::TcpListener;
use tower_lock::{BackendExt, MemoryBackend};

use plain_tower::common::Client;
use plain_tower::{app, serve, Bank, OPENING_BALANCE};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_test_passes() {
    let summary = plain_tower::self_test(8).await.unwrap();
    assert!(summary.starts_with("serialised: 8/8 debits"), "{summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_debits_are_serialised_and_rejections_are_plain_http() {
    let backend = MemoryBackend::new();
    let bank = Arc::new(Bank::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(serve(listener, app(backend.clone(), bank.clone())));

    // Concurrent debits of one account, one connection each.
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let mut client = Client::connect(addr).await.unwrap();
        tasks.push(tokio::spawn(async move {
            client.post("/debit?account=A1&amount=10").await.unwrap()
        }));
    }
    for task in tasks {
        let reply = task.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        assert!(
            reply.body.contains("(lock account:A1, token "),
            "{}",
            reply.body
        );
    }
    assert_eq!(bank.balance("A1"), OPENING_BALANCE - 60, "a debit was lost");
    assert_eq!(bank.max_in_flight.load(Ordering::SeqCst), 1);

    let mut client = Client::connect(addr).await.unwrap();
    // No key: the layer's 400, before the handler.
    let reply = client.post("/debit?amount=10").await.unwrap();
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.body,
        "missing lock key: the request has no query parameter `account`\n"
    );
    // The key percent-decoded, as the handler reads it too: `A%31` is `A1`.
    let reply = client.post("/debit?account=A%31&amount=5").await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert!(
        reply.body.starts_with("debited 5 from A1: balance 35 "),
        "{}",
        reply.body
    );
    // Held elsewhere (a batch job, another replica): the request waits (up
    // to the layer's 5 s) and is served once the holder lets go.
    let guard = backend.lock("account:B2").await.unwrap();
    let waiting =
        tokio::spawn(async move { client.post("/debit?account=B2&amount=1").await.unwrap() });
    while backend.queued("account:B2") == 0 {
        tokio::task::yield_now().await;
    }
    drop(guard);
    let reply = waiting.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert!(
        reply.body.starts_with("debited 1 from B2: balance 99 "),
        "{}",
        reply.body
    );

    server.abort();
    assert_eq!(backend.active_keys(), 0);
}
