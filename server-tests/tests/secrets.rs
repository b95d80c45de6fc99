//! No secret leaves the process: a password in each backend's URL, with no
//! server behind it (or a URL the backend refuses), appears in no error
//! text, no `Debug`, no response body, no `grpc-message` and no line of
//! the tracing output, even with the layer's `error_details(true)`.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::Request;
use tower::ServiceExt;
use tower_lock::{BackendExt, LockError, LockLayer, LockRejection, PathParam};

const PASSWORD: &str = "s3cretPW";

/// Every URL form that takes a user and password, pointing where nothing
/// listens.
fn urls() -> Vec<String> {
    let p = PASSWORD;
    vec![
        format!("redis://:{p}@127.0.0.1:1"),
        format!("redis://user:{p}@127.0.0.1:1/0"),
        format!("rediss://:{p}@127.0.0.1:1"),
        format!("redis+sentinel://:{p}@127.0.0.1:1/master"),
        format!("redis+cluster://:{p}@127.0.0.1:1"),
        format!("redlock://:{p}@127.0.0.1:1,:{p}@127.0.0.1:2,:{p}@127.0.0.1:3"),
        format!("redlock://:{p}@127.0.0.1:1"),
        format!("zk://user:{p}@127.0.0.1:1"),
        format!("postgres://user:{p}@127.0.0.1:1/test"),
        format!("postgres://user:{p}@127.0.0.1:1/test?lease_table"),
        format!("mysql://root:{p}@127.0.0.1:1/test"),
        format!("etcd://user:{p}@127.0.0.1:1"),
        format!("carrier-pigeon://user:{p}@coop"),
        // Punctuation a password may hold unencoded, and hosts in brackets.
        format!("redis://:{p}(x)0@127.0.0.1:1"),
        format!("redis://:a,{p}@127.0.0.1:1"),
        format!("redis://:{p}'b;c@127.0.0.1:1"),
        format!("redlock://:{p}@[::1]:1,:{p}@[::1]:2"),
        format!("redlock://:{p}@127.0.0.1:1,:{p}@127.0.0.1:2,:{p}@127.0.0.1:3#bad"),
        // A password with no `@`: a Unix socket's query.
        format!("redis+unix:///nonexistent/r.sock?pass={p}"),
        format!("postgres://user:{p}@127.0.0.1:1/test?sslmode=disable"),
        format!("redis://:{p}@[not a host"),
    ]
}

/// Tracing output, all of it, into a buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn assert_no_secret(what: &str, url: &str, text: &str) {
    assert!(
        !text.contains(PASSWORD),
        "{url}: the password is in the {what}: {text}"
    );
}

/// What a client gets from a route under `layer`: status, headers, body.
async fn answer(layer: LockLayer) -> (http::StatusCode, http::HeaderMap, String) {
    let app = Router::new()
        .route("/{k}", post(|| async { "locked" }))
        .route_layer(layer);
    let response = app
        .oneshot(Request::post("/k").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, 1 << 16).await.unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// Everything a client or a log could see of `error`.
async fn check_error(url: &str, error: &LockError) {
    assert_no_secret("error text", url, &error.to_string());
    assert_no_secret("error's Debug", url, &format!("{error:?}"));
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        assert_no_secret("source chain", url, &format!("{s} / {s:?}"));
        source = s.source();
    }
    let rejection = LockRejection::Lock(match error {
        LockError::Config(m) => LockError::Config(m.clone()),
        other => LockError::backend("test", other.to_string(), None),
    });
    let body = rejection.to_response(Duration::from_secs(1)).into_body();
    assert_no_secret("response body", url, &String::from_utf8_lossy(&body));
    let grpc = rejection.to_grpc_response(Duration::from_secs(1));
    let message = grpc
        .headers()
        .get("grpc-message")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_no_secret("grpc-message", url, &message.unwrap_or_default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_leaves_through_errors_bodies_or_logs() {
    let captured = Captured::default();
    let writer = captured.clone();
    // Every thread's events and every span with its fields, as they close.
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber here");

    for url in urls() {
        let connected =
            tokio::time::timeout(Duration::from_secs(20), tower_lock::backend::connect(&url))
                .await
                .unwrap_or_else(|_| panic!("{url}: connect did not answer within 20 s"));
        let backend = match connected {
            Err(e) => {
                check_error(&url, &e).await;
                continue;
            }
            Ok(backend) => backend,
        };
        // Connected lazily: the first lock meets the dead server.
        // Fail-fast: the backend's own error, not a wait that ran out.
        let error = backend
            .lock("k")
            .fail_fast()
            .await
            .expect_err("locked through a dead server");
        check_error(&url, &error).await;
        // Through the layer, with every detail shown.
        for details in [false, true] {
            for grpc in [false, true] {
                let mut layer = LockLayer::new(backend.clone(), PathParam("k"))
                    .fail_fast()
                    .error_details(details);
                if grpc {
                    layer = layer.grpc_rejections();
                }
                let (_, headers, body) = answer(layer).await;
                assert_no_secret("response headers", &url, &format!("{headers:?}"));
                assert_no_secret("layer's response body", &url, &body);
            }
        }
    }
    let redlock = format!(
        "redlock://:{PASSWORD}@127.0.0.1:1,:{PASSWORD}@127.0.0.1:2,:{PASSWORD}@127.0.0.1:3"
    );
    let backend = tower_lock::backend::redis::redlock::RedlockBackend::connect(&redlock)
        .await
        .unwrap();
    assert_no_secret("backend's Debug", &redlock, &format!("{backend:?}"));
    let logs = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
    assert!(
        !logs.is_empty(),
        "the tracing capture saw nothing: it would prove nothing"
    );
    assert_no_secret("tracing output", "every URL", &logs);
}

#[tokio::test]
async fn default_bodies_say_what_happened_in_words_and_details_are_opt_in() {
    let down = LockError::backend("redis", "connecting to 10.0.0.7:6379", None);
    let rejection = LockRejection::Lock(down);
    let body = rejection.to_response(Duration::from_secs(1)).into_body();
    assert_eq!(&body[..], b"lock backend unavailable\n");
    let grpc = rejection.to_grpc_response(Duration::from_secs(1));
    assert_eq!(grpc.headers()["grpc-message"], "lock backend unavailable");
    assert!(rejection.to_string().contains("10.0.0.7:6379"));

    // Through a layer on a dead Redlock: words by default, details on request.
    let url = "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3";
    let backend = tower_lock::backend::connect(url).await.unwrap();
    for (details, expect_port) in [(false, false), (true, true)] {
        let layer = LockLayer::new(backend.clone(), PathParam("k"))
            .fail_fast()
            .error_details(details);
        let (status, _, body) = answer(layer).await;
        assert_eq!(status, 503);
        assert_eq!(
            body.contains("127.0.0.1:1"),
            expect_port,
            "details {details}: {body}"
        );
        if !details {
            assert_eq!(body, "lock backend unavailable\n");
        }
    }
}
