//! The fenced register: the storage a lock protects, kept outside the lock
//! service, in the harness process.
//!
//! Every key holds a counter. A holder does a read-modify-write on it inside
//! its critical section: `R key token hold`, then `W key token hold value`
//! with the value it read plus one. The register remembers the highest token
//! it has seen per key, on reads and writes alike (Kleppmann's fenced storage),
//! and refuses any request carrying a lower one: a holder that lost its lock
//! without knowing is refused rather than allowed to overwrite a newer
//! holder's work. What it counts:
//!
//! - `stale_refused`: requests refused for a lower token (fencing at work);
//! - `stale_accepted`: writes accepted although another hold had already used
//!   the same token on that key (two holds sharing a token: fencing broken);
//! - lost updates: at the end, a key's value below the writes it accepted.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct Cell {
    value: u64,
    accepted: u64,
    /// The highest token seen, and the hold that first used it.
    top: u64,
    top_hold: String,
}

#[derive(Default)]
struct State {
    cells: HashMap<String, Cell>,
    stale_refused: u64,
    stale_accepted: u64,
    /// The first few stale writes accepted, said in words.
    examples: Vec<String>,
}

/// What the register counted, at the end of a run.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub writes_accepted: u64,
    pub stale_refused: u64,
    pub stale_accepted: u64,
    pub lost_updates: u64,
    /// The first few stale writes accepted, said in words.
    pub examples: Vec<String>,
}

pub struct Register {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Register {
    pub async fn start() -> std::io::Result<Register> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, shared.clone()));
            }
        });
        Ok(Register { addr, state, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn tally(&self) -> Tally {
        let state = self.state.lock().unwrap();
        let mut t = Tally {
            stale_refused: state.stale_refused,
            stale_accepted: state.stale_accepted,
            examples: state.examples.clone(),
            ..Tally::default()
        };
        for cell in state.cells.values() {
            t.writes_accepted += cell.accepted;
            t.lost_updates += cell.accepted.saturating_sub(cell.value);
        }
        t
    }
}

impl Drop for Register {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(conn: TcpStream, state: Arc<Mutex<State>>) {
    let _ = conn.set_nodelay(true);
    let (read, mut write) = conn.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let answer = handle(&line, &state);
        if write.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn handle(line: &str, state: &Mutex<State>) -> String {
    let parts: Vec<&str> = line.split(' ').collect();
    let (op, key, token, hold) = match parts.as_slice() {
        [op, key, token, hold, ..] => (*op, *key, token.parse::<u64>(), *hold),
        _ => return "error bad request\n".into(),
    };
    let Ok(token) = token else {
        return "error bad token\n".into();
    };
    let mut state = state.lock().unwrap();
    let state = &mut *state;
    let cell = state.cells.entry(key.to_owned()).or_default();
    if token < cell.top {
        state.stale_refused += 1;
        return "stale\n".into();
    }
    let shared_token = token == cell.top && cell.top_hold != hold;
    if token > cell.top {
        cell.top = token;
        cell.top_hold = hold.to_owned();
    }
    match (op, parts.get(4).map(|v| v.parse::<u64>())) {
        ("R", None) => format!("{}\n", cell.value),
        ("W", Some(Ok(value))) => {
            if shared_token {
                state.stale_accepted += 1;
                if state.examples.len() < 5 {
                    state.examples.push(format!(
                        "key {key}: {hold} wrote with token {token}, which {} used first",
                        cell.top_hold
                    ));
                }
            }
            cell.value = value;
            cell.accepted += 1;
            "ok\n".into()
        }
        _ => "error bad request\n".into(),
    }
}

/// One connection to the register.
pub struct RegisterClient {
    lines: tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    write: tokio::net::tcp::OwnedWriteHalf,
}

/// A request's outcome.
pub enum Answer {
    Value(u64),
    Ok,
    Stale,
}

impl RegisterClient {
    pub async fn connect(addr: SocketAddr) -> std::io::Result<RegisterClient> {
        let conn = TcpStream::connect(addr).await?;
        conn.set_nodelay(true)?;
        let (read, write) = conn.into_split();
        Ok(RegisterClient {
            lines: BufReader::new(read).lines(),
            write,
        })
    }

    async fn ask(&mut self, request: String) -> std::io::Result<Answer> {
        self.write.write_all(request.as_bytes()).await?;
        let line = self.lines.next_line().await?.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "register closed")
        })?;
        match line.as_str() {
            "ok" => Ok(Answer::Ok),
            "stale" => Ok(Answer::Stale),
            v => v.parse().map(Answer::Value).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("register: {v}"))
            }),
        }
    }

    pub async fn read(&mut self, key: &str, token: u64, hold: &str) -> std::io::Result<Answer> {
        self.ask(format!("R {key} {token} {hold}\n")).await
    }

    pub async fn write(
        &mut self,
        key: &str,
        token: u64,
        hold: &str,
        value: u64,
    ) -> std::io::Result<Answer> {
        self.ask(format!("W {key} {token} {hold} {value}\n")).await
    }
}
