//! The `http` workload's handlers: the bare route's, the hand-written peer
//! (what a user would write instead of `LockLayer` on one process), and the
//! floor of a lock layer on the route.
//! Shared by the bench program and the instruction counts
//! (`src/bin/http_instructions.rs`).

use std::sync::Arc;

use axum::extract::{Path, State};
use dashmap::DashMap;

/// `POST /orders/{sku}`: answers the SKU and does nothing else.
pub async fn order(Path(sku): Path<String>) -> String {
    sku
}

/// The handler a user would write instead of the library: a shared map of
/// per-key `tokio::sync::Mutex`es, the entry removed when its last user
/// leaves so that the map does not grow with every key ever seen.
pub type MutexMap = Arc<DashMap<String, Arc<tokio::sync::Mutex<()>>>>;

/// One user's share of a key's mutex in a [`MutexMap`]. Every clone and
/// every drop of the `Arc` in the map happens under the map's shard lock,
/// so the strong count seen there is exact: the user that leaves last
/// (count back to 1, the map's own) removes the entry. A request cancelled
/// while it waits leaves through the same `Drop`.
pub struct MapEntry<'a> {
    map: &'a DashMap<String, Arc<tokio::sync::Mutex<()>>>,
    key: String,
    mutex: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl<'a> MapEntry<'a> {
    pub fn enter(map: &'a DashMap<String, Arc<tokio::sync::Mutex<()>>>, key: &str) -> Self {
        let mutex = map.entry(key.to_owned()).or_default().value().clone();
        MapEntry {
            map,
            key: key.to_owned(),
            mutex: Some(mutex),
        }
    }

    pub fn mutex(&self) -> &tokio::sync::Mutex<()> {
        self.mutex.as_deref().expect("entered")
    }
}

impl Drop for MapEntry<'_> {
    fn drop(&mut self) {
        let ours = self.mutex.take();
        if let dashmap::Entry::Occupied(e) = self.map.entry(std::mem::take(&mut self.key)) {
            // Under the shard lock: no one can clone the entry meanwhile.
            drop(ours);
            if Arc::strong_count(e.get()) == 1 {
                e.remove();
            }
        }
    }
}

/// `POST /orders/{sku}` under the hand-written lock: the same handler as the
/// bare route, called while the SKU's mutex is held.
pub async fn order_mutex_map(State(map): State<MutexMap>, Path(sku): Path<String>) -> String {
    let entry = MapEntry::enter(&map, &sku);
    let _held = entry.mutex().lock().await;
    order(Path(sku)).await
    // `_held` unlocks, then `entry` leaves the map (reverse declaration order).
}

/// The floor of a lock layer on this route: a tower layer that does the
/// least a layer keyed by `PathParam` must do, with none of the library's
/// machinery. It reads the `sku` path parameter through `RawPathParams` (as
/// `PathParam` does), hashes it once and records the hash in a sharded set
/// (two keys with one 64-bit hash would share a lock: never a missed
/// exclusion, and no copy of the key to allocate), calls the handler, and
/// removes the hash when the response is ready. It never waits, keeps no
/// fencing token, lost signal or re-entrancy scope, and checks nothing: a
/// request whose key is taken gets 423. The `http` workload never contends,
/// so this is what such a layer costs before it does anything a lock
/// library is for (`impl=layer-floor`).
#[derive(Clone, Default)]
pub struct FloorLayer {
    held: Arc<FloorSet>,
}

/// Hashes of the keys held, in shards like the memory backend's.
pub struct FloorSet {
    hasher: foldhash::fast::RandomState,
    shards: Vec<FloorShard>,
}

/// One shard, on a cache line of its own (as `DashMap` pads its shards), so
/// that the two cores do not contend on neighbours.
#[derive(Default)]
#[repr(align(128))]
struct FloorShard(std::sync::Mutex<std::collections::HashSet<u64, foldhash::fast::FixedState>>);

impl Default for FloorSet {
    fn default() -> Self {
        FloorSet {
            hasher: Default::default(),
            shards: (0..64).map(|_| Default::default()).collect(),
        }
    }
}

impl FloorLayer {
    /// Whether no key is held: every request released its own.
    #[allow(dead_code)] // The bench checks it; the instruction counts do not.
    pub fn is_empty(&self) -> bool {
        self.held
            .shards
            .iter()
            .all(|s| s.0.lock().expect("floor shard").is_empty())
    }
}

impl FloorSet {
    /// Inserts `hash`; false if it is held already.
    fn insert(&self, hash: u64) -> bool {
        self.shard(hash).insert(hash)
    }

    fn remove(&self, hash: u64) {
        self.shard(hash).remove(&hash);
    }

    fn shard(
        &self,
        hash: u64,
    ) -> std::sync::MutexGuard<'_, std::collections::HashSet<u64, foldhash::fast::FixedState>> {
        let shard = &self.shards[hash as usize % self.shards.len()];
        shard.0.lock().expect("floor shard")
    }
}

impl<S> tower::Layer<S> for FloorLayer {
    type Service = FloorService<S>;

    fn layer(&self, inner: S) -> FloorService<S> {
        FloorService {
            inner,
            held: self.held.clone(),
        }
    }
}

#[derive(Clone)]
pub struct FloorService<S> {
    inner: S,
    held: Arc<FloorSet>,
}

/// Removes its key's hash from the set when dropped.
pub struct FloorHold {
    held: Arc<FloorSet>,
    hash: u64,
}

impl Drop for FloorHold {
    fn drop(&mut self) {
        self.held.remove(self.hash);
    }
}

pin_project_lite::pin_project! {
    /// The handler's future, then the hold released as soon as it is ready.
    pub struct FloorFuture<F> {
        #[pin]
        inner: Option<F>,
        hold: Option<FloorHold>,
    }
}

impl<F> std::future::Future for FloorFuture<F>
where
    F: std::future::Future<Output = Result<axum::response::Response, std::convert::Infallible>>,
{
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let Some(inner) = this.inner.as_pin_mut() else {
            // Refused: the key was taken.
            let status = http::StatusCode::LOCKED;
            return std::task::Poll::Ready(Ok(axum::response::IntoResponse::into_response(status)));
        };
        let response = std::task::ready!(inner.poll(cx));
        this.hold.take();
        std::task::Poll::Ready(response)
    }
}

impl<S> tower::Service<http::Request<axum::body::Body>> for FloorService<S>
where
    S: tower::Service<
        http::Request<axum::body::Body>,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
    >,
{
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = FloorFuture<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        use axum::extract::{FromRequestParts, RawPathParams};
        use std::future::Future;

        let (mut parts, body) = request.into_parts();
        let hash = {
            use std::hash::BuildHasher;
            // Reads the request extensions and never waits: one poll.
            let mut read = std::pin::pin!(RawPathParams::from_request_parts(&mut parts, &()));
            let waker = std::task::Waker::noop();
            match read
                .as_mut()
                .poll(&mut std::task::Context::from_waker(waker))
            {
                std::task::Poll::Ready(Ok(params)) => params
                    .iter()
                    .find(|(name, _)| *name == "sku")
                    .map(|(_, value)| self.held.hasher.hash_one(value)),
                _ => None,
            }
        };
        let hash = hash.expect("the route has a sku parameter");
        let inserted = self.held.insert(hash);
        if !inserted {
            return FloorFuture {
                inner: None,
                hold: None,
            };
        }
        let hold = FloorHold {
            held: self.held.clone(),
            hash,
        };
        FloorFuture {
            inner: Some(self.inner.call(http::Request::from_parts(parts, body))),
            hold: Some(hold),
        }
    }
}
