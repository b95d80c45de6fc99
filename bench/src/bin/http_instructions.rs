//! The `http` workload's routes called through tower in one process, no
//! sockets: run under `valgrind --tool=callgrind`, the instructions a
//! request costs on each route, a count that does not drift with the
//! machine's load. `scripts/count-instructions.sh` runs every route twice
//! and prints the difference per request.
//!
//! ```text
//! cargo build --release -p tower-lock-bench --bin http_instructions
//! valgrind --tool=callgrind target/release/http_instructions layer-handler 10000
//! ```
//!
//! Routes, all `POST /orders/{sku}` on a SKU of their own per request:
//! `bare`; `layer-handler` and `layer-route`, `LockLayer` on the memory
//! backend mounted on the handler or with `route_layer`, as the bench's
//! `--mount`; `identity-handler` and `identity-route`, a layer that does
//! nothing, mounted the same ways (axum's own share of a layer);
//! `hand-mutex-map`, the bench's hand-written peer; `layer-floor`, the least
//! a lock layer keyed like `PathParam` does (`orders::FloorLayer`). `--routes` lists
//! them, one a line.

use tower_lock_bench::orders;

use std::process::ExitCode;

use axum::body::Body;
use axum::handler::Handler;
use axum::routing::post;
use axum::Router;
use http::Request;
use tower::{Layer, Service, ServiceExt};
use tower_lock::{LockLayer, MemoryBackend, PathParam};

use orders::{order, order_mutex_map, FloorLayer, MutexMap};

/// A layer that returns its service unchanged.
#[derive(Clone)]
struct Identity;

impl<S> Layer<S> for Identity {
    type Service = S;

    fn layer(&self, service: S) -> S {
        service
    }
}

const ROUTES: [&str; 7] = [
    "bare",
    "layer-handler",
    "layer-route",
    "identity-handler",
    "identity-route",
    "hand-mutex-map",
    "layer-floor",
];

fn app(route: &str) -> Option<Router> {
    let lock = || LockLayer::new(MemoryBackend::new(), PathParam("sku"));
    let bare = || Router::new().route("/orders/{sku}", post(order));
    Some(match route {
        "bare" => bare(),
        "layer-handler" => Router::new().route("/orders/{sku}", post(order.layer(lock()))),
        "layer-route" => bare().route_layer(lock()),
        "identity-handler" => Router::new().route("/orders/{sku}", post(order.layer(Identity))),
        "identity-route" => bare().route_layer(Identity),
        "hand-mutex-map" => Router::new()
            .route("/orders/{sku}", post(order_mutex_map))
            .with_state(MutexMap::default()),
        "layer-floor" => {
            Router::new().route("/orders/{sku}", post(order.layer(FloorLayer::default())))
        }
        _ => return None,
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--routes") {
        println!("{}", ROUTES.join("\n"));
        return ExitCode::SUCCESS;
    }
    let (Some(mut app), Some(Ok(n))) = (
        args.first().and_then(|r| app(r)),
        args.get(1).map(|n| n.parse::<u64>()),
    ) else {
        eprintln!(
            "usage: http_instructions <{}> <requests> | --routes",
            ROUTES.join(" | ")
        );
        return ExitCode::from(2);
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        for i in 0..n {
            let request = Request::post(format!("/orders/sku-{i}"))
                .body(Body::empty())
                .expect("request");
            let ready = ServiceExt::<Request<Body>>::ready(&mut app).await;
            let response = ready.expect("ready").call(request).await.expect("call");
            assert!(response.status().is_success(), "{}", response.status());
        }
    });
    ExitCode::SUCCESS
}
