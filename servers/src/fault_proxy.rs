//! A TCP proxy that injects network faults between lock clients and a
//! server: the torture harness puts one in front of every server, and the
//! partition tests use it alone.
//!
//! Each accepted connection gets its own connection to the server and two
//! pumps, one per direction. A pump reads what arrives, holds it for the
//! configured latency, and writes it on unless its direction is frozen: then
//! the bytes wait, in order, until the freeze is healed, as TCP's
//! retransmissions would deliver them after a partition heals. A closed
//! side's end of stream is forwarded the same way. [`Fault::Drop`] closes
//! every connection and refuses new ones until healed.
//!
//! A change of fault is atomic with the forwarding: once
//! [`set`](FaultProxy::set) returns, nothing passes that the new fault
//! holds back, and it returns when a chunk last went towards the server.
//! Every request the server has answered was sent before then, so that
//! moment plus a lease bounds when a lease can have ended.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Mutex};

/// What the proxy does to the traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Everything passes.
    Pass,
    /// Every connection is closed and new ones are closed at once.
    Drop,
    /// Nothing passes either way; it is delivered after healing.
    Freeze,
    /// Client-to-server traffic is held; server-to-client still flows.
    FreezeUp,
    /// Server-to-client traffic is held; client-to-server still flows.
    FreezeDown,
    /// Everything passes, each chunk this much later.
    Latency(Duration),
}

impl Fault {
    fn holds(self, up: bool) -> bool {
        matches!(
            (self, up),
            (Fault::Freeze, _) | (Fault::FreezeUp, true) | (Fault::FreezeDown, false)
        )
    }

    fn latency(self) -> Duration {
        match self {
            Fault::Latency(d) => d,
            _ => Duration::ZERO,
        }
    }
}

/// A running proxy; dropping it stops it and closes its connections.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    /// Held by a pump while it writes a chunk, and by `set` while it
    /// changes the fault.
    fault: Mutex<Fault>,
    changed: watch::Sender<Fault>,
    /// When a chunk was last written towards the server.
    last_up: std::sync::Mutex<Option<Instant>>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `server`.
    pub async fn start(server: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            fault: Mutex::new(Fault::Pass),
            changed: watch::channel(Fault::Pass).0,
            last_up: std::sync::Mutex::new(None),
        });
        let task = tokio::spawn(accept(listener, server, shared.clone()));
        Ok(FaultProxy { addr, shared, task })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Applies `fault` from now on (to connections open now and later);
    /// returns when a chunk last went towards the server (`None`: never).
    pub async fn set(&self, fault: Fault) -> Option<Instant> {
        let mut current = self.shared.fault.lock().await;
        *current = fault;
        self.shared.changed.send_replace(fault);
        let last_up = *self.shared.last_up.lock().unwrap();
        drop(current);
        last_up
    }

    /// Back to [`Fault::Pass`]: held bytes are delivered.
    pub async fn heal(&self) {
        self.set(Fault::Pass).await;
    }
}

impl Drop for FaultProxy {
    /// Stops accepting and closes every connection.
    fn drop(&mut self) {
        self.task.abort();
        if let Ok(mut fault) = self.shared.fault.try_lock() {
            *fault = Fault::Drop;
        }
        self.shared.changed.send_replace(Fault::Drop);
    }
}

async fn accept(listener: TcpListener, server: SocketAddr, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        if *shared.changed.borrow() == Fault::Drop {
            continue; // dropped: closed at once
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let Ok(upstream) = TcpStream::connect(server).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = upstream.set_nodelay(true);
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = upstream.into_split();
            let up = pump(client_read, server_write, shared.clone(), true);
            let down = pump(server_read, client_write, shared, false);
            // Both directions end together: a dropped connection closes both.
            tokio::join!(up, down);
        });
    }
}

/// One direction of one connection: reads chunks as they come, and writes
/// each once its latency has passed and its direction is not frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
    up: bool,
) {
    let mut fault = shared.changed.subscribe();
    // `None` is the end of the stream, forwarded like data.
    let (chunks, mut queue) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let mut reading_fault = shared.changed.subscribe();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            tokio::select! {
                read = from.read(&mut buf) => {
                    let chunk = match read {
                        Ok(0) | Err(_) => None,
                        Ok(n) => Some(buf[..n].to_vec()),
                    };
                    let end = chunk.is_none();
                    if chunks.send((Instant::now(), chunk)).is_err() || end {
                        return;
                    }
                }
                dropped = reading_fault.wait_for(|f| *f == Fault::Drop) => {
                    let _ = dropped;
                    return;
                }
            }
        }
    };
    let writer = async move {
        while let Some((read_at, chunk)) = queue.recv().await {
            loop {
                if *fault.borrow_and_update() == Fault::Drop {
                    return;
                }
                let current = shared.fault.lock().await;
                if *current == Fault::Drop {
                    return;
                }
                let due = read_at + current.latency();
                if !current.holds(up) && Instant::now() >= due {
                    // Written under the lock, so a fault set meanwhile
                    // waits for it, and `last_up` is never behind.
                    if up {
                        *shared.last_up.lock().unwrap() = Some(Instant::now());
                    }
                    let written = match &chunk {
                        Some(bytes) => to.write_all(bytes).await.is_ok(),
                        None => {
                            let _ = to.shutdown().await;
                            false
                        }
                    };
                    if !written {
                        return;
                    }
                    break;
                }
                let held = current.holds(up);
                drop(current);
                if held {
                    if fault.changed().await.is_err() {
                        return;
                    }
                    continue;
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(due.into()) => {}
                    changed = fault.changed() => if changed.is_err() { return },
                }
            }
        }
    };
    // The reader may stop first (end of stream, a drop); the writer goes on
    // until it has delivered what was read, or the connection is dropped.
    tokio::join!(reader, writer);
}
