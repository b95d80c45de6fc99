//! The `http` workload's routes, called through tower in one process with
//! no sockets: what the instruction and allocation counts measure
//! (`src/bin/http_instructions.rs`, `src/bin/http_allocations.rs`,
//! `tests/allocations.rs`).
//!
//! Routes, all `POST /orders/{sku}` on a SKU of their own per request:
//! `bare`; `layer-handler` and `layer-route`, `LockLayer` on the memory
//! backend mounted on the handler or with `route_layer`, as the bench's
//! `--mount`; `identity-handler` and `identity-route`, a layer that does
//! nothing, mounted the same ways (axum's own share of a layer);
//! `hand-mutex-map`, the bench's hand-written peer; `layer-floor`, the
//! least a lock layer keyed like `PathParam` does
//! ([`FloorLayer`](crate::orders::FloorLayer)).

use axum::body::Body;
use axum::handler::Handler;
use axum::routing::post;
use axum::Router;
use http::Request;
use tower::{Layer, Service, ServiceExt};
use tower_lock::{LockLayer, MemoryBackend, PathParam};

use crate::orders::{order, order_mutex_map, FloorLayer, MutexMap};

/// Every route, by name.
pub const ROUTES: [&str; 7] = [
    "bare",
    "layer-handler",
    "layer-route",
    "identity-handler",
    "identity-route",
    "hand-mutex-map",
    "layer-floor",
];

/// A layer that returns its service unchanged.
#[derive(Clone)]
struct Identity;

impl<S> Layer<S> for Identity {
    type Service = S;

    fn layer(&self, service: S) -> S {
        service
    }
}

/// The app of route `route`, or `None` for a name not in [`ROUTES`].
pub fn app(route: &str) -> Option<Router> {
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

/// Sends `n` requests to `app` one after another, each on a SKU of its
/// own (`sku-<i>`, up to 13 bytes below ten million requests), starting at
/// `from`; panics on an answer that is not a success.
pub async fn serve(app: &mut Router, from: u64, n: u64) {
    for i in from..from + n {
        let request = Request::post(format!("/orders/sku-{i}"))
            .body(Body::empty())
            .expect("request");
        let ready = ServiceExt::<Request<Body>>::ready(&mut *app).await;
        let response = ready.expect("ready").call(request).await.expect("call");
        assert!(response.status().is_success(), "{}", response.status());
    }
}
