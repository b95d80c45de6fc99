//! The layer and the extractors over real HTTP: axum served on a loopback
//! port, requests from a hyper client or a raw socket. Here: exclusion, bad
//! input, rejections, the extractors; in `release`, every way a request ends
//! (client gone, panic, lock lost); in `modes`, read/write modes and a lock
//! held until the body is sent.

use tower_lock_example_support as client;
#[path = "../common/mod.rs"]
mod common;
mod modes;
mod release;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::Router;
use http::StatusCode;
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;
use tower_lock::{
    BackendExt, Header, HeldLock, LockError, LockLayer, Locker, MemoryBackend, OnLost,
    OnMissingKey, PathParam, QueryParam,
};

use client::Client;
use common::{eventually, serve};

#[derive(Default)]
struct Counter {
    inside: AtomicUsize,
    max_inside: AtomicUsize,
    calls: AtomicUsize,
    last: Mutex<u64>,
}

async fn read_modify_write(State(c): State<Arc<Counter>>, _held: HeldLock) -> String {
    c.calls.fetch_add(1, Ordering::SeqCst);
    let now = c.inside.fetch_add(1, Ordering::SeqCst) + 1;
    c.max_inside.fetch_max(now, Ordering::SeqCst);
    let seen = *c.last.lock().unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await;
    *c.last.lock().unwrap() = seen + 1;
    c.inside.fetch_sub(1, Ordering::SeqCst);
    // Only the number: a lost update shows as a duplicate.
    (seen + 1).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_requests_are_serialised() {
    let backend = MemoryBackend::new();
    let counter = Arc::new(Counter::default());
    let app = Router::new()
        .route("/orders/{sku}", post(read_modify_write))
        .route_layer(LockLayer::new(backend.clone(), PathParam("sku")).namespace("sku"))
        .with_state(counter.clone());
    ten_requests_for_one_sku(app, &backend, &counter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_on_one_handler_serialises_too() {
    use axum::handler::Handler;
    let backend = MemoryBackend::new();
    let counter = Arc::new(Counter::default());
    let layer = LockLayer::new(backend.clone(), PathParam("sku")).namespace("sku");
    let app = Router::new()
        .route("/orders/{sku}", post(read_modify_write.layer(layer)))
        .route("/unlocked/{sku}", post(|| async { "unlocked" }))
        .with_state(counter.clone());
    ten_requests_for_one_sku(app.clone(), &backend, &counter).await;
    // Only the handler it is mounted on: the other route takes no lock.
    let _held = backend.lock("sku:SKU-1").await.unwrap();
    let addr = serve(app).await;
    let reply = Client::connect(addr)
        .await
        .unwrap()
        .post("/unlocked/SKU-1")
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
}

/// Ten requests at once for one SKU on `app`: one at a time, none lost, no
/// lock left.
async fn ten_requests_for_one_sku(app: Router, backend: &MemoryBackend, counter: &Counter) {
    let addr = serve(app).await;

    let mut tasks = Vec::new();
    for _ in 0..10 {
        let mut client = Client::connect(addr).await.unwrap();
        tasks.push(tokio::spawn(async move {
            client.post("/orders/SKU-1").await.unwrap()
        }));
    }
    let mut codes = Vec::new();
    for t in tasks {
        let reply = t.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        codes.push(reply.body);
    }
    codes.sort();
    codes.dedup();
    assert_eq!(codes.len(), 10, "duplicate order codes: {codes:?}");
    assert_eq!(*counter.last.lock().unwrap(), 10, "an update was lost");
    assert_eq!(counter.max_inside.load(Ordering::SeqCst), 1);
    assert_eq!(backend.active_keys(), 0);
}

/// One app with every key source, for the bad-input tests.
async fn bad_input_app() -> (SocketAddr, MemoryBackend, Arc<Counter>) {
    let backend = MemoryBackend::new();
    let counter = Arc::new(Counter::default());
    let app = Router::new()
        .route(
            "/path/{sku}",
            post(read_modify_write)
                .route_layer(LockLayer::new(backend.clone(), PathParam("sku")).namespace("sku")),
        )
        .route(
            "/wrong-param/{sku}",
            post(read_modify_write).route_layer(LockLayer::new(backend.clone(), PathParam("id"))),
        )
        .route(
            "/header",
            post(read_modify_write)
                .route_layer(LockLayer::new(backend.clone(), Header::new("x-account"))),
        )
        .route(
            "/query",
            post(read_modify_write)
                .route_layer(LockLayer::new(backend.clone(), QueryParam("cart"))),
        )
        .with_state(counter.clone());
    (serve(app).await, backend, counter)
}

#[tokio::test]
async fn bad_input_gets_a_clear_400_and_takes_no_lock() {
    let (addr, backend, counter) = bad_input_app().await;
    let mut c = Client::connect(addr).await.unwrap();
    let long = "x".repeat(300);
    // (what, path, headers, what the body must say)
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a [u8])>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "missing path parameter",
            "/wrong-param/abc".into(),
            vec![],
            "missing lock key: the request has no path parameter `id`",
        ),
        (
            "missing header",
            "/header".into(),
            vec![],
            "missing lock key: the request has no header `x-account`",
        ),
        (
            "missing query parameter",
            "/query?other=1".into(),
            vec![],
            "missing lock key: the request has no query parameter `cart`",
        ),
        (
            "empty header",
            "/header".into(),
            vec![("x-account", b"")],
            "invalid lock key in header `x-account`: key is empty",
        ),
        (
            "empty query parameter",
            "/query?cart=".into(),
            vec![],
            "invalid lock key in query parameter `cart`: key is empty",
        ),
        (
            "too long",
            format!("/path/{long}"),
            vec![],
            "key is 304 bytes long counting the 4-byte namespace prefix the server adds, the maximum is 256",
        ),
        (
            "slash",
            "/path/a%2Fb".into(),
            vec![],
            "forbidden character '/'",
        ),
        (
            "dot dot",
            "/path/..".into(),
            vec![],
            "key is `.` or `..`",
        ),
        (
            "blank query parameter",
            "/query?cart=%20%20%20".into(),
            vec![],
            "invalid lock key \"   \" in query parameter `cart`: key is blank",
        ),
        (
            "blank header (no-break spaces)",
            "/header".into(),
            vec![("x-account", "\u{a0}\u{3000}".as_bytes())],
            "key is blank",
        ),
        (
            "zero-width only",
            "/path/%E2%80%8B".into(),
            vec![],
            "invisible character U+200B",
        ),
        (
            "zero-width inside",
            "/path/A%E2%80%8B1".into(),
            vec![],
            "invalid lock key \"A\\u{200b}1\" in path parameter `sku`: key contains the invisible character U+200B",
        ),
        (
            "trailing space",
            "/query?cart=A1+".into(),
            vec![],
            "key starts or ends with whitespace",
        ),
        (
            "header given twice",
            "/header".into(),
            vec![("x-account", b"A1"), ("x-account", b"A2")],
            "invalid lock key in header `x-account`: the request gives the key 2 times with different values",
        ),
        (
            "query parameter given twice",
            "/query?cart=A1&cart=A2".into(),
            vec![],
            "the request gives the key 2 times with different values",
        ),
        (
            "encoded dot dot",
            "/path/%2E%2E".into(),
            vec![],
            "key is `.` or `..`",
        ),
        (
            "NUL",
            "/path/a%00b".into(),
            vec![],
            "forbidden character '\\0'",
        ),
        (
            "control character in a header",
            "/header".into(),
            vec![("x-account", b"a\tb")],
            "forbidden character '\\t'",
        ),
        (
            "control character in a query",
            "/query?cart=a%0Ab".into(),
            vec![],
            "forbidden character '\\n'",
        ),
        (
            "header not UTF-8",
            "/header".into(),
            vec![("x-account", b"\xff\xfe")],
            "invalid lock key in header `x-account`: key is not valid UTF-8",
        ),
        (
            "path parameter not UTF-8",
            "/path/%FF".into(),
            vec![],
            "invalid lock key in path parameter `sku`: key is not valid UTF-8",
        ),
        (
            "query not UTF-8",
            "/query?cart=%FF".into(),
            vec![],
            "key is not valid UTF-8",
        ),
    ];
    for (what, path, headers, expected) in cases {
        let reply = c.send("POST", &path, &headers).await.unwrap();
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{what}: {}",
            reply.body
        );
        assert!(
            reply.body.contains(expected),
            "{what}: body {:?} does not say {expected:?}",
            reply.body
        );
    }
    assert_eq!(counter.calls.load(Ordering::SeqCst), 0, "a handler ran");
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn unicode_keys_work() {
    let backend = MemoryBackend::new();
    let app = Router::new()
        .route(
            "/orders/{sku}",
            post(|held: HeldLock| async move { held.key().to_string() })
                .route_layer(LockLayer::new(backend.clone(), PathParam("sku")).namespace("sku")),
        )
        .route(
            "/query",
            post(|held: HeldLock| async move { held.key().to_string() })
                .route_layer(LockLayer::new(backend.clone(), QueryParam("cart"))),
        );
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c
        .post("/orders/%E8%AE%A2%E5%8D%95-%F0%9F%94%92")
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, "sku:订单-🔒");
    let reply = c.post("/query?cart=caf%C3%A9+cr%C3%A8me").await.unwrap();
    assert_eq!(reply.body, "café crème");
    let reply = c.send("POST", "/orders/x", &[]).await.unwrap();
    assert_eq!(reply.body, "sku:x");
}

