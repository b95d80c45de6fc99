//! The `http` workload's handlers: the bare route's, and the hand-written
//! peer, what a user would write instead of `LockLayer` on one process.
//! Shared by the bench program and the instruction counts
//! (`examples/http_instructions.rs`).

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
