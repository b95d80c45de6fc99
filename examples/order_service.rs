//! The order-code generator from the seed articles, as an axum service.
//!
//! `POST /orders/{sku}` reads the SKU's last order number, waits a moment (a
//! database round trip, say), and writes number + 1: a read-modify-write that
//! hands out duplicate codes when two requests for one SKU overlap. The
//! `LockLayer` serialises them.
//!
//! ```text
//! cargo run --example order_service                 # ten concurrent requests, locked
//! cargo run --example order_service -- --no-lock    # the same without the lock: duplicates
//! cargo run --example order_service -- --serve      # then keep serving: curl -X POST http://ADDR/orders/sku-1
//! ```
//!
//! Flags: `--backend <url>` (`memory`; see `tower_lock::backend::connect`),
//! `--requests N` (default 10), `--sku S`, `--no-lock`, `--serve`.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::routing::post;
use axum::Router;
use tower_lock::{HeldLock, LockLayer, Locker, PathParam};

/// The shared state the handler races on.
struct Shop {
    started: Instant,
    last_number: Mutex<HashMap<String, u64>>,
    in_critical: AtomicUsize,
    max_in_critical: AtomicUsize,
}

/// How long the handler "talks to the database" between read and write.
const DB_ROUND_TRIP: Duration = Duration::from_millis(5);

async fn create_order(
    State(shop): State<Arc<Shop>>,
    Path(sku): Path<String>,
    held: Option<HeldLock>,
) -> String {
    let enter = shop.started.elapsed();
    let now_inside = shop.in_critical.fetch_add(1, Ordering::SeqCst) + 1;
    shop.max_in_critical.fetch_max(now_inside, Ordering::SeqCst);

    // Deliberately unsafe without the lock: read, await, write.
    let last = shop
        .last_number
        .lock()
        .unwrap()
        .get(&sku)
        .copied()
        .unwrap_or(0);
    tokio::time::sleep(DB_ROUND_TRIP).await;
    shop.last_number
        .lock()
        .unwrap()
        .insert(sku.clone(), last + 1);

    shop.in_critical.fetch_sub(1, Ordering::SeqCst);
    let leave = shop.started.elapsed();
    let (waited, token) = held.map_or((Duration::ZERO, 0), |h| (h.waited(), h.token().get()));
    format!(
        "code=ORD-{sku}-{:05} waited_us={} enter_us={} leave_us={} token={token}",
        last + 1,
        waited.as_micros(),
        enter.as_micros(),
        leave.as_micros(),
    )
}

struct Args {
    backend: String,
    requests: usize,
    sku: String,
    no_lock: bool,
    serve: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backend: "memory".into(),
        requests: 10,
        sku: "SKU-1001".into(),
        no_lock: false,
        serve: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => args.backend = value()?,
            "--requests" => {
                args.requests = value()?
                    .parse()
                    .map_err(|e| format!("--requests: {e}"))?;
            }
            "--sku" => args.sku = value()?,
            "--no-lock" => args.no_lock = true,
            "--serve" => args.serve = true,
            "-h" | "--help" => {
                return Err("usage: order_service [--backend URL] [--requests N] [--sku S] [--no-lock] [--serve]".into())
            }
            other => return Err(format!("unknown flag {other}; try --help")),
        }
    }
    if args.requests == 0 {
        return Err("--requests must be at least 1".into());
    }
    Ok(args)
}

/// One finished request, parsed from its reply.
struct Outcome {
    code: String,
    waited_us: u64,
    enter_us: u64,
    leave_us: u64,
    token: u64,
}

fn parse_reply(body: &str) -> Option<Outcome> {
    let field = |name: &str| {
        body.split(' ')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    };
    Some(Outcome {
        code: field("code")?.to_owned(),
        waited_us: field("waited_us")?.parse().ok()?,
        enter_us: field("enter_us")?.parse().ok()?,
        leave_us: field("leave_us")?.parse().ok()?,
        token: field("token")?.trim().parse().ok()?,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    // `RUST_LOG=tower_lock=debug` shows one span per acquisition.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let backend = match tower_lock::backend::connect(&args.backend).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!("order_service: {e}");
            return ExitCode::from(2);
        }
    };

    let shop = Arc::new(Shop {
        started: Instant::now(),
        last_number: Mutex::new(HashMap::new()),
        in_critical: AtomicUsize::new(0),
        max_in_critical: AtomicUsize::new(0),
    });
    let mut app = Router::new().route("/orders/{sku}", post(create_order));
    if !args.no_lock {
        let locker = Locker::from_arc(backend).wait(Duration::from_secs(10));
        app = app.route_layer(LockLayer::with_locker(locker, PathParam("sku")).namespace("sku"));
    }
    let app = app.with_state(shop.clone());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    println!(
        "order_service on http://{addr} (backend {}, {})",
        args.backend,
        if args.no_lock {
            "NO lock"
        } else {
            "LockLayer on path parameter `sku`"
        }
    );

    let outcomes = fire(addr, &args.sku, args.requests).await;
    report(&outcomes, args.requests, &shop);

    if args.serve {
        println!(
            "serving until Ctrl-C: curl -X POST http://{addr}/orders/{}",
            args.sku
        );
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            r = server => { eprintln!("server stopped: {r:?}"); }
        }
    }
    ExitCode::SUCCESS
}

/// Sends `n` concurrent requests for one SKU, each on its own connection.
async fn fire(addr: SocketAddr, sku: &str, n: usize) -> Vec<Option<Outcome>> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(common::Client::connect(addr).await.expect("connect"));
    }
    let path = format!("/orders/{sku}");
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            let path = path.clone();
            tokio::spawn(async move {
                match c.post(&path).await {
                    Ok(r) if r.status.is_success() => parse_reply(&r.body),
                    Ok(r) => {
                        eprintln!("request failed: {} {}", r.status, r.body.trim());
                        None
                    }
                    Err(e) => {
                        eprintln!("request failed: {e}");
                        None
                    }
                }
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(n);
    for t in tasks {
        outcomes.push(t.await.expect("request task"));
    }
    outcomes
}

fn report(outcomes: &[Option<Outcome>], n: usize, shop: &Shop) {
    let ok: Vec<&Outcome> = outcomes.iter().flatten().collect();
    let mut sorted = ok.clone();
    sorted.sort_by_key(|o| o.enter_us);
    for (i, o) in sorted.iter().enumerate() {
        println!(
            "request {:>3}: waited {:>8.3} ms, held {:>8.3} .. {:>8.3} ms, order code {}, fencing token {}",
            i + 1,
            o.waited_us as f64 / 1e3,
            o.enter_us as f64 / 1e3,
            o.leave_us as f64 / 1e3,
            o.code,
            o.token,
        );
    }
    // A request was serialised if its critical section overlapped no other's.
    let serialised = ok
        .iter()
        .enumerate()
        .filter(|(i, a)| {
            ok.iter()
                .enumerate()
                .all(|(j, b)| *i == j || a.leave_us <= b.enter_us || b.leave_us <= a.enter_us)
        })
        .count();
    let mut codes: Vec<&str> = ok.iter().map(|o| o.code.as_str()).collect();
    codes.sort_unstable();
    codes.dedup();
    println!(
        "serialised: {serialised}/{n} requests, {} unique order codes, max concurrent in critical section = {}",
        codes.len(),
        shop.max_in_critical.load(Ordering::SeqCst),
    );
}