/// An app whose handler, on `/orders/{sku}`, signals `entered` and then
/// waits for `proceed` (or forever).
struct Gate {
    entered: Notify,
    proceed: Notify,
    calls: AtomicUsize,
    finished: AtomicUsize,
}

fn gated_app(gate: Arc<Gate>, layer: LockLayer) -> Router {
    Router::new()
        .route(
            "/orders/{sku}",
            post(|State(g): State<Arc<Gate>>, held: HeldLock| async move {
                g.calls.fetch_add(1, Ordering::SeqCst);
                g.entered.notify_one();
                g.proceed.notified().await;
                g.finished.fetch_add(1, Ordering::SeqCst);
                format!("token {}", held.token())
            }),
        )
        .route_layer(layer)
        .with_state(gate)
}

fn gate() -> Arc<Gate> {
    Arc::new(Gate {
        entered: Notify::new(),
        proceed: Notify::new(),
        calls: AtomicUsize::new(0),
        finished: AtomicUsize::new(0),
    })
}

#[tokio::test]
async fn busy_and_timeout_answer_423_with_retry_after() {
    let backend = MemoryBackend::new();
    let gate = gate();
    let layer = LockLayer::new(backend.clone(), PathParam("sku"))
        .wait(Duration::from_millis(50))
        .retry_after(Duration::from_millis(2500));
    let addr = serve(gated_app(gate.clone(), layer)).await;
    let holder = {
        let mut c = Client::connect(addr).await.unwrap();
        tokio::spawn(async move { c.post("/orders/A").await.unwrap() })
    };
    gate.entered.notified().await;

    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/orders/A").await.unwrap();
    assert_eq!(reply.status, StatusCode::LOCKED);
    assert_eq!(reply.headers["retry-after"], "3");
    assert!(reply.body.contains("timed out after"), "{}", reply.body);

    // Fail fast, through a second layer on the same backend.
    let app = Router::new()
        .route("/orders/{sku}", post(|| async { "never" }))
        .route_layer(LockLayer::new(backend.clone(), PathParam("sku")).fail_fast());
    let addr2 = serve(app).await;
    let mut c2 = Client::connect(addr2).await.unwrap();
    let reply = c2.post("/orders/A").await.unwrap();
    assert_eq!(reply.status, StatusCode::LOCKED);
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(reply.body, "lock is held by someone else\n");

    gate.proceed.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn rejections_can_be_overridden() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend, Header::new("x-id")).on_rejection(|r| {
        let mut res = http::Response::new(bytes::Bytes::from(format!("custom: {}", r.status())));
        *res.status_mut() = StatusCode::UNPROCESSABLE_ENTITY;
        res
    });
    let app = Router::new()
        .route("/", post(|| async { "ok" }))
        .route_layer(layer);
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/").await.unwrap();
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reply.body, "custom: 400 Bad Request");
}

