//! `flash-sale`: one hot key, many concurrent clients, a handler that
//! holds the lock a few milliseconds, served three ways in one run: without
//! admission control, with a cap on waiters, and with the cap and predicted
//! waits. Each client sends back to back; on a 423 it waits the answer's
//! `Retry-After`, as a well-behaved client does, then asks again.

use super::*;

use ::http::StatusCode;
use axum::extract::State;
use axum::handler::Handler;

/// Admission control of one line.
#[derive(Clone, Copy)]
enum Admission {
    None,
    Cap(u32),
    CapAndPredict(u32),
}

impl Admission {
    fn tag(self) -> String {
        match self {
            Admission::None => "none".into(),
            Admission::Cap(n) => format!("max-waiters-{n}"),
            Admission::CapAndPredict(n) => format!("max-waiters-{n}+predict"),
        }
    }

    fn apply(self, layer: LockLayer) -> LockLayer {
        match self {
            Admission::None => layer,
            Admission::Cap(n) => layer.max_waiters(n),
            Admission::CapAndPredict(n) => layer.max_waiters(n).predict_waits(true),
        }
    }
}

#[derive(Default)]
struct Sale {
    inside: AtomicUsize,
    overlaps: AtomicU64,
}

async fn buy(State(sale): State<Arc<Sale>>, hold: Duration) -> &'static str {
    if sale.inside.fetch_add(1, Ordering::SeqCst) > 0 {
        sale.overlaps.fetch_add(1, Ordering::Relaxed);
    }
    tokio::time::sleep(hold).await;
    sale.inside.fetch_sub(1, Ordering::SeqCst);
    "sold"
}

/// What the clients saw of one line.
#[derive(Default)]
struct Seen {
    ok: Vec<Duration>,
    refused: Vec<Duration>,
}

/// One line per kind of admission control, in this order, each over
/// `secs` with `conns` clients on one SKU, the handler holding `hold`, the
/// layer waiting `wait`; `max_waiters` is the cap of the last two.
pub(crate) async fn flash_sale(
    backend: Arc<dyn Backend>,
    conns: usize,
    secs: u64,
    hold: Duration,
    wait: Duration,
    max_waiters: u32,
) -> Vec<String> {
    let kinds = [
        Admission::None,
        Admission::Cap(max_waiters),
        Admission::CapAndPredict(max_waiters),
    ];
    let mut lines = Vec::new();
    for kind in kinds {
        let sale = Arc::new(Sale::default());
        let layer = kind.apply(
            LockLayer::with_locker(Locker::from_arc(backend.clone()), PathParam("sku"))
                .namespace("flash-sale")
                .wait(wait),
        );
        let handler = move |state: State<Arc<Sale>>| buy(state, hold);
        let app = Router::new()
            .route("/sale/{sku}", post(handler.layer(layer)))
            .with_state(sale.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let seen = drive(addr, conns, Duration::from_secs(secs)).await;
        server.abort();
        let (mut ok, mut refused) = (seen.ok, seen.refused);
        let per_s = |n: usize| n as f64 / secs as f64;
        lines.push(format!(
            "admission={} conns={conns} secs={secs} hold_us={} wait_ms={} ok_per_s={:.0} ok_p50_ms={:.1} ok_p99_ms={:.1} refused_per_s={:.0} refused_p50_ms={:.1} refused_p99_ms={:.1} overlaps={}",
            kind.tag(),
            hold.as_micros(),
            wait.as_millis(),
            per_s(ok.len()),
            percentile_ms(&mut ok, 0.50),
            percentile_ms(&mut ok, 0.99),
            per_s(refused.len()),
            percentile_ms(&mut refused, 0.50),
            percentile_ms(&mut refused, 0.99),
            sale.overlaps.load(Ordering::Relaxed),
        ));
    }
    lines
}

/// `conns` clients post to the hot SKU back to back for `dur`; answers
/// after `dur` are not counted.
async fn drive(addr: std::net::SocketAddr, conns: usize, dur: Duration) -> Seen {
    let stop = Instant::now() + dur;
    let mut tasks = Vec::with_capacity(conns);
    for _ in 0..conns {
        let mut client = tower_lock_example_support::Client::connect(addr)
            .await
            .expect("connect");
        tasks.push(tokio::spawn(async move {
            let mut seen = Seen::default();
            while Instant::now() < stop {
                let sent = Instant::now();
                let reply = client.post("/sale/hot").await.expect("request");
                let took = sent.elapsed();
                if Instant::now() > stop {
                    break;
                }
                match reply.status {
                    StatusCode::OK => seen.ok.push(took),
                    StatusCode::LOCKED => {
                        seen.refused.push(took);
                        let after = reply
                            .headers
                            .get("retry-after")
                            .and_then(|v| v.to_str().ok()?.parse().ok())
                            .unwrap_or(1);
                        let left = stop.saturating_duration_since(Instant::now());
                        tokio::time::sleep(Duration::from_secs(after).min(left)).await;
                    }
                    other => panic!("flash-sale: unexpected {other}: {}", reply.body),
                }
            }
            seen
        }));
    }
    let mut all = Seen::default();
    for t in tasks {
        let seen = t.await.expect("client");
        all.ok.extend(seen.ok);
        all.refused.extend(seen.refused);
    }
    all
}

/// The `p`th percentile in milliseconds; zero for no samples.
fn percentile_ms(samples: &mut [Duration], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_unstable();
    percentile(samples, p).as_secs_f64() * 1e3
}
