//! What a handler under the layer does with locks: the layer's locker, locks
//! taken again within one request (re-entrancy), a `LockError` answered by
//! the layer's policy, key functions, gRPC-style rejections. Over real HTTP.

use tower_lock_example_support as client;
mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};
use tokio::sync::Notify;
use tower_lock::{
    BackendExt, Header, HeldLock, KeyError, KeyFn, LockError, LockLayer, LockMode, Locker,
    MemoryBackend, OnMissingKey, PathParam, QueryParam,
};

use client::Client;
use common::{eventually, serve};

#[tokio::test]
async fn the_layers_locker_locks_the_layers_keys_with_its_wait_and_lease() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend.clone(), PathParam("sku"))
        .namespace("sku")
        .wait(Duration::from_millis(300))
        .lease(Duration::from_secs(7));
    let locker = layer.locker().clone();
    assert_eq!(locker.namespace_prefix(), "sku");
    assert_eq!(locker.default_wait(), Duration::from_millis(300).into());
    assert_eq!(locker.default_lease(), Duration::from_secs(7));

    let entered = Arc::new(Notify::new());
    let proceed = Arc::new(Notify::new());
    let (e, p) = (entered.clone(), proceed.clone());
    let app = Router::new()
        .route(
            "/orders/{sku}",
            post(move |held: HeldLock| async move {
                e.notify_one();
                p.notified().await;
                held.key().to_string()
            }),
        )
        .route_layer(layer);
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let request = tokio::spawn(async move { c.post("/orders/A1").await.unwrap() });
    entered.notified().await;

    // The layer holds `sku:A1`: the locker must see it held.
    let busy = locker.lock("A1").fail_fast().await;
    assert!(matches!(busy, Err(LockError::Busy)), "{busy:?}");
    // And waits the layer's 300 ms, not the 10 s default.
    let waited = locker.lock("A1").await;
    assert!(
        matches!(waited, Err(LockError::Timeout { waited }) if waited < Duration::from_secs(5)),
        "{waited:?}"
    );
    proceed.notify_one();
    assert_eq!(request.await.unwrap().body, "sku:A1");
    let guard = locker.lock("A1").fail_fast().await.unwrap();
    assert_eq!(guard.key().as_str(), "sku:A1");
    drop(guard);
    assert_eq!(backend.active_keys(), 0);
}

/// A route locking `/orders/{sku}` under namespace `sku`, whose handler
/// gets the layer's locker as an extension.
fn reentrant_app(
    backend: &MemoryBackend,
    mode: LockMode,
    handler: axum::routing::MethodRouter,
) -> Router {
    let layer = LockLayer::new(backend.clone(), PathParam("sku"))
        .namespace("sku")
        .mode(mode)
        .wait(Duration::from_secs(5));
    let locker = layer.locker().clone();
    Router::new()
        .route("/orders/{sku}", handler)
        .route_layer(layer)
        .layer(Extension(locker))
}

/// Tries `key` once, fail-fast, from a spawned task: outside the request
/// (a task the handler spawns is not part of it), so it sees the key as any
/// other request would. The error, if it could not be had.
async fn try_outside(locker: &Locker, key: &str) -> Option<LockError> {
    let (locker, key) = (locker.clone(), key.to_owned());
    tokio::spawn(async move { locker.lock(key).fail_fast().await.err() })
        .await
        .unwrap()
}

