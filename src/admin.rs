//! This process's view of its locks: the keys it holds and how many of its
//! acquisitions wait for each, for an internal endpoint.
//!
//! Nothing is recorded until [`track`] (or [`router`], which calls it) is
//! called: a process that never asks pays one relaxed atomic load per
//! grant, release and wait. Once tracking, each of those also takes a
//! process-wide mutex. Locks taken before tracking began are not listed.
//!
//! What other processes hold, only the store can say.
//!
//! # Examples
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use tower_lock::{admin, BackendExt, MemoryBackend};
//!
//! admin::track();
//! let backend = MemoryBackend::new();
//! let _held = backend.lock("sku-1").await.unwrap();
//! let view = admin::snapshot();
//! assert!(view.held.iter().any(|h| h.key.as_str() == "sku-1"));
//! println!("{}", view.to_json());
//! # }
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::key::LockKey;
use crate::mode::LockMode;
use crate::token::FencingToken;

static TRACKING: AtomicBool = AtomicBool::new(false);

/// Held locks by backend, key and token (a count: shared modes may hand
/// out one token to several holders); acquisitions waiting by backend and
/// key.
#[derive(Default)]
struct Registry {
    held: HashMap<(&'static str, LockKey, u64), Held>,
    waiting: HashMap<(&'static str, LockKey), u32>,
}

struct Held {
    mode: LockMode,
    since: Instant,
    count: u32,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Mutex::default);

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts recording this process's held locks and waiting acquisitions,
/// for [`snapshot`]. Idempotent; there is no stopping.
pub fn track() {
    TRACKING.store(true, Ordering::Relaxed);
}

#[inline]
fn tracking() -> bool {
    TRACKING.load(Ordering::Relaxed)
}

/// A lock this process holds.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HeldKey {
    /// The key, namespace included.
    pub key: LockKey,
    /// The backend's [name](crate::Backend::name).
    pub backend: &'static str,
    /// The mode it is held in.
    pub mode: LockMode,
    /// Its fencing token.
    pub token: FencingToken,
    /// How long it has been held.
    pub held_for: Duration,
    /// Holders of this key, backend and token in this process: more than
    /// one for shared modes.
    pub holders: u32,
}

/// A key this process's acquisitions wait for.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WaitingKey {
    /// The key, namespace included.
    pub key: LockKey,
    /// The backend's name.
    pub backend: &'static str,
    /// Acquisitions under way: waiting for the key, or for the server's
    /// answer.
    pub waiting: u32,
}

/// What this process holds and waits for, at one moment.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ProcessLocks {
    /// Whether [`track`] had been called: if not, both lists are empty
    /// whatever the process holds.
    pub tracking: bool,
    /// Held locks, longest held first.
    pub held: Vec<HeldKey>,
    /// Keys waited for, most waiters first.
    pub waiting: Vec<WaitingKey>,
}

/// What this process holds and waits for now (since [`track`]).
pub fn snapshot() -> ProcessLocks {
    let now = Instant::now();
    let r = registry();
    let mut held: Vec<HeldKey> = r
        .held
        .iter()
        .map(|((backend, key, token), h)| HeldKey {
            key: key.clone(),
            backend,
            mode: h.mode,
            token: FencingToken::new(*token),
            held_for: now.saturating_duration_since(h.since),
            holders: h.count,
        })
        .collect();
    let mut waiting: Vec<WaitingKey> = r
        .waiting
        .iter()
        .map(|((backend, key), &waiting)| WaitingKey {
            key: key.clone(),
            backend,
            waiting,
        })
        .collect();
    drop(r);
    held.sort_by(|a, b| b.held_for.cmp(&a.held_for).then_with(|| a.key.cmp(&b.key)));
    waiting.sort_by(|a, b| b.waiting.cmp(&a.waiting).then_with(|| a.key.cmp(&b.key)));
    ProcessLocks {
        tracking: tracking(),
        held,
        waiting,
    }
}

