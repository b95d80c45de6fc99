//! The `LockLayer` in front of a tonic gRPC server: calls for one account
//! (the `x-account-id` request metadata) are served one at a time, and a call
//! the layer cannot lock gets a gRPC status, not an HTTP error.
//!
//! ```text
//! cargo run -p example-grpc                    # two servers and a client: prints what each call got
//! cargo run -p example-grpc -- --serve         # just serve (PORT or --port N; default any free port)
//! ```
//!
//! The service, written by hand here rather than generated, so that the
//! example needs no `protoc`:
//!
//! ```proto
//! syntax = "proto3";
//! package bank;
//! service Accounts { rpc Debit(DebitRequest) returns (DebitReply); }
//! message DebitRequest { uint64 amount = 1; }
//! message DebitReply { int64 balance = 1; uint64 token = 2; }
//! ```
//!
//! With `tonic-build`, keep the generated `AccountsServer` and client and
//! copy only [`lock_layer`] and [`serve`]: the layer goes in
//! `Server::builder().layer(..)`, with `LockBody::wrap` mapped under it
//! (tonic's response body cannot carry the layer's answers; `LockBody` can),
//! and `.grpc_rejections()` turns the layer's answers into `grpc-status` and
//! `grpc-message`:
//!
//! | the call | the client gets |
//! |---|---|
//! | no `x-account-id` (or an invalid one) | `INVALID_ARGUMENT`, saying what is missing |
//! | account busy, with `.fail_fast()`, or still busy when the wait runs out | `ABORTED`: retry later (`grpc-retry-pushback-ms` says when) |
//! | lock backend down, lock lost during the call | `UNAVAILABLE` |
//!
//! The handler finds the lock (key, fencing token) with
//! `HeldLock::current()`.

use std::convert::Infallible;
use std::error::Error;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::uri::PathAndQuery;
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::util::MapResponseLayer;
use tower::Service;
use tower_lock::{Header, HeldLock, LockBody, LockLayer, MemoryBackend};
pub use tower_lock_example_support::bank::{Bank, OPENING_BALANCE};

/// The request metadata naming the account, and the lock key.
pub const ACCOUNT: &str = "x-account-id";
/// The method's path: `/{package}.{Service}/{Method}`.
pub const DEBIT: &str = "/bank.Accounts/Debit";

/// The request message, as `prost-build` would write it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DebitRequest {
    #[prost(uint64, tag = "1")]
    pub amount: u64,
}

/// The reply message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DebitReply {
    #[prost(int64, tag = "1")]
    pub balance: i64,
    /// The fencing token of the lock the call ran under.
    #[prost(uint64, tag = "2")]
    pub token: u64,
}

/// The `Debit` method: what you would write in the generated `Accounts`
/// trait. It runs only once the layer holds the account's lock.
async fn debit(
    bank: Arc<Bank>,
    request: tonic::Request<DebitRequest>,
) -> Result<tonic::Response<DebitReply>, Status> {
    // The lock the layer holds for this call.
    let held = HeldLock::current()
        .ok_or_else(|| Status::internal("no LockLayer in front of the service"))?;
    // The layer has locked (and so validated) this very metadata value.
    let account = request
        .metadata()
        .get(ACCOUNT)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| Status::invalid_argument("no account"))?
        .to_owned();
    let amount = i64::try_from(request.get_ref().amount)
        .map_err(|_| Status::invalid_argument("amount too large"))?;
    let balance = bank.debit(&account, amount).await;
    Ok(tonic::Response::new(DebitReply {
        balance,
        token: held.token().get(),
    }))
}

/// The service's server side: routes each call by its path, decodes the
/// request and encodes the reply with prost. `tonic-build`'s
/// `AccountsServer` does the same.
pub fn accounts_server(
    bank: Arc<Bank>,
) -> impl Service<
    http::Request<Body>,
    Response = http::Response<Body>,
    Error = Infallible,
    Future: Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(move |req: http::Request<Body>| {
        let bank = bank.clone();
        async move {
            Ok(match req.uri().path() {
                DEBIT => {
                    // Any `Service<tonic::Request<Req>, Response = tonic::Response<Reply>, Error = Status>`
                    // is a unary method.
                    let method = tower::service_fn(move |r| debit(bank.clone(), r));
                    let codec = ProstCodec::<DebitReply, DebitRequest>::default();
                    tonic::server::Grpc::new(codec).unary(method, req).await
                }
                _ => Status::unimplemented("no such method").into_http(),
            })
        }
    })
}

/// The lock of the example's servers: per `x-account-id` metadata, under the
/// namespace `account`, waiting up to 5 s for a busy account, answering in
/// gRPC statuses. Add `.fail_fast()` to answer `ABORTED` at once instead.
pub fn lock_layer(backend: &MemoryBackend) -> LockLayer {
    LockLayer::new(backend.clone(), Header::new(ACCOUNT))
        .namespace("account")
        .wait(Duration::from_secs(5))
        .grpc_rejections()
}