#[tokio::test]
async fn a_handler_relocking_its_own_key_reenters_with_the_same_token() {
    let backend = MemoryBackend::new();
    let handler = post(
        |locker: Locker, held: HeldLock, Path(sku): Path<String>| async move {
            let again = locker.lock(&sku).fail_fast().await?;
            assert_eq!(
                again.token(),
                held.token(),
                "a nested guard shares the token"
            );
            // Several keys, one of them the request's own.
            let set = locker
                .lock_all(["Z9".to_owned(), sku.clone()])
                .fail_fast()
                .await?;
            let own = set.get(held.key().as_str()).expect("own key in the set");
            assert_eq!(own.token(), held.token());
            // Releasing nested guards leaves the request's lock held.
            again.release().await?;
            drop(set);
            // Seen from outside the request (a spawned task is not part
            // of it), the key is still held.
            assert!(
                matches!(try_outside(&locker, &sku).await, Some(LockError::Busy)),
                "the layer's lock was released by a nested guard"
            );
            // A lock the handler took itself is shared the same way: it
            // stays held until its last guard goes.
            let first = locker.lock("B2").await?;
            let second = locker.lock("B2").await?;
            assert_eq!(first.token(), second.token());
            drop(first);
            assert!(
                matches!(try_outside(&locker, "B2").await, Some(LockError::Busy)),
                "released while a nested guard still held it"
            );
            drop(second);
            assert!(
                try_outside(&locker, "B2").await.is_none(),
                "not released by its last guard"
            );
            Ok::<_, LockError>(format!("token {}", held.token()))
        },
    );
    let app = reentrant_app(&backend, LockMode::Exclusive, handler);
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/orders/A1").await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert!(reply.body.starts_with("token "), "{}", reply.body);
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

/// A lock future the handler makes but a task it spawns awaits is the
/// task's lock: the request does not re-enter it (the handler and the task
/// would hold the key together), it finds the key taken, as it does when
/// the task's lock had to wait.
#[tokio::test]
async fn a_lock_made_in_the_handler_but_awaited_in_a_task_is_not_the_requests() {
    use std::future::IntoFuture;

    let backend = MemoryBackend::new();
    let handler = post(|locker: Locker| async move {
        let taking = locker.lock("B2").into_future();
        let (held, is_held) = tokio::sync::oneshot::channel();
        let (done, is_done) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let guard = taking.await;
            held.send(guard.is_ok()).unwrap();
            let _ = is_done.await;
            drop(guard);
        });
        assert!(is_held.await.unwrap(), "the task did not get the lock");
        let again = locker.lock("B2").fail_fast().await;
        done.send(()).unwrap();
        task.await.unwrap();
        match again {
            Err(LockError::Busy) => Ok("busy".to_owned()),
            Ok(_) => Ok("re-entered the task's lock".to_owned()),
            Err(e) => Err(e),
        }
    });
    let app = reentrant_app(&backend, LockMode::Exclusive, handler);
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/orders/A1").await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, "busy");
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

/// The same on the request's own key: made in the handler, the future
/// re-enters the layer's lock, and a task that awaits it is refused, not
/// given a nested guard that holds nothing (the layer releases the lock
/// with the response, while the task would go on as its holder).
#[tokio::test]
async fn the_requests_own_key_made_in_the_handler_but_awaited_in_a_task_is_refused() {
    use std::future::IntoFuture;

    let backend = MemoryBackend::new();
    let handler = post(|locker: Locker, Path(sku): Path<String>| async move {
        let taking = locker.lock(&sku).fail_fast().into_future();
        let got = tokio::spawn(taking).await.unwrap();
        // Awaited in the request, the same future re-enters.
        let again = locker.lock(&sku).fail_fast().into_future().await;
        Ok::<_, LockError>(format!("task: {:?}, request: {}", got.err(), again.is_ok()))
    });
    let app = reentrant_app(&backend, LockMode::Exclusive, handler);
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/orders/A1").await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert!(
        reply.body.starts_with("task: Some(Lost(") && reply.body.ends_with("request: true"),
        "{}",
        reply.body
    );
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

