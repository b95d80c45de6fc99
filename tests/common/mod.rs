//! Helpers shared by the in-process tests (`mod common;` in each); the
//! server tests use them too.
#![allow(dead_code)]

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