/// Serves the accounts of `bank` on `listener`, with `layer` in front.
pub async fn serve(
    listener: TcpListener,
    layer: LockLayer,
    bank: Arc<Bank>,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        // Layers run in the order they are added: the lock first (it sees
        // every call, and answers for the service when it cannot lock)...
        .layer(layer)
        // ...then this, which wraps tonic's response bodies in `LockBody`:
        // the layer answers with the body type of the service it wraps, and
        // tonic's `Body` cannot be made from the layer's answers.
        .layer(MapResponseLayer::new(|res: http::Response<Body>| {
            res.map(LockBody::wrap)
        }))
        // One service, so no router: tonic serves it directly.
        .serve_with_incoming(accounts_server(bank), TcpIncoming::from(listener))
        .await
}

/// Starts a server on a free loopback port; returns its address.
pub async fn start(layer: LockLayer, bank: Arc<Bank>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = serve(listener, layer, bank).await {
            eprintln!("server on {addr} failed: {e}");
        }
    });
    Ok(addr)
}

/// The client side, as `tonic-build`'s `AccountsClient` would do it. Cheap
/// to clone; clones share one HTTP/2 connection, and their calls run
/// concurrently.
#[derive(Clone)]
pub struct AccountsClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl AccountsClient {
    /// Connects to the server at `addr`.
    pub async fn connect(addr: SocketAddr) -> Result<Self, tonic::transport::Error> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        Ok(AccountsClient {
            grpc: tonic::client::Grpc::new(channel),
        })
    }

    /// Debits `amount` from `account` (sent as `x-account-id` metadata;
    /// `None` sends none) and returns the reply.
    pub async fn debit(
        &mut self,
        account: Option<&str>,
        amount: u64,
    ) -> Result<DebitReply, Status> {
        let mut request = tonic::Request::new(DebitRequest { amount });
        if let Some(account) = account {
            let value = account
                .parse()
                .map_err(|_| Status::invalid_argument("account id is not valid metadata"))?;
            request.metadata_mut().insert(ACCOUNT, value);
        }
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let codec = ProstCodec::<DebitRequest, DebitReply>::default();
        let path = PathAndQuery::from_static(DEBIT);
        let reply = self.grpc.unary(request, path, codec).await?;
        Ok(reply.into_inner())
    }
}

/// Checks a failed call's status.
fn expect_status(
    result: Result<DebitReply, Status>,
    code: Code,
    message: &str,
) -> Result<Status, Box<dyn Error>> {
    match result {
        Ok(reply) => Err(format!("expected {code:?}, the call succeeded: {reply:?}").into()),
        Err(s) if s.code() == code && s.message() == message => Ok(s),
        Err(s) => Err(format!("expected {code:?} {message:?}, got {s:?}").into()),
    }
}

/// Two servers on one lock backend (two replicas, say): `patient` waits for
/// a busy account, `fail_fast` does not. A client calls them; each outcome is
/// printed and checked.
/// Two servers and a client: prints what each call got.
pub async fn demo() -> Result<(), Box<dyn Error>> {
    let backend = MemoryBackend::new();
    let bank = Arc::new(Bank::default());
    let layer = lock_layer(&backend);
    let patient = start(layer.clone(), bank.clone()).await?;
    let fail_fast = start(layer.clone().fail_fast(), bank.clone()).await?;
    println!("servers on {patient} (waits for a busy account) and {fail_fast} (fail fast)");
    let mut client = AccountsClient::connect(patient).await?;

    let reply = client.debit(Some("A1"), 10).await?;
    println!(
        "debit A1 10: ok, balance {} (token {})",
        reply.balance, reply.token
    );

    let (mut c1, mut c2) = (client.clone(), client.clone());
    let (r1, r2) = tokio::join!(c1.debit(Some("A1"), 10), c2.debit(Some("A1"), 10));
    let (r1, r2) = (r1?, r2?);
    let max = bank.max_in_flight.load(Ordering::SeqCst);
    println!(
        "two concurrent debits of A1: ok, balances {} and {}, {max} in progress at once",
        r1.balance, r2.balance
    );
    if max != 1 || bank.balance("A1") != OPENING_BALANCE - 30 {
        return Err("the concurrent debits overlapped".into());
    }

    let status = expect_status(
        client.debit(None, 10).await,
        Code::InvalidArgument,
        "missing lock key: the request has no header `x-account-id`",
    )?;
    println!(
        "debit without {ACCOUNT}: {:?}: {}",
        status.code(),
        status.message()
    );

    // Something else holds A1: a batch job with the layer's locker, say, or
    // a slow call on another replica.
    let held = layer.locker().lock("A1").await?;
    let mut impatient = AccountsClient::connect(fail_fast).await?;
    let status = expect_status(
        impatient.debit(Some("A1"), 10).await,
        Code::Aborted,
        "lock is held by someone else",
    )?;
    let pushback = status.metadata().get("grpc-retry-pushback-ms");
    let pushback = pushback.and_then(|v| v.to_str().ok()).unwrap_or("none");
    println!(
        "debit A1 while {} is held, fail fast: {:?}: {} (retry in {pushback} ms)",
        held.key(),
        status.code(),
        status.message()
    );
    drop(held);
    let reply = impatient.debit(Some("A1"), 10).await?;
    println!("debit A1 once released: ok, balance {}", reply.balance);

    if backend.active_keys() != 0 {
        return Err(format!("{} keys still locked", backend.active_keys()).into());
    }
    println!("every lock released");
    Ok(())
}
