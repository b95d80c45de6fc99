//! The `LockLayer` without axum: a `tower::service_fn` handler, served by
//! hyper 1.
//!
//! `POST /debit?account=A1&amount=10` reads the account's balance, waits a
//! moment (a database round trip, say) and writes it back less the amount: a
//! read-modify-write that loses debits when two requests for one account
//! overlap. The layer locks the `account` query parameter, so debits of one
//! account run one at a time (debits of different accounts still run
//! together).
//!
//! ```text
//! cargo run --example plain_tower                      # serve; prints the address
//! cargo run --example plain_tower -- --port 3000       # or PORT=3000 (default: any free port)
//! curl -X POST 'http://127.0.0.1:3000/debit?account=A1&amount=10'
//! cargo run --example plain_tower -- --self-test       # concurrent debits of one account, then exit
//! ```
//!
//! What to copy into a service without axum (see [`app`] and [`serve`]):
//!
//! 1. a key source that needs no router: [`QueryParam`], [`Header`]
//!    (`Header::new("x-account-id")`), or a closure / `KeyFn` over the
//!    request head (e.g. to take a path segment);
//! 2. `ServiceBuilder::new().layer(lock_layer).map_response(|r| r.map(LockBody::wrap))`:
//!    the layer answers with the inner service's body type, so that type
//!    must be able to carry the layer's own answers (rejections); axum's
//!    `Body` can, any other body does once wrapped in `LockBody`;
//! 3. `HeldLock::current()`, the lock the layer holds for the request being
//!    served (key, fencing token, lost signal);
//! 4. hyper-util's `TowerToHyperService` to hand the tower service to hyper.
//!
//! [`Header`]: tower_lock::Header

// The HTTP client and the bank the examples share.
use tower_lock_example_support as common;

use common::bank::{Bank, OPENING_BALANCE};

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::{Service, ServiceBuilder};
use tower_lock::{HeldLock, KeySource, LockBody, LockLayer, MemoryBackend, QueryParam};

/// Where the layer finds the key; the handler reads the account the same way,
/// so that it works on exactly the account that was locked (percent-decoding
/// included).
const ACCOUNT: QueryParam = QueryParam("account");

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(body)));
    *res.status_mut() = status;
    res
}

/// The handler: a plain async function of the request. It runs only once the
/// layer holds the account's lock.
async fn handle(
    bank: Arc<Bank>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    // No router: the layer wraps the whole service, so a request for another
    // path is locked too (and one without `account` gets the layer's 400
    // before it gets here). Route first, then lock, if that matters.
    if req.method() != Method::POST || req.uri().path() != "/debit" {
        return Ok(text(StatusCode::NOT_FOUND, "not found\n".into()));
    }
    let (mut parts, _body) = req.into_parts();
    // The lock the layer holds for this request.
    let held = HeldLock::current().expect("the LockLayer runs before the handler");
    // The layer has answered 400 to a request without a valid account.
    let Some(account) = ACCOUNT.extract(&mut parts).ok().flatten() else {
        return Ok(text(StatusCode::BAD_REQUEST, "no account\n".into()));
    };
    let account = account.into_owned();
    let amount = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix("amount="))
        .map_or(Ok(10), str::parse::<i64>);
    let Ok(amount) = amount else {
        return Ok(text(
            StatusCode::BAD_REQUEST,
            "amount must be a whole number\n".into(),
        ));
    };
    let balance = bank.debit(&account, amount).await;
    // A real store would take the fencing token with the write, and refuse
    // writes with an older token than the last it saw.
    Ok(text(
        StatusCode::OK,
        format!(
            "debited {amount} from {account}: balance {balance} (lock {}, token {})\n",
            held.key(),
            held.token()
        ),
    ))
}

/// The locked service: the `LockLayer`, a `LockBody::wrap` of the handler's
/// response bodies, then the handler.
pub fn app(
    backend: MemoryBackend,
    bank: Arc<Bank>,
) -> impl Service<
    Request<Incoming>,
    Response = Response<LockBody<Full<Bytes>>>,
    Error = Infallible,
    Future: Send,
> + Clone
       + Send
       + 'static {
    let layer = LockLayer::new(backend, ACCOUNT)
        .namespace("account")
        .wait(Duration::from_secs(5));
    ServiceBuilder::new()
        .layer(layer)
        // Under the layer: the layer's own answers (400, 423, 503) are made
        // of this body type, which `LockBody` makes possible for any body.
        .map_response(|res: Response<Full<Bytes>>| res.map(LockBody::wrap))
        .service(tower::service_fn(move |req| handle(bank.clone(), req)))
}

/// Serves `service` over HTTP/1.1 on `listener`, one task per connection,
/// until the task running it is dropped.
pub async fn serve<S>(listener: TcpListener, service: S)
where
    S: Service<Request<Incoming>, Response = Response<LockBody<Full<Bytes>>>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                eprintln!("connection error: {e}");
            }
        });
    }
}