impl ProcessLocks {
    /// As JSON: `{"tracking":true,"held":[{"key":…,"backend":…,"mode":…,
    /// "token":…,"held_ms":…,"holders":…}],"waiting":[{"key":…,"backend":…,
    /// "waiting":…}]}`.
    pub fn to_json(&self) -> String {
        let mut out = format!("{{\"tracking\":{},\"held\":[", self.tracking);
        for (i, h) in self.held.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str("{\"key\":");
            crate::json::string(&mut out, h.key.as_str());
            let _ = write!(
                out,
                ",\"backend\":\"{}\",\"mode\":\"{}\",\"token\":{},\"held_ms\":{},\"holders\":{}}}",
                h.backend,
                h.mode,
                h.token.get(),
                h.held_for.as_millis(),
                h.holders
            );
        }
        out.push_str("],\"waiting\":[");
        for (i, w) in self.waiting.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str("{\"key\":");
            crate::json::string(&mut out, w.key.as_str());
            let _ = write!(
                out,
                ",\"backend\":\"{}\",\"waiting\":{}}}",
                w.backend, w.waiting
            );
        }
        out.push_str("]}");
        out
    }
}

/// An axum router answering `GET /` with this process's [`snapshot`] as
/// JSON; it starts [tracking](track). An internal endpoint: it names the
/// keys this process locks, so mount it behind the service's own
/// authentication, on an admin port or path.
///
/// # Examples
///
/// ```
/// use axum::Router;
/// use tower_lock::admin;
///
/// // Behind the service's own auth layer, e.g. `.route_layer(require_admin)`.
/// let app: Router = Router::new().nest("/internal/locks", admin::router());
/// ```
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub fn router<S: Clone + Send + Sync + 'static>() -> axum::Router<S> {
    track();
    axum::Router::new().route(
        "/",
        axum::routing::get(|| async {
            (
                [(http::header::CONTENT_TYPE, "application/json")],
                snapshot().to_json(),
            )
        }),
    )
}

/// A grant of `key` on `backend`: listed while tracking. Inlined down to
/// the check, which every lock pays; the listing is out of line.
#[inline]
pub(crate) fn granted(backend: &'static str, key: &LockKey, mode: LockMode, token: FencingToken) {
    if tracking() {
        list_grant(backend, key, mode, token);
    }
}

#[cold]
#[inline(never)]
fn list_grant(backend: &'static str, key: &LockKey, mode: LockMode, token: FencingToken) {
    registry()
        .held
        .entry((backend, key.clone(), token.get()))
        .and_modify(|h| h.count += 1)
        .or_insert(Held {
            mode,
            since: Instant::now(),
            count: 1,
        });
}

/// A release of a grant: unlisted. A grant made before tracking began is
/// not found, and nothing happens.
#[inline]
pub(crate) fn released(backend: &'static str, key: &LockKey, token: FencingToken) {
    if tracking() {
        unlist_grant(backend, key, token);
    }
}

#[cold]
#[inline(never)]
fn unlist_grant(backend: &'static str, key: &LockKey, token: FencingToken) {
    let key = (backend, key.clone(), token.get());
    let mut r = registry();
    if let Some(h) = r.held.get_mut(&key) {
        h.count -= 1;
        if h.count == 0 {
            r.held.remove(&key);
        }
    }
}

/// An acquisition under way, listed while tracking until dropped.
pub(crate) struct Waiting(Option<(&'static str, LockKey)>);

impl Waiting {
    pub(crate) fn start(backend: &'static str, key: &LockKey) -> Self {
        if !tracking() {
            return Waiting(None);
        }
        *registry()
            .waiting
            .entry((backend, key.clone()))
            .or_insert(0) += 1;
        Waiting(Some((backend, key.clone())))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(entry) = self.0.take() else {
            return;
        };
        let mut r = registry();
        if let Some(n) = r.waiting.get_mut(&entry) {
            *n -= 1;
            if *n == 0 {
                r.waiting.remove(&entry);
            }
        }
    }
}
