//! `http`: the bare route, the route under `LockLayer`, the hand-written
//! mutex map and the floor layer, served in this process and driven by the
//! same clients.

use super::*;

use axum::handler::Handler;

use tower_lock_bench::orders::{order, order_mutex_map, FloorLayer, MutexMap};

use crate::raw_locks::{self, order_raw, RawLock};

async fn serve(app: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Connections to one server, kept for the whole run.
struct Clients {
    clients: Vec<tower_lock_example_support::Client>,
    /// Distinguishes the SKUs of every request this set sends.
    sent: u64,
}

impl Clients {
    async fn connect(addr: std::net::SocketAddr, conns: usize) -> Clients {
        let mut clients = Vec::with_capacity(conns);
        for _ in 0..conns {
            clients.push(
                tower_lock_example_support::Client::connect(addr)
                    .await
                    .expect("connect"),
            );
        }
        Clients { clients, sent: 0 }
    }

    /// Every connection sends requests back to back for `dur`, each on a SKU
    /// no other request uses; returns how many completed and the time they
    /// took (from the start until the last request in flight at `dur` is
    /// answered).
    async fn drive(&mut self, dur: Duration) -> (u64, Duration) {
        let stop = Arc::new(AtomicBool::new(false));
        let base = self.sent;
        let started = Instant::now();
        let tasks: Vec<_> = self
            .clients
            .drain(..)
            .enumerate()
            .map(|(c, mut client)| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut done = 0u64;
                    let mut path = String::with_capacity(48);
                    while !stop.load(Ordering::Relaxed) {
                        use std::fmt::Write;
                        path.clear();
                        write!(path, "/orders/sku-{base}-{c}-{done}").unwrap();
                        let reply = client.post(&path).await.expect("request");
                        assert!(reply.status.is_success(), "{} {}", reply.status, reply.body);
                        done += 1;
                    }
                    (client, done)
                })
            })
            .collect();
        tokio::time::sleep(dur).await;
        stop.store(true, Ordering::Relaxed);
        let mut total = 0;
        for t in tasks {
            let (client, done) = t.await.expect("client");
            self.clients.push(client);
            total += done;
        }
        self.sent += total;
        (total, started.elapsed())
    }
}

/// Requests per second of the `http` routes.
pub(super) struct Rates {
    pub(super) bare: f64,
    /// Under `LockLayer` (bare under `--calibrate`).
    pub(super) locked: f64,
    /// Under the hand-written mutex map (bare under `--calibrate`), on the
    /// memory backend.
    pub(super) peer: Option<f64>,
    /// Under the floor layer (`orders::FloorLayer`), on the memory backend
    /// and not under `--calibrate`.
    pub(super) floor: Option<f64>,
    /// Under the backend's raw lock commands (`raw_locks`), on a remote
    /// backend and not under `--calibrate`.
    pub(super) raw: Option<f64>,
}

/// The `impl=` of the `http` workload's floor: the least a lock layer keyed
/// like `PathParam` does.
pub(super) const LAYER_FLOOR: &str = "layer-floor";

/// The `impl=` of the `http` workload's hand-written peer.
pub(super) const HAND_MUTEX_MAP: &str = "hand-mutex-map";

/// Where the `http` workload mounts `LockLayer` (`--mount`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Mount {
    /// On the route's handler, `post(order.layer(layer))`: the same place as
    /// the hand-written peer's lock, and the cheaper one (the default).
    Handler,
    /// Over the router's routes, `Router::route_layer`: axum boxes the
    /// layered route and its future again, for any layer (`mount=route`).
    Route,
}

impl Mount {
    /// What the lines of a run mounted this way carry after the workload.
    pub(super) fn tag(self) -> &'static str {
        match self {
            Mount::Handler => "",
            Mount::Route => " mount=route",
        }
    }
}

