//! The client processes of a run, each reaching each server through a
//! fault proxy of its own.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;

use crate::history::{now_ns, Event};
use crate::worker::{ClientArgs, Rng};
use tower_lock_servers::fault_proxy::FaultProxy;

/// The client processes of a run.
pub struct Clients {
    work: PathBuf,
    /// Each client's process and its proxies, one per server.
    running: HashMap<String, (tokio::process::Child, Vec<FaultProxy>)>,
    next: u64,
    events: mpsc::UnboundedSender<(String, Event)>,
    /// Each client's stdout reader: joined before the history is read, so
    /// that no last line is missing.
    readers: Vec<tokio::task::JoinHandle<()>>,
}

impl Clients {
    /// No clients yet; each one's log goes to `work`, its events to `events`.
    pub fn new(work: &Path, events: mpsc::UnboundedSender<(String, Event)>) -> Self {
        Clients {
            work: work.to_owned(),
            running: HashMap::new(),
            next: 0,
            events,
            readers: Vec::new(),
        }
    }
    /// A new client's id and its proxies.
    pub async fn prepare(
        &mut self,
        servers: &[SocketAddr],
    ) -> Result<(String, Vec<FaultProxy>), String> {
        self.next += 1;
        let mut proxies = Vec::new();
        for s in servers {
            proxies.push(FaultProxy::start(*s).await.map_err(|e| e.to_string())?);
        }
        Ok((format!("p{}", self.next), proxies))
    }

    pub fn proxy(&self, id: &str, server: usize) -> Option<&FaultProxy> {
        self.running.get(id)?.1.get(server)
    }

    /// The links (client, server index) a network fault cuts: one client
    /// from one server or from all, or one server from every client.
    pub fn links(&self, rng: &mut Rng, servers: usize) -> Vec<(String, usize)> {
        let client = self.any(rng);
        match rng.below(4) {
            0 | 1 => vec![(client, rng.below(servers as u64) as usize)],
            2 => (0..servers).map(|s| (client.clone(), s)).collect(),
            _ => {
                let server = rng.below(servers as u64) as usize;
                self.running.keys().map(|id| (id.clone(), server)).collect()
            }
        }
    }

    pub async fn heal(&self) {
        for (_, proxies) in self.running.values() {
            for p in proxies {
                p.heal().await;
            }
        }
    }

    pub fn spawn(&mut self, args: ClientArgs, proxies: Vec<FaultProxy>) -> Result<(), String> {
        // This very program, even if its file was rebuilt since the run
        // began (`current_exe` would then name a deleted file): in the
        // child, `/proc/self/exe` is still the parent's program.
        let exe = "/proc/self/exe";
        let log = std::fs::File::create(self.work.join(format!("{}.log", args.id)))
            .map_err(|e| e.to_string())?;
        let mut child = tokio::process::Command::new(exe)
            .arg("--client")
            .arg(args.format())
            .stdout(std::process::Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| e.to_string())?;
        let stdout = child.stdout.take().expect("piped");
        let (id, events) = (args.id.clone(), self.events.clone());
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(event) = Event::parse(&line) {
                    let _ = events.send((id.clone(), event));
                }
            }
        });
        self.readers.push(reader);
        self.running.insert(args.id, (child, proxies));
        Ok(())
    }

    pub fn any(&self, rng: &mut Rng) -> String {
        let mut ids: Vec<&String> = self.running.keys().collect();
        ids.sort();
        ids[rng.below(ids.len() as u64) as usize].clone()
    }

    /// One of the running processes among `ids`, or any running one when
    /// none of them is.
    pub fn any_of(&self, rng: &mut Rng, ids: &[String]) -> String {
        let among: Vec<&String> = ids
            .iter()
            .filter(|id| self.running.contains_key(*id))
            .collect();
        if among.is_empty() {
            return self.any(rng);
        }
        among[rng.below(among.len() as u64) as usize].clone()
    }

    pub fn pid(&self, id: &str) -> Option<u32> {
        self.running.get(id)?.0.id()
    }

    /// `kill -9` of a client process; returns when the signal had been
    /// sent (dated once `kill(2)` returned: from then on the process runs
    /// no more code, but for the moment the kernel takes to stop it on
    /// another CPU) and when the process was reaped. The checker ends its
    /// holds there, or at the last line it wrote.
    pub async fn kill(&mut self, id: &str) -> Option<(u64, u64)> {
        let (mut child, _proxies) = self.running.remove(id)?;
        let _ = child.start_kill();
        let sent = now_ns();
        let _ = child.wait().await;
        Some((sent, now_ns()))
    }

    /// Waits for every client to exit; kills the ones still running after
    /// `limit` and says how many.
    pub async fn wait_all(&mut self, limit: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        let mut stragglers = 0;
        for (_, (mut child, _proxies)) in self.running.drain() {
            if tokio::time::timeout_at(deadline, child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
                stragglers += 1;
            }
        }
        // Every client has exited: its stdout ends, and its reader with it
        // once the last line is sent on.
        for reader in self.readers.drain(..) {
            let _ = reader.await;
        }
        stragglers
    }
}
