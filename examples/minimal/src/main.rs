//! The smallest real tower-lock app: one axum route under the `LockLayer`,
//! on the memory backend, called once by a hyper client.
//!
//! ```text
//! cargo run -p example-minimal     # prints: 200 OK: order for sku-1 (fencing token 1)
//! ```
//!
//! It is also the yardstick for the README's main command:
//! `scripts/first-build.sh` builds this and `cargo run --example
//! order_service` from empty target directories and prints both times.

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use hyper::body::Incoming;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tower_lock::{HeldLock, LockLayer, MemoryBackend, PathParam};

async fn create_order(held: HeldLock) -> String {
    format!("order for {} (fencing token {})", held.key(), held.token())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let app = Router::new()
        .route("/orders/{sku}", post(create_order))
        .route_layer(LockLayer::new(MemoryBackend::new(), PathParam("sku")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let request = Request::post("/orders/sku-1")
        .header("host", addr.to_string())
        .body(Body::empty())?;
    let response: hyper::Response<Incoming> = sender.send_request(request).await?;
    let status = response.status();
    let body = axum::body::to_bytes(Body::new(response.into_body()), 1 << 16).await?;
    println!("{status}: {}", String::from_utf8_lossy(&body));
    Ok(())
}