/// Two layers on one route: the outer locks the tenant (a header), the
/// inner the SKU (a path parameter, passed through unlocked when absent).
/// The handler sees the innermost lock held, and re-enters the outer one's
/// key rather than wait for it until the wait runs out.
#[tokio::test]
async fn nested_layers_each_lock_is_seen_and_reentered() {
    let backend = MemoryBackend::new();
    let tenant = LockLayer::new(backend.clone(), Header::new("x-tenant"))
        .namespace("tenant")
        .wait(Duration::from_secs(5));
    let sku = LockLayer::new(backend.clone(), QueryParam("sku"))
        .namespace("sku")
        .on_missing_key(OnMissingKey::PassThrough);
    let locker = tenant.locker().clone();
    let handler = post(|locker: Locker, held: HeldLock| async move {
        // The tenant's key, held by the outer layer: re-entered at once
        // (fail-fast: waiting for it would be waiting for itself).
        let again = locker.lock("t1").fail_fast().await?;
        assert_eq!(again.key().as_str(), "tenant:t1");
        if held.key().as_str() == "tenant:t1" {
            assert_eq!(
                again.token(),
                held.token(),
                "a nested guard shares the token"
            );
        }
        Ok::<_, LockError>(held.key().to_string())
    });
    let app = Router::new()
        .route("/orders", handler)
        .route_layer(sku)
        .route_layer(tenant)
        .layer(Extension(locker));
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let tenant: &[(&str, &[u8])] = &[("x-tenant", b"t1")];
    // Both layers lock: the handler's lock is the inner one's.
    let reply = c.send("POST", "/orders?sku=A1", tenant).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, "sku:A1");
    // The inner layer passes through: the outer one's lock is the handler's.
    let reply = c.send("POST", "/orders", tenant).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, "tenant:t1");
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

