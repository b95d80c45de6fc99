//! The gRPC example's program: two servers and a client, or `--serve`
//! (the example itself is the library beside this file).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use example_grpc::{demo, lock_layer, serve};
use tokio::net::TcpListener;
use tower_lock::MemoryBackend;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--serve") {
        let port = match args.iter().position(|a| a == "--port") {
            Some(i) => args.get(i + 1).cloned().unwrap_or_default(),
            None => std::env::var("PORT").unwrap_or_else(|_| "0".into()),
        };
        let Ok(port) = port.parse::<u16>() else {
            eprintln!("bad port {port:?}");
            return ExitCode::from(2);
        };
        let listener = match TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await {
            Ok(listener) => listener,
            Err(e) => {
                eprintln!("cannot listen on 127.0.0.1:{port}: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!("gRPC on http://{}", listener.local_addr().expect("bound"));
        let layer = lock_layer(&MemoryBackend::new());
        return match serve(listener, layer, Arc::default()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("server failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match demo().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("grpc example failed: {e}");
            ExitCode::FAILURE
        }
    }
}