/// Sends `debits` concurrent debits of one account, each on its own
/// connection, and a request without an account; checks the debits were
/// serialised and the keyless request got 400. Returns a summary.
pub async fn self_test(debits: usize) -> Result<String, String> {
    let backend = MemoryBackend::new();
    let bank = Arc::new(Bank::default());
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = tokio::spawn(serve(listener, app(backend.clone(), bank.clone())));

    let mut tasks = Vec::new();
    for _ in 0..debits {
        let mut client = common::Client::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        tasks.push(tokio::spawn(async move {
            client.post("/debit?account=A1&amount=10").await
        }));
    }
    let mut tokens = Vec::new();
    for task in tasks {
        let reply = task.await.map_err(|e| e.to_string())?;
        let reply = reply.map_err(|e| e.to_string())?;
        if reply.status != StatusCode::OK {
            return Err(format!("a debit got {}: {}", reply.status, reply.body));
        }
        tokens.push(reply.body.trim().to_owned());
    }
    let expected = OPENING_BALANCE - 10 * debits as i64;
    let balance = bank.balance("A1");
    let max = bank.max_in_flight.load(Ordering::SeqCst);
    if balance != expected || max != 1 {
        return Err(format!(
            "debits overlapped: balance {balance} (expected {expected}), \
             up to {max} debits in progress at once"
        ));
    }

    let mut client = common::Client::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let reply = client
        .post("/debit?amount=10")
        .await
        .map_err(|e| e.to_string())?;
    let expected_body = "missing lock key: the request has no query parameter `account`\n";
    if reply.status != StatusCode::BAD_REQUEST || reply.body != expected_body {
        return Err(format!(
            "a debit without an account got {}: {:?}",
            reply.status, reply.body
        ));
    }
    server.abort();
    if backend.active_keys() != 0 {
        return Err(format!("{} keys still locked", backend.active_keys()));
    }
    Ok(format!(
        "serialised: {debits}/{debits} debits of A1, balance {OPENING_BALANCE} -> {balance}, \
         max in progress at once = {max}; no account -> 400 {expected_body:?}"
    ))
}

/// The port from `--port N`, else `PORT`, else 0 (any free port).
fn port(args: &[String]) -> Result<u16, String> {
    let given = match args.iter().position(|a| a == "--port") {
        Some(i) => args.get(i + 1).cloned().ok_or("--port needs a number")?,
        None => std::env::var("PORT").unwrap_or_else(|_| "0".into()),
    };
    given.parse().map_err(|_| format!("bad port {given:?}"))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--self-test") {
        return match self_test(5).await {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("self-test failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let port = match port(&args) {
        Ok(port) => port,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let listener = match TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("cannot listen on 127.0.0.1:{port}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().expect("bound");
    println!("listening on http://{addr}");
    println!("try: curl -X POST 'http://{addr}/debit?account=A1&amount=10'");
    serve(listener, app(MemoryBackend::new(), Arc::default())).await;
    ExitCode::SUCCESS
}

/// The example's self-test over real HTTP, plus the layer's answers a hyper
/// user sees (`cargo test --example plain_tower`).
#[cfg(test)]
mod tests {
    use super::*;

    use tower_lock::BackendExt;

    use common::Client;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn self_test_passes() {
        let summary = self_test(8).await.unwrap();
        assert!(summary.starts_with("serialised: 8/8 debits"), "{summary}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_debits_are_serialised_and_rejections_are_plain_http() {
        let backend = MemoryBackend::new();
        let bank = Arc::new(Bank::default());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, app(backend.clone(), bank.clone())));

        // Concurrent debits of one account, one connection each.
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let mut client = Client::connect(addr).await.unwrap();
            tasks.push(tokio::spawn(async move {
                client.post("/debit?account=A1&amount=10").await.unwrap()
            }));
        }
        for task in tasks {
            let reply = task.await.unwrap();
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
            assert!(
                reply.body.contains("(lock account:A1, token "),
                "{}",
                reply.body
            );
        }
        assert_eq!(bank.balance("A1"), OPENING_BALANCE - 60, "a debit was lost");
        assert_eq!(bank.max_in_flight.load(Ordering::SeqCst), 1);

        let mut client = Client::connect(addr).await.unwrap();
        // No key: the layer's 400, before the handler.
        let reply = client.post("/debit?amount=10").await.unwrap();
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            reply.body,
            "missing lock key: the request has no query parameter `account`\n"
        );
        // The key percent-decoded, as the handler reads it too: `A%31` is `A1`.
        let reply = client.post("/debit?account=A%31&amount=5").await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        assert!(
            reply.body.starts_with("debited 5 from A1: balance 35 "),
            "{}",
            reply.body
        );
        // Held elsewhere (a batch job, another replica): the request waits (up
        // to the layer's 5 s) and is served once the holder lets go.
        let guard = backend.lock("account:B2").await.unwrap();
        let waiting =
            tokio::spawn(async move { client.post("/debit?account=B2&amount=1").await.unwrap() });
        while backend.queued("account:B2") == 0 {
            tokio::task::yield_now().await;
        }
        drop(guard);
        let reply = waiting.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        assert!(
            reply.body.starts_with("debited 1 from B2: balance 99 "),
            "{}",
            reply.body
        );

        server.abort();
        assert_eq!(backend.active_keys(), 0);
    }
}