/// A handler that serves sub-requests in process, through a router under a
/// layer, concurrently and on the same key: each sub-request's lock still
/// excludes the other's (a layer's own lock is not shared with its
/// siblings through the parent request), and none is left behind.
#[tokio::test]
async fn concurrent_sub_requests_on_one_key_still_exclude() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower::ServiceExt;

    let backend = MemoryBackend::new();
    let inside = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let sub: Router = Router::new()
        .route(
            "/sku/{sku}",
            post({
                let inside = inside.clone();
                move || async move {
                    let now = inside.0.fetch_add(1, Ordering::SeqCst) + 1;
                    inside.1.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    inside.0.fetch_sub(1, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        .route_layer(LockLayer::new(backend.clone(), PathParam("sku")).namespace("sku"));
    let parent = post(move || async move {
        let call = |sub: Router| {
            let request = http::Request::post("/sku/A1")
                .body(axum::body::Body::empty())
                .unwrap();
            sub.oneshot(request)
        };
        let (a, b) = tokio::join!(call(sub.clone()), call(sub));
        format!("{} {}", a.unwrap().status(), b.unwrap().status())
    });
    let app = Router::new()
        .route("/batch/{id}", parent)
        .route_layer(LockLayer::new(backend.clone(), PathParam("id")).namespace("batch"));
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let reply = c.post("/batch/7").await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, "200 OK 200 OK");
    assert_eq!(
        inside.1.load(Ordering::SeqCst),
        1,
        "two sub-requests ran at once on one key"
    );
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

/// With `held_lock_extension`, an inner service that handles the request
/// on another task finds the lock in the extensions, whether the layer got
/// it at once or had to wait; without it, only through `HeldLock::current`.
#[tokio::test]
async fn the_held_lock_extension_reaches_another_task() {
    use tower::{Service, ServiceExt};

    let backend = MemoryBackend::new();
    let service = |insert: bool| {
        tower::ServiceBuilder::new()
            .layer(LockLayer::new(backend.clone(), QueryParam("job")).held_lock_extension(insert))
            .service_fn(|req: http::Request<axum::body::Body>| async move {
                let current = HeldLock::current().map(|h| h.token());
                let spawned =
                    tokio::spawn(
                        async move { req.extensions().get::<HeldLock>().map(|h| h.token()) },
                    );
                let text = format!("{current:?} {:?}", spawned.await.unwrap());
                Ok::<_, std::convert::Infallible>(axum::response::IntoResponse::into_response(text))
            })
    };
    let request = || {
        http::Request::post("/?job=9")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let text = |res: axum::response::Response| async move {
        let body = axum::body::to_bytes(res.into_body(), 1024).await.unwrap();
        String::from_utf8(body.to_vec()).unwrap()
    };
    // Granted at once.
    let res = service(true).oneshot(request()).await.unwrap();
    assert_eq!(
        text(res).await,
        "Some(FencingToken(1)) Some(FencingToken(1))"
    );
    let res = service(false).oneshot(request()).await.unwrap();
    assert_eq!(text(res).await, "Some(FencingToken(2)) None");
    // Granted after a wait.
    let held = backend.lock("9").await.unwrap();
    let mut waiting = service(true);
    let pending = ServiceExt::<http::Request<axum::body::Body>>::ready(&mut waiting)
        .await
        .unwrap()
        .call(request());
    let pending = tokio::spawn(pending);
    eventually("the request queued", || backend.queued("9") == 1).await;
    drop(held);
    let res = pending.await.unwrap().unwrap();
    assert_eq!(
        text(res).await,
        "Some(FencingToken(4)) Some(FencingToken(4))"
    );
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

#[tokio::test]
async fn a_write_holder_may_read_but_a_reader_may_not_write() {
    let backend = MemoryBackend::new();
    let read_under_write = post(|locker: Locker, Path(sku): Path<String>| async move {
        let _read = locker.lock(&sku).read().fail_fast().await?;
        Ok::<_, LockError>("read under write")
    });
    let app = reentrant_app(&backend, LockMode::Write, read_under_write);
    let mut c = Client::connect(serve(app).await).await.unwrap();
    let reply = c.post("/orders/A1").await.unwrap();
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (StatusCode::OK, "read under write")
    );

    let write_under_read = post(|locker: Locker, Path(sku): Path<String>| async move {
        let started = std::time::Instant::now();
        let result = locker.lock(&sku).write().await;
        // At once, not after the 5 s wait.
        assert!(started.elapsed() < Duration::from_secs(2));
        result.map(|_| "upgraded")
    });
    let app = reentrant_app(&backend, LockMode::Read, write_under_read);
    let mut c = Client::connect(serve(app).await).await.unwrap();
    let reply = c.post("/orders/A1").await.unwrap();
    assert_eq!(
        reply.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        reply.body
    );
    assert!(
        reply.body.contains(
            "this request already holds the lock on \"sku:A1\" in read mode; \
             taking it in write mode would wait for itself"
        ),
        "{}",
        reply.body
    );
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_read_does_not_queue_behind_a_writer_waiting_for_the_first() {
    let backend = MemoryBackend::new();
    let entered = Arc::new(Notify::new());
    let proceed = Arc::new(Notify::new());
    let (e, p) = (entered.clone(), proceed.clone());
    let handler = get(move |locker: Locker, held: HeldLock| async move {
        e.notify_one();
        p.notified().await;
        // A writer is queued behind this request's read lock now: a fresh
        // read would queue behind it, and it waits for this request.
        let again = locker
            .lock(held.key().as_str().strip_prefix("sku:").unwrap())
            .read()
            .await?;
        Ok::<_, LockError>(format!("read again with token {}", again.token()))
    });
    let app = reentrant_app(&backend, LockMode::Read, handler);
    let addr = serve(app).await;
    let mut c = Client::connect(addr).await.unwrap();
    let request = tokio::spawn(async move { c.send("GET", "/orders/A1", &[]).await.unwrap() });
    entered.notified().await;
    let writer_backend = backend.clone();
    let writer = tokio::spawn(async move {
        let guard = writer_backend.lock("sku:A1").write().await.unwrap();
        guard.token()
    });
    eventually("the writer is queued", || backend.queued("sku:A1") == 1).await;
    proceed.notify_one();
    let reply = request.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    writer.await.unwrap();
    assert_eq!(backend.active_keys(), 0, "a lock leaked");
}

#[tokio::test]
async fn across_requests_the_same_key_still_excludes() {
    // Re-entrancy is per request: another request's handler locking the key
    // a running request holds waits (here: fails fast) as before.
    let backend = MemoryBackend::new();
    let entered = Arc::new(Notify::new());
    let proceed = Arc::new(Notify::new());
    let (e, p) = (entered.clone(), proceed.clone());
    let layer = LockLayer::new(backend.clone(), PathParam("sku")).namespace("sku");
    let locker = layer.locker().clone();
    let app = Router::new()
        .route(
            "/orders/{sku}",
            post(move || async move {
                e.notify_one();
                p.notified().await;
                "done"
            }),
        )
        .route_layer(layer)
        .route(
            "/peek/{sku}",
            get(|locker: Locker, Path(sku): Path<String>| async move {
                locker.lock(&sku).fail_fast().await.map(|_| "free")
            }),
        )
        .layer(Extension(locker));
    let addr = serve(app).await;
    let mut c1 = Client::connect(addr).await.unwrap();
    let request = tokio::spawn(async move { c1.post("/orders/A1").await.unwrap() });
    entered.notified().await;
    let mut c2 = Client::connect(addr).await.unwrap();
    let peek = c2.send("GET", "/peek/A1", &[]).await.unwrap();
    assert_eq!(peek.status, StatusCode::LOCKED, "{}", peek.body);
    proceed.notify_one();
    assert_eq!(request.await.unwrap().body, "done");
    assert_eq!(backend.active_keys(), 0);
}

#[tokio::test]
async fn a_lock_error_from_a_handler_gets_the_layers_rejection_policy() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend.clone(), PathParam("sku"))
        .namespace("sku")
        .retry_after(Duration::from_secs(7));
    let locker = layer.locker().clone();
    let app = Router::new()
        .route(
            "/orders/{sku}",
            post(|locker: Locker| async move {
                // Another key, held elsewhere: `?` answers with the error.
                locker.lock("other").fail_fast().await.map(|_| "free")
            }),
        )
        .route_layer(layer)
        .layer(Extension(locker.clone()));
    let _other = locker.lock("other").await.unwrap();
    let mut c = Client::connect(serve(app).await).await.unwrap();
    let reply = c.post("/orders/A1").await.unwrap();
    assert_eq!(reply.status, StatusCode::LOCKED);
    assert_eq!(reply.headers["retry-after"], "7", "the layer's retry_after");

    // And its `on_rejection`.
    let layer = LockLayer::new(backend.clone(), PathParam("sku"))
        .namespace("sku")
        .on_rejection(|r| {
            let mut res = Response::new(Bytes::from(format!("custom: {r}")));
            *res.status_mut() = StatusCode::CONFLICT;
            res
        });
    let app =
        Router::new()
            .route(
                "/orders/{sku}",
                post(|locker: Locker| async move {
                    locker.lock("other").fail_fast().await.map(|_| "free")
                }),
            )
            .route_layer(layer)
            .layer(Extension(locker.clone()));
    let mut c = Client::connect(serve(app).await).await.unwrap();
    let reply = c.post("/orders/A1").await.unwrap();
    assert_eq!(reply.status, StatusCode::CONFLICT);
    assert_eq!(reply.body, "custom: lock is held by someone else");
}

#[tokio::test]
async fn key_functions_say_why_and_headers_take_any_case() {
    let backend = MemoryBackend::new();
    let source = KeyFn::new("header `x-order`", |parts: &Parts| {
        let order = parts
            .headers
            .get("x-order")
            .ok_or(KeyError::missing("send the order id in x-order"))?;
        let order = order.to_str().map_err(|_| KeyError::NotUtf8)?;
        if !order.bytes().all(|b| b.is_ascii_digit()) {
            return Err(KeyError::refused(format!(
                "order {order:?} is not a number"
            )));
        }
        Ok(order.to_owned())
    });
    let app = Router::new()
        .route(
            "/strict",
            post(|held: HeldLock| async move { held.key().to_string() })
                .route_layer(LockLayer::new(backend.clone(), source).namespace("order")),
        )
        .route(
            "/lenient",
            post(|held: Option<HeldLock>| async move { format!("{:?}", held.map(|h| h.token())) })
                .route_layer(
                    LockLayer::new(
                        backend.clone(),
                        KeyFn::new("header `x-order`", |_: &Parts| {
                            Err(KeyError::missing("no order"))
                        }),
                    )
                    .on_missing_key(OnMissingKey::PassThrough),
                ),
        )
        .route(
            "/upper",
            post(|held: HeldLock| async move { held.key().to_string() })
                .route_layer(LockLayer::new(backend.clone(), Header::new("X-Account-ID"))),
        )
        .route(
            "/query",
            post(|held: HeldLock| async move { held.key().to_string() })
                .route_layer(LockLayer::new(backend.clone(), QueryParam("cart"))),
        );
    let mut c = Client::connect(serve(app).await).await.unwrap();
    let reply = c.send("POST", "/strict", &[]).await.unwrap();
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.body.trim(),
        "missing lock key (header `x-order`): send the order id in x-order"
    );
    let reply = c
        .send("POST", "/strict", &[("x-order", b"12a")])
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(
        reply.body.contains("order \"12a\" is not a number"),
        "{}",
        reply.body
    );
    let reply = c
        .send("POST", "/strict", &[("x-order", b"12")])
        .await
        .unwrap();
    assert_eq!(reply.body, "order:12");
    let reply = c.send("POST", "/lenient", &[]).await.unwrap();
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (StatusCode::OK, "None")
    );
    let reply = c
        .send("POST", "/upper", &[("x-account-id", b"7")])
        .await
        .unwrap();
    assert_eq!(reply.body, "7");
    // Harmless: `..` inside a key, the same value given twice.
    let reply = c.send("POST", "/query?cart=a..b", &[]).await.unwrap();
    assert_eq!(reply.body, "a..b");
    let reply = c.send("POST", "/query?cart=c1&cart=c1", &[]).await.unwrap();
    assert_eq!(reply.body, "c1");
    assert_eq!(backend.active_keys(), 0);
}

#[test]
fn an_invalid_header_name_panics_with_a_clear_message() {
    let panic = std::panic::catch_unwind(|| Header::new("x account")).unwrap_err();
    let message = panic.downcast_ref::<String>().unwrap();
    assert!(
        message.contains("invalid header name \"x account\" for a lock key"),
        "{message}"
    );
    assert!(Header::try_new("x account").is_err());
}

#[tokio::test]
async fn grpc_rejections_carry_grpc_status_and_message() {
    let backend = MemoryBackend::new();
    let app = Router::new().route(
        "/svc/Method",
        post(|| async { "ok" }).route_layer(
            LockLayer::new(backend.clone(), Header::new("x-account-id"))
                .fail_fast()
                .grpc_rejections(),
        ),
    );
    let mut c = Client::connect(serve(app).await).await.unwrap();
    let reply = c.send("POST", "/svc/Method", &[]).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["content-type"], "application/grpc");
    assert_eq!(reply.headers["grpc-status"], "3");
    assert_eq!(
        reply.headers["grpc-message"],
        "missing lock key: the request has no header `x-account-id`"
    );
    let _held = backend.lock("7").await.unwrap();
    let reply = c
        .send("POST", "/svc/Method", &[("x-account-id", b"7")])
        .await
        .unwrap();
    assert_eq!(reply.headers["grpc-status"], "10");
    assert_eq!(reply.headers["grpc-retry-pushback-ms"], "1000");
    // The message is percent-encoded as the gRPC spec asks (`%` itself too).
    let reply = c
        .send(
            "POST",
            "/svc/Method",
            &[("x-account-id", "50%\u{200b}".as_bytes())],
        )
        .await
        .unwrap();
    assert_eq!(reply.headers["grpc-status"], "3");
    let message = reply.headers["grpc-message"].to_str().unwrap();
    assert!(
        message.starts_with("invalid lock key \"50%25\\u{200b}\""),
        "{message}"
    );
    assert_eq!(backend.active_keys(), 1, "only the test's own lock");
}
