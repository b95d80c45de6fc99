//! The gRPC example's server (`src/lib.rs`: tonic with the `LockLayer`
//! and `.grpc_rejections()` in front) on loopback ports, called by its tonic
//! client: the statuses a gRPC client sees, and no lock left behind.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tonic::Code;
use tower_lock::MemoryBackend;

use example_grpc::{lock_layer, start, AccountsClient, Bank, OPENING_BALANCE};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_are_locked_per_account_and_rejections_are_grpc_statuses() {
    let backend = MemoryBackend::new();
    let bank = Arc::new(Bank::default());
    let layer = lock_layer(&backend);
    let patient = start(layer.clone(), bank.clone()).await.unwrap();
    let fail_fast = start(layer.clone().fail_fast(), bank.clone())
        .await
        .unwrap();
    let mut client = AccountsClient::connect(patient).await.unwrap();

    // A call succeeds, under the lock.
    let reply = client.debit(Some("A1"), 10).await.unwrap();
    assert_eq!(reply.balance, OPENING_BALANCE - 10);
    assert!(reply.token > 0);

    // Concurrent calls for one account (on one HTTP/2 connection) are
    // serialised: no debit lost, never two in progress.
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let mut c = client.clone();
            tokio::spawn(async move { c.debit(Some("A1"), 10).await })
        })
        .collect();
    let mut tokens = vec![reply.token];
    for call in calls {
        tokens.push(call.await.unwrap().unwrap().token);
    }
    assert_eq!(bank.balance("A1"), OPENING_BALANCE - 50, "a debit was lost");
    assert_eq!(bank.max_in_flight.load(Ordering::SeqCst), 1);
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 5, "each call had its own lock");

    // No `x-account-id` metadata: INVALID_ARGUMENT, saying which.
    let status = client.debit(None, 10).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(
        status.message(),
        "missing lock key: the request has no header `x-account-id`"
    );
    // An invalid key: INVALID_ARGUMENT too, quoting it.
    let status = client.debit(Some("a/b"), 10).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("invalid lock key \"a/b\" in header `x-account-id`: "),
        "{status:?}"
    );

    // The account held elsewhere (here through the layer's own locker, so
    // under the same namespace): the fail-fast server answers ABORTED at
    // once, with a retry pushback.
    let held = layer.locker().lock("A1").await.unwrap();
    assert_eq!(held.key().as_str(), "account:A1");
    let mut impatient = AccountsClient::connect(fail_fast).await.unwrap();
    let status = impatient.debit(Some("A1"), 10).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert_eq!(status.message(), "lock is held by someone else");
    assert_eq!(
        status.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "1000"
    );
    // Other accounts are not held up.
    let reply = impatient.debit(Some("B2"), 1).await.unwrap();
    assert_eq!(reply.balance, OPENING_BALANCE - 1);
    drop(held);
    let reply = impatient.debit(Some("A1"), 10).await.unwrap();
    assert_eq!(reply.balance, OPENING_BALANCE - 60);

    // Every lock released: the layer's, the locker's, the rejected calls'.
    assert_eq!(backend.active_keys(), 0);
}