#[tokio::test]
async fn missing_key_can_pass_through_unlocked() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend.clone(), Header::new("x-id"))
        .on_missing_key(OnMissingKey::PassThrough);
    let app = Router::new()
        .route(
            "/",
            post(|held: Option<HeldLock>| async move {
                held.map_or("unlocked".to_owned(), |h| h.key().to_string())
            }),
        )
        .route_layer(layer);
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    assert_eq!(c.post("/").await.unwrap().body, "unlocked");
    let reply = c.send("POST", "/", &[("x-id", b"7")]).await.unwrap();
    assert_eq!(reply.body, "7");
    // An invalid key is still rejected.
    let reply = c.send("POST", "/", &[("x-id", b"a/b")]).await.unwrap();
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn path_param_needs_the_layer_inside_the_router() {
    use tower::{Layer, ServiceExt};

    let backend = MemoryBackend::new();
    let router = || {
        Router::new().route(
            "/orders/{sku}",
            post(|held: Option<HeldLock>| async move {
                held.map_or("unlocked".to_owned(), |h| h.key().to_string())
            }),
        )
    };
    let request = || {
        http::Request::post("/orders/1")
            .body(axum::body::Body::empty())
            .unwrap()
    };

    // `Router::layer` wraps each route after routing: params are there.
    let inside = router().layer(LockLayer::new(backend.clone(), PathParam("sku")));
    let res = inside.oneshot(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body = axum::body::to_bytes(res.into_body(), 1024).await.unwrap();
    assert_eq!(&body[..], b"1");

    // Around the whole router no route has matched yet: a 500 that says so,
    // even with pass-through, rather than serving the request unlocked.
    let outside = LockLayer::new(backend.clone(), PathParam("sku"))
        .on_missing_key(OnMissingKey::PassThrough)
        .layer(router());
    let res = outside.oneshot(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = axum::body::to_bytes(res.into_body(), 1024).await.unwrap();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("inside the router"), "{body}");
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn handler_takes_more_locks_with_the_locker_extractor() {
    let backend = MemoryBackend::new();
    let app = Router::new()
        .route(
            "/transfer/{from}/{to}",
            post(
                |locker: Locker, Path((from, to)): Path<(u64, u64)>| async move {
                    let set = locker
                        .lock_all([format!("acct:{from}"), format!("acct:{to}")])
                        .await?;
                    let keys: Vec<_> = set.guards().iter().map(|g| g.key().to_string()).collect();
                    Ok::<_, LockError>(keys.join(","))
                },
            ),
        )
        .route(
            "/busy",
            post(|locker: Locker| async move {
                let _g = locker.lock("acct:9").fail_fast().await?;
                Ok::<_, LockError>("free")
            }),
        )
        .layer(axum::Extension(Locker::new(backend.clone())));
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/transfer/9/3").await.unwrap();
    assert_eq!(reply.body, "acct:3,acct:9");
    let _held = backend.lock("acct:9").await.unwrap();
    let reply = c.post("/busy").await.unwrap();
    assert_eq!(reply.status, StatusCode::LOCKED);
    assert_eq!(reply.headers["retry-after"], "1");
}

#[tokio::test]
async fn extractors_without_the_layer_say_how_to_fix_it() {
    let app = Router::new()
        .route("/held", post(|_h: HeldLock| async { "" }))
        .route("/locker", post(|_l: Locker| async { "" }));
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/held").await.unwrap();
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(reply.body.contains("add LockLayer"), "{}", reply.body);
    let reply = c.post("/locker").await.unwrap();
    assert!(reply.body.contains("Extension(locker)"), "{}", reply.body);
}

/// `PathParam` finds its parameter by name among the route's, decoded; says
/// a route without it has no key; and says a layer outside the router is
/// misconfigured, since no route has matched there.
#[tokio::test]
async fn a_path_parameter_is_found_by_name_and_only_inside_the_router() {
    use axum::body::{to_bytes, Body};
    use tower::{ServiceBuilder, ServiceExt};

    async fn send<S>(app: S, path: &str) -> (StatusCode, String)
    where
        S: tower::Service<http::Request<Body>, Response = axum::response::Response>,
        S::Error: std::fmt::Debug,
    {
        let request = http::Request::post(path).body(Body::empty()).unwrap();
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let body = to_bytes(response.into_body(), usize::MAX).await.unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }
    let backend = MemoryBackend::new();
    let lock = || LockLayer::new(backend.clone(), PathParam("sku"));
    let key = || post(|held: HeldLock| async move { held.key().to_string() });

    let app = Router::new().route("/shops/{shop}/orders/{sku}", key().route_layer(lock()));
    let reply = send(app, "/shops/s1/orders/A%201").await;
    assert_eq!(reply, (StatusCode::OK, "A 1".to_owned()));

    let app = Router::new().route("/shops/{shop}", key().route_layer(lock()));
    let (status, body) = send(app, "/shops/s1").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("path parameter `sku`"), "{body}");

    let outside = ServiceBuilder::new()
        .layer(lock())
        .service(Router::new().route("/orders/{sku}", key()));
    let (status, body) = send(outside, "/orders/A1").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert_eq!(backend.active_keys(), 0);
}