/// Servers in this process, one per route, each with its own `conns`
/// connections from the same client code: the bare route, the route under
/// `LockLayer` (mounted as `mount` says) and, on the memory backend, the
/// route under the hand-written mutex map (`impl=hand-mutex-map`) and the
/// route under the floor layer mounted the same way (`impl=layer-floor`,
/// not under `--calibrate`); on a remote backend, the route under the raw
/// lock commands `raw` sends (`rps_floor`, not under `--calibrate`). Under
/// `--calibrate` every route but the floors is the bare one, which shows
/// how far apart identical routes measure.
/// The phases alternate in order and in reverse (A-B-B-A with two routes,
/// A-B-C-C-B-A with three, A-B-C-D-D-C-B-A with four), so that drift falls
/// on every route alike; a rate is the requests a route answered over the
/// time its phases actually took.
pub(super) async fn http(
    backend: Arc<dyn Backend>,
    conns: usize,
    secs: u64,
    calibrate: bool,
    mount: Mount,
    raw: Option<Arc<RawLock>>,
) -> Rates {
    let route = || Router::new().route("/orders/{sku}", post(order));
    // The hand-written map is a peer of the memory backend only: it locks
    // within one process.
    let with_peer = backend.name() == "memory";
    let mut addrs = vec![serve(route()).await];
    addrs.push(if calibrate {
        serve(route()).await
    } else {
        let layer = LockLayer::with_locker(Locker::from_arc(backend), PathParam("sku"));
        serve(match mount {
            Mount::Handler => Router::new().route("/orders/{sku}", post(order.layer(layer))),
            Mount::Route => route().route_layer(layer),
        })
        .await
    });
    let map: MutexMap = Arc::default();
    if with_peer {
        addrs.push(if calibrate {
            serve(route()).await
        } else {
            serve(
                Router::new()
                    .route("/orders/{sku}", post(order_mutex_map))
                    .with_state(map.clone()),
            )
            .await
        });
    }
    let floor = FloorLayer::default();
    if with_peer && !calibrate {
        addrs.push(
            serve(match mount {
                Mount::Handler => {
                    Router::new().route("/orders/{sku}", post(order.layer(floor.clone())))
                }
                Mount::Route => route().route_layer(floor.clone()),
            })
            .await,
        );
    }
    let raw = raw.filter(|_| !calibrate);
    let raw_route = raw.clone().map(|raw| {
        let at = addrs.len();
        (
            at,
            Router::new()
                .route("/orders/{sku}", post(order_raw))
                .with_state(raw),
        )
    });
    if let Some((_, router)) = raw_route.clone() {
        addrs.push(serve(router).await);
    }
    let mut routes = Vec::new();
    for addr in addrs {
        routes.push(Clients::connect(addr, conns).await);
    }
    // Warm up, then alternate short phases.
    for clients in &mut routes {
        clients.drive(Duration::from_millis(250)).await;
    }
    let phases = (secs * 10).max(2) as u32;
    let phase = Duration::from_secs(secs) / phases;
    // Requests answered and the time they took, per route.
    let mut sums = vec![(0u64, Duration::ZERO); routes.len()];
    for i in 0..phases {
        let mut turns: Vec<usize> = (0..routes.len()).collect();
        if i % 2 == 1 {
            turns.reverse();
        }
        for r in turns {
            let (n, t) = routes[r].drive(phase).await;
            sums[r].0 += n;
            sums[r].1 += t;
        }
    }
    // Every request has been answered: a map that forgets idle keys is
    // empty again, although every request used a SKU of its own.
    assert!(map.is_empty(), "the mutex map kept {} idle keys", map.len());
    assert!(floor.is_empty(), "the floor layer kept keys");
    raw_locks::released().await;
    let rps: Vec<f64> = sums
        .iter()
        .map(|(n, t)| *n as f64 / t.as_secs_f64())
        .collect();
    let raw_at = raw_route.map(|(at, _)| at);
    Rates {
        bare: rps[0],
        locked: rps[1],
        peer: with_peer.then(|| rps.get(2).copied()).flatten(),
        floor: with_peer.then(|| rps.get(3).copied()).flatten(),
        raw: raw_at.map(|at| rps[at]),
    }
}
