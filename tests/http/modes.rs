//! Lock modes chosen per request (reads share, writes exclude) and a lock
//! held until the response body has been sent.

use super::*;

#[derive(Default)]
struct RwProbe {
    readers: AtomicUsize,
    writers: AtomicUsize,
    max_readers: AtomicUsize,
    violations: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_share_and_writes_exclude_by_method() {
    let backend = MemoryBackend::new();
    let probe = Arc::new(RwProbe::default());
    let handler = |State(p): State<Arc<RwProbe>>, method: http::Method, held: HeldLock| async move {
        let writing = method == http::Method::POST;
        if writing {
            let w = p.writers.fetch_add(1, Ordering::SeqCst) + 1;
            if w != 1 || p.readers.load(Ordering::SeqCst) != 0 {
                p.violations.fetch_add(1, Ordering::SeqCst);
            }
        } else {
            let r = p.readers.fetch_add(1, Ordering::SeqCst) + 1;
            p.max_readers.fetch_max(r, Ordering::SeqCst);
            if p.writers.load(Ordering::SeqCst) != 0 {
                p.violations.fetch_add(1, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        if writing {
            p.writers.fetch_sub(1, Ordering::SeqCst);
        } else {
            p.readers.fetch_sub(1, Ordering::SeqCst);
        }
        held.mode().to_string()
    };
    let app = Router::new()
        .route("/doc/{id}", get(handler).post(handler))
        .route_layer(LockLayer::new(backend.clone(), PathParam("id")).read_write_by_method())
        .with_state(probe.clone());
    let addr = serve(app).await;

    let mut requests = Vec::new();
    for i in 0..12 {
        let mut c = Client::connect(addr).await.unwrap();
        // Four reads first, then reads and writes interleaved.
        let method = if i >= 4 && i % 2 == 0 { "POST" } else { "GET" };
        requests.push(tokio::spawn(async move {
            (method, c.send(method, "/doc/1", &[]).await.unwrap())
        }));
    }
    for r in requests {
        let (method, reply) = r.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.body, if method == "POST" { "write" } else { "read" });
    }
    assert_eq!(
        probe.violations.load(Ordering::SeqCst),
        0,
        "a write overlapped"
    );
    assert!(
        probe.max_readers.load(Ordering::SeqCst) > 1,
        "readers did not share"
    );
    assert_eq!(backend.active_keys(), 0);
}

/// Serves `GET /report/{id}` locked until its body is sent, the body fed by
/// the returned sender, and requests `/report/R`: the response head is back,
/// the body is still open.
async fn held_body_response(
    backend: &MemoryBackend,
) -> (
    tokio::sync::mpsc::Sender<bytes::Bytes>,
    http::Response<hyper::body::Incoming>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
    let rx = Arc::new(Mutex::new(Some(rx)));
    let app = Router::new()
        .route(
            "/report/{id}",
            get(move || {
                let rx = rx.lock().unwrap().take().unwrap();
                async move { axum::body::Body::new(ChannelBody(rx)) }
            }),
        )
        .route_layer(LockLayer::new(backend.clone(), PathParam("id")).hold_until_body_sent(true));
    let addr = serve(app).await;
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/report/R")
        .header("host", "test")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    (tx, sender.send_request(req).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_can_be_held_until_the_body_is_sent() {
    use http_body_util::BodyExt;

    let backend = MemoryBackend::new();
    let (tx, res) = held_body_response(&backend).await;
    assert_eq!(res.status(), StatusCode::OK);
    // Head sent, body not finished: still locked.
    assert!(matches!(
        backend.lock("R").fail_fast().await,
        Err(LockError::Busy)
    ));
    tx.send(bytes::Bytes::from("part")).await.unwrap();
    drop(tx);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"part");
    eventually("the lock is released", || backend.active_keys() == 0).await;
}

/// A response body fed from a channel, to control when it ends.
struct ChannelBody(tokio::sync::mpsc::Receiver<bytes::Bytes>);

impl http_body::Body for ChannelBody {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|b| Ok(http_body::Frame::data(b))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_cuts_a_held_body_short() {
    use http_body_util::BodyExt;

    let backend = MemoryBackend::new();
    let (tx, res) = held_body_response(&backend).await;
    assert_eq!(res.status(), StatusCode::OK);
    tx.send(bytes::Bytes::from("first part")).await.unwrap();
    assert_eq!(backend.break_lock("R"), 1);
    // The body ends in an error instead of streaming on without the lock;
    // the sender is never told to stop, so only the abort can end the body.
    let body = tokio::time::timeout(Duration::from_secs(10), res.into_body().collect())
        .await
        .expect("the body kept streaming after the lock was lost");
    assert!(body.is_err(), "a body streamed after its lock was lost");
    drop(tx);
}
