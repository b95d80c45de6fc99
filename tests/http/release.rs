//! Every way a request ends releases its lock: the client hangs up while
//! the lock is held or awaited, the handler panics, the lock is lost.

use super::*;

/// Sends a request on a raw socket and closes the connection without reading.
async fn send_and_hang_up(addr: SocketAddr, path: &str) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_while_holding_releases() {
    let backend = MemoryBackend::new();
    let gate = gate();
    let layer = LockLayer::new(backend.clone(), PathParam("sku"));
    let addr = serve(gated_app(gate.clone(), layer)).await;

    let socket = send_and_hang_up(addr, "/orders/B").await;
    gate.entered.notified().await;
    assert_eq!(backend.active_keys(), 1);
    drop(socket);
    // The server notices the closed connection, drops the handler, and the
    // guard releases: the key is free again and the handler never finished.
    eventually("the lock is released", || backend.active_keys() == 0).await;
    assert_eq!(gate.finished.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_while_waiting_leaves_the_queue() {
    let backend = MemoryBackend::new();
    let gate = gate();
    let layer = LockLayer::new(backend.clone(), PathParam("sku"));
    let addr = serve(gated_app(gate.clone(), layer)).await;

    let holder = {
        let mut c = Client::connect(addr).await.unwrap();
        tokio::spawn(async move { c.post("/orders/C").await.unwrap() })
    };
    gate.entered.notified().await;
    let socket = send_and_hang_up(addr, "/orders/C").await;
    eventually("the second request is queued", || backend.queued("C") == 1).await;
    drop(socket);
    // The server notices the hang-up and drops the waiting request, which
    // leaves the queue while the first still holds the key.
    eventually("the hung-up request left the queue", || {
        backend.queued("C") == 0
    })
    .await;
    assert_eq!(backend.active_keys(), 1);

    gate.proceed.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    eventually("the key is idle", || backend.active_keys() == 0).await;
    // The hung-up request never reached the handler.
    assert_eq!(gate.calls.load(Ordering::SeqCst), 1);
    let mut c = Client::connect(addr).await.unwrap();
    let next = tokio::spawn(async move { c.post("/orders/C").await.unwrap() });
    gate.entered.notified().await;
    gate.proceed.notify_one();
    assert_eq!(next.await.unwrap().status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panic_releases() {
    let backend = MemoryBackend::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/orders/{sku}",
            post(|State(calls): State<Arc<AtomicUsize>>| async move {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("handler bug");
                }
                "second call"
            }),
        )
        .route_layer(LockLayer::new(backend.clone(), PathParam("sku")).fail_fast())
        .with_state(calls.clone());
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    assert!(
        c.post("/orders/P").await.is_err(),
        "the panic closes the connection"
    );
    eventually("the lock is released", || backend.active_keys() == 0).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/orders/P").await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, "second call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lock_aborts_the_handler_with_503() {
    let backend = MemoryBackend::new();
    let gate = gate();
    let layer = LockLayer::new(backend.clone(), PathParam("sku"));
    let addr = serve(gated_app(gate.clone(), layer)).await;

    let mut c = Client::connect(addr).await.unwrap();
    let req = tokio::spawn(async move { c.post("/orders/L").await.unwrap() });
    gate.entered.notified().await;
    assert_eq!(backend.break_lock("L"), 1);
    let reply = tokio::time::timeout(Duration::from_secs(10), req)
        .await
        .expect("the request was not aborted")
        .unwrap();
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(reply.body.contains("lock lost"), "{}", reply.body);
    assert_eq!(reply.headers["retry-after"], "1");
    // Let the handler go: if it had not been dropped, it would finish now.
    gate.proceed.notify_one();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(gate.calls.load(Ordering::SeqCst), 1);
    assert_eq!(gate.finished.load(Ordering::SeqCst), 0, "handler went on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lock_can_let_the_handler_finish() {
    let backend = MemoryBackend::new();
    let gate = gate();
    let layer = LockLayer::new(backend.clone(), PathParam("sku")).on_lost(OnLost::Continue);
    let addr = serve(gated_app(gate.clone(), layer)).await;

    let mut c = Client::connect(addr).await.unwrap();
    let req = tokio::spawn(async move { c.post("/orders/L").await.unwrap() });
    gate.entered.notified().await;
    assert_eq!(backend.break_lock("L"), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    gate.proceed.notify_one();
    let reply = req.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(gate.finished.load(Ordering::SeqCst), 1);
}
