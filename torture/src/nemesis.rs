//! The run: servers, proxies, client processes, the faults, and the checks
//! at the end.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tower_lock::{Backend, MemoryBackend};

use crate::checks::{leaks, liveness};
use crate::clients::Clients;
use crate::faults::step_clock;
use crate::faults::{self, FaultKind};
use crate::history::{now_ns, Event, History, ProcessFault};
use crate::register::Register;
use crate::summary::{summarize, Summary};
use crate::worker::{self, ClientArgs, Rng, Sink, Worker};
use crate::Args;
use tower_lock_servers::fault_proxy::{Fault, FaultProxy};
use tower_lock_servers::redis_groups::Failover;
use tower_lock_servers::{signal_pid, stop_pid, Kind, Server};

/// The planned run.
pub struct Nemesis {
    args: Args,
    /// `memory`, `redis`, `redlock` or `zk`.
    kind: String,
    /// Servers given by URL (the harness starts its own otherwise).
    given: Option<Vec<SocketAddr>>,
    faults: Vec<FaultKind>,
}

impl Nemesis {
    pub fn plan(args: &Args) -> Result<Nemesis, String> {
        let (kind, given) = match args.backend.split_once("://") {
            None => (args.backend.clone(), None),
            Some((scheme, rest)) => {
                let hosts = rest.split('/').next().unwrap_or(rest);
                // `user@host:port`: the user is the client's business.
                let hosts = hosts.rsplit('@').next().unwrap_or(hosts);
                let addrs = hosts
                    .split(',')
                    .map(|h| {
                        h.parse()
                            .map_err(|_| format!("{h:?} is not host:port (use 127.0.0.1)"))
                    })
                    .collect::<Result<Vec<SocketAddr>, String>>()?;
                (scheme.to_owned(), Some(addrs))
            }
        };
        if ![
            "memory",
            "redis",
            "sentinel",
            "sentinel-wait",
            "cluster",
            "cluster-wait",
            "redlock",
            "zk",
            "zk3",
            "postgres",
            "postgres-table",
            "mysql",
            "etcd",
            "etcd3",
        ]
        .contains(&kind.as_str())
        {
            return Err(format!("unknown backend {:?}", args.backend));
        }
        let faults = faults::choose(&kind, given.is_some(), &args.nemesis)?;
        Ok(Nemesis {
            args: args.clone(),
            kind,
            given,
            faults,
        })
    }

    pub async fn run(self) -> Result<Summary, String> {
        let seed = self.args.seed.unwrap_or_else(|| now_ns() % 1_000_000_007);
        let root = format!("torture{}-{}", seed % 1_000_000, std::process::id());
        let work = std::env::temp_dir().join(&root);
        std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
        let result = if self.kind == "memory" {
            self.run_memory(seed, &root).await
        } else {
            self.run_remote(seed, &root, &work).await
        };
        // Kept when something went wrong (or TORTURE_KEEP is set): the
        // servers' and clients' logs.
        let keep = std::env::var_os("TORTURE_KEEP").is_some();
        match &result {
            Ok(summary) if summary.broken.is_empty() && !keep => {
                let _ = std::fs::remove_dir_all(&work);
            }
            _ => {
                if let Ok(Summary {
                    history: Some(history),
                    ..
                }) = &result
                {
                    let _ = std::fs::write(work.join("history.txt"), history);
                }
                eprintln!("torture: logs kept in {}", work.display())
            }
        }
        result
    }

    /// Memory: workers are tasks of this process; the faults are
    /// cancellation and panics.
    async fn run_memory(&self, seed: u64, root: &str) -> Result<Summary, String> {
        let a = &self.args;
        let backend = Arc::new(MemoryBackend::new());
        let register = Register::start().await.map_err(|e| e.to_string())?;
        let keys = Arc::new(worker::keys(root, a.keys));
        let (tx, rx) = mpsc::unbounded_channel();
        let collector = collect(rx);
        let history = collector.history.clone();
        let until = now_ns() + a.secs * 1_000_000_000;
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info.to_string().contains("as the nemesis asked") {
                default_hook(info);
            }
        }));
        let mut rng = Rng::new(seed);
        let mut next_id = 0u64;
        let mut spawn = |rng: &mut Rng| {
            next_id += 1;
            let id = format!("m{next_id}");
            let panic = worker::panic_flag();
            let w = Worker {
                backend: crate::sabotage::Sabotaged::wrap(
                    backend.clone() as Arc<dyn Backend>,
                    a.sabotage,
                ),
                register: register.addr(),
                keys: keys.clone(),
                lease: a.lease,
                process: id.clone(),
                name: id.clone(),
                seed: rng.next(),
                until_ns: until,
                sink: Sink::Channel(tx.clone()),
                panic: Some(panic.clone()),
            };
            (id, tokio::spawn(w.run()), panic)
        };
        let mut tasks: Vec<_> = (0..a.processes * a.workers)
            .map(|_| spawn(&mut rng))
            .collect();
        let mut counts = BTreeMap::new();
        let mut bag = Bag::new(&self.faults);
        while now_ns() < until {
            tokio::time::sleep(rng.between(Duration::from_millis(2), Duration::from_millis(30)))
                .await;
            // Workers that panicked are replaced.
            for t in tasks.iter_mut() {
                if t.1.is_finished() && now_ns() < until {
                    *t = spawn(&mut rng);
                }
            }
            let Some(fault) = bag.draw(&mut rng) else {
                continue;
            };
            let i = rng.below(tasks.len() as u64) as usize;
            match fault {
                FaultKind::Cancel => {
                    let sent = now_ns();
                    tasks[i].1.abort();
                    let _ = (&mut tasks[i].1).await;
                    let reaped = now_ns();
                    history
                        .lock()
                        .unwrap()
                        .process_fault(&tasks[i].0, ProcessFault::Killed { sent, reaped });
                    tasks[i] = spawn(&mut rng);
                }
                FaultKind::Panic => tasks[i].2.store(true, std::sync::atomic::Ordering::SeqCst),
                _ => unreachable!("memory faults only"),
            }
            *counts.entry(fault.name()).or_insert(0u64) += 1;
        }
        for t in tasks {
            let _ = t.1.await;
        }
        let unavailable = liveness(
            backend.clone(),
            &keys,
            a.lease,
            Duration::from_secs(1),
            false,
        )
        .await;
        let leaked = backend.active_keys() as u64;
        drop(tx);
        let _ = std::panic::take_hook();
        let history = collector.finish().await;
        Ok(summarize(
            &self.args,
            "memory",
            seed,
            &history,
            &register,
            counts,
            leaked,
            unavailable,
            &[],
        ))
    }

    async fn run_remote(
        &self,
        seed: u64,
        root: &str,
        work: &std::path::Path,
    ) -> Result<Summary, String> {
        let a = &self.args;
        let mut servers = Vec::new();
        let sentinel = self.kind.starts_with("sentinel");
        let cluster = self.kind.starts_with("cluster");
        let addrs = match &self.given {
            Some(addrs) => addrs.clone(),
            None if cluster => {
                let work = work.to_owned();
                servers = tokio::task::spawn_blocking(move || Server::start_redis_cluster(&work))
                    .await
                    .map_err(|e| e.to_string())??;
                let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
                Failover::Cluster {
                    nodes: addrs.clone(),
                }
                .settled(Duration::from_secs(30))
                .await;
                addrs
            }
            None if sentinel => {
                let work = work.to_owned();
                servers = tokio::task::spawn_blocking(move || {
                    Server::start_sentinel_group(&work, Duration::from_secs(1))
                })
                .await
                .map_err(|e| e.to_string())??;
                servers.iter().map(|s| s.addr).collect()
            }
            None => {
                let (kind, n) = match self.kind.as_str() {
                    "zk" => (Kind::ZooKeeper, 1),
                    "zk3" => (Kind::ZooKeeper, 3),
                    "postgres" | "postgres-table" => (Kind::Postgres, 1),
                    "mysql" => (Kind::Mariadb, 1),
                    "etcd" => (Kind::Etcd, 1),
                    "etcd3" => (Kind::Etcd, 3),
                    "redlock" => (Kind::Redis, 3),
                    _ => (Kind::Redis, 1),
                };
                if kind != Kind::Redis && n > 1 {
                    let work = work.to_owned();
                    servers =
                        tokio::task::spawn_blocking(move || Server::start_cluster(kind, &work, n))
                            .await
                            .map_err(|e| e.to_string())??;
                }
                for i in 0..n - servers.len() {
                    let work = work.to_owned();
                    let server = tokio::task::spawn_blocking(move || {
                        Server::start(kind, &work, &format!("server{i}"))
                    })
                    .await
                    .map_err(|e| e.to_string())??;
                    servers.push(server);
                }
                servers.iter().map(|s| s.addr).collect()
            }
        };
        // Under Sentinel, clients are given the Sentinels; the Redis
        // servers are where the keys are, and the faults go.
        let (addrs, data) = if sentinel && self.given.is_none() {
            (addrs[3..].to_vec(), addrs[..3].to_vec())
        } else {
            (addrs.clone(), addrs)
        };
        // Server faults in a group that fails over go to its master.
        let failover = if self.given.is_some() {
            None
        } else if sentinel {
            Some(Failover::Sentinel {
                sentinels: addrs.clone(),
                data: data.clone(),
            })
        } else if cluster {
            Some(Failover::Cluster {
                nodes: data.clone(),
            })
        } else {
            None
        };
        // Kept running to the end of the run (dropped, a server stops).
        let _sentinels = servers.split_off(data.len().min(servers.len()));
        let servers: Vec<Arc<Mutex<Server>>> = servers
            .into_iter()
            .map(|s| Arc::new(Mutex::new(s)))
            .collect();
        let join = |list: &mut dyn Iterator<Item = SocketAddr>| {
            list.map(|a| a.to_string()).collect::<Vec<_>>().join(",")
        };
        let direct = join(&mut addrs.iter().copied());
        let register = Register::start().await.map_err(|e| e.to_string())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let collector = collect(rx);
        let history = collector.history.clone();
        let until = now_ns() + a.secs * 1_000_000_000;
        let mut rng = Rng::new(seed);
        // Each client reaches each server through a proxy of its own, so
        // that a partition can cut one replica off from the others.
        let client_args = |id: String, seed: u64, proxies: &[FaultProxy]| ClientArgs {
            kind: self.kind.clone(),
            servers: join(&mut proxies.iter().map(FaultProxy::addr)),
            register: register.addr().to_string(),
            workers: a.workers,
            keys: a.keys,
            lease_ms: a.lease.as_millis() as u64,
            seed,
            id,
            until_ns: until,
            quarantine: a.quarantine,
            root: root.to_owned(),
            sabotage: a.sabotage.map_or("", |s| s.name()).to_owned(),
        };
        let mut clients = Clients::new(work, tx.clone());
        for _ in 0..a.processes {
            let (id, proxies) = clients.prepare(&addrs).await?;
            clients.spawn(client_args(id, rng.next(), &proxies), proxies)?;
        }
        let mut counts = BTreeMap::new();
        let lease = a.lease;
        let longest = lease * 2 + Duration::from_secs(3);
        let mut bag = Bag::new(&self.faults);
        while now_ns() + (longest.as_nanos() as u64) < until {
            tokio::time::sleep(rng.between(lease / 2, lease * 2)).await;
            let Some(fault) = bag.draw(&mut rng) else {
                continue;
            };
            let lasting = rng.between(lease / 2, lease * 2);
            let began = now_ns();
            // The processes whose links the fault hits; none named: the
            // servers.
            let mut hit: Option<Vec<String>> = None;
            match fault {
                FaultKind::Partition
                | FaultKind::PartitionUp
                | FaultKind::PartitionDown
                | FaultKind::Drop
                | FaultKind::Latency => {
                    let set = match fault {
                        FaultKind::Partition => Fault::Freeze,
                        FaultKind::PartitionUp => Fault::FreezeUp,
                        FaultKind::PartitionDown => Fault::FreezeDown,
                        FaultKind::Drop => Fault::Drop,
                        _ => Fault::Latency(rng.between(Duration::from_millis(1), lease / 4)),
                    };
                    let mut ids = Vec::new();
                    for (id, server) in clients.links(&mut rng, addrs.len()) {
                        if let Some(proxy) = clients.proxy(&id, server) {
                            proxy.set(set).await;
                        }
                        ids.push(id);
                    }
                    hit = Some(ids);
                    tokio::time::sleep(lasting).await;
                    clients.heal().await;
                }
                FaultKind::Kill => {
                    let id = clients.any(&mut rng);
                    if let Some((sent, reaped)) = clients.kill(&id).await {
                        history
                            .lock()
                            .unwrap()
                            .process_fault(&id, ProcessFault::Killed { sent, reaped });
                    }
                    let (id, proxies) = clients.prepare(&addrs).await?;
                    clients.spawn(client_args(id, rng.next(), &proxies), proxies)?;
                }
                FaultKind::Pause => {
                    // A holder in its critical section when there is one:
                    // a pause past the lease there is what takes a lock
                    // from under its holder, and what the checker must see
                    // the holder told of (a pause of an idle process tests
                    // little, and left to chance, runs that should have
                    // lost a lock sometimes lost none).
                    let holding = history.lock().unwrap().in_critical_section();
                    let id = clients.any_of(&mut rng, &holding);
                    if let Some(pid) = clients.pid(&id) {
                        // Dated once every thread is seen stopped, not when
                        // the signal is sent (the process may run on a
                        // while): a pause excuses only grants made after it
                        // began. Not running before the signal that
                        // continues it.
                        let stopped = tokio::task::spawn_blocking(move || {
                            stop_pid(pid, Duration::from_secs(1))
                        })
                        .await
                        .ok()
                        .flatten();
                        tokio::time::sleep(lease * 3 / 2).await;
                        let cont = now_ns();
                        signal_pid(pid, "CONT");
                        match stopped {
                            Some(stop) => history
                                .lock()
                                .unwrap()
                                .process_fault(&id, ProcessFault::Paused(stop, cont)),
                            None => eprintln!(
                                "torture: client {id} was not seen stopped; its pause excuses nothing"
                            ),
                        }
                    }
                }
                FaultKind::ServerKill if failover.is_some() => {
                    // A master, so that the group replaces it; it comes back
                    // empty, once replaced, and rejoins as a replica.
                    let group = failover.as_ref().expect("a group that fails over");
                    let Some(master) = group.master(rng.next()).await else {
                        // Not done: drawn again later.
                        bag.put_back(fault);
                        continue;
                    };
                    let server = servers[master].clone();
                    server.lock().unwrap().kill();
                    if !group.failed_over(master, Duration::from_secs(30)).await {
                        eprintln!("torture: {} did not fail over within 30 s", group.who());
                    }
                    tokio::task::spawn_blocking(move || server.lock().unwrap().restart())
                        .await
                        .map_err(|e| e.to_string())??;
                    // Restarted, it may call itself master (empty) until the
                    // group converts it; a failover may also be followed by
                    // another (a Sentinel finding the new master slow to
                    // answer): the fault lasts until the group has settled.
                    group.settled(Duration::from_secs(30)).await;
                }
                FaultKind::ServerPause if failover.is_some() => {
                    let group = failover.as_ref().expect("a group that fails over");
                    let Some(master) = group.master(rng.next()).await else {
                        // Not done: drawn again later.
                        bag.put_back(fault);
                        continue;
                    };
                    let server = &servers[master];
                    server.lock().unwrap().signal("STOP");
                    tokio::time::sleep(lease * 3 / 2).await;
                    server.lock().unwrap().signal("CONT");
                    // Replaced meanwhile (or in the moments after: the group
                    // may be finishing), it still serves as master until it
                    // hears of it.
                    group.failed_over(master, lease * 2).await;
                    group.settled(Duration::from_secs(30)).await;
                }
                FaultKind::ServerKill => {
                    let server = servers[rng.below(servers.len() as u64) as usize].clone();
                    server.lock().unwrap().kill();
                    // Redlock's own rule for an instance without persistence:
                    // stay down for a lease ("delayed restarts"), so that it
                    // cannot help grant a lock a majority still holds.
                    if self.kind == "redlock" {
                        tokio::time::sleep(lease + lease / 10).await;
                    }
                    tokio::task::spawn_blocking(move || server.lock().unwrap().restart())
                        .await
                        .map_err(|e| e.to_string())??;
                }
                FaultKind::ServerPause => {
                    let server = &servers[rng.below(servers.len() as u64) as usize];
                    server.lock().unwrap().signal("STOP");
                    tokio::time::sleep(lease * 3 / 2).await;
                    server.lock().unwrap().signal("CONT");
                }
                FaultKind::Clock => {
                    let server = addrs[rng.below(addrs.len() as u64) as usize];
                    step_clock(server, root, lease * 2).await?;
                }
                FaultKind::Cancel | FaultKind::Panic => unreachable!("in-process faults"),
            }
            let (end, lease_ns) = (now_ns(), lease.as_nanos() as u64);
            match hit {
                Some(hit) => history.lock().unwrap().link_fault_window(
                    fault.name(),
                    began,
                    end,
                    lease_ns,
                    hit,
                ),
                None => history
                    .lock()
                    .unwrap()
                    .fault_window(fault.name(), began, end, lease_ns),
            }
            *counts.entry(fault.name()).or_insert(0u64) += 1;
        }
        clients.heal().await;
        // The clients stop at `until`, release, flush and exit.
        let grace = Duration::from_nanos(until.saturating_sub(now_ns()))
            + lease * 4
            + Duration::from_secs(20);
        let stragglers = clients.wait_all(grace).await;
        if stragglers > 0 {
            eprintln!(
                "torture: {stragglers} client processes did not finish in time and were killed"
            );
        }
        drop(tx);
        let backend = worker::open(&self.kind, &direct, lease, a.quarantine, root)
            .await
            .map_err(|e| format!("opening the backend for the final checks: {e}"))?;
        let keys = worker::keys(root, a.keys);
        // A killed holder's key comes back once its lease (or session) ends.
        // A `wait_for_replicas` backend refuses while a replica catches up.
        let unavailable = liveness(
            backend.clone(),
            &keys,
            lease,
            lease + Duration::from_secs(10),
            self.kind.ends_with("-wait"),
        )
        .await;
        backend.flush().await;
        drop(backend);
        let leaked = leaks(&self.kind, &data, root, lease * 3 + Duration::from_secs(10)).await?;
        let history = collector.finish().await;
        // Faults the backend documents as outside its guarantees: there the
        // fenced register must refuse every stale write instead.
        let outside: &[&str] = match self.kind.as_str() {
            "redis" if !a.quarantine => &["server-kill"],
            "redlock" => &["clock"],
            // A lock that lives with its connection is freed the moment the
            // server sees the connection cut; the holder hears of the cut
            // at about the same moment, but not surely before.
            "postgres" | "mysql" => &["drop"],
            // etcd 3.4.23 (Debian 12's): a leader paused and resumed still
            // revokes the leases that expired in its own view before it
            // learns it was deposed, and the revoke is forwarded to the new
            // leader and applied (etcd issues 12528 and 15247, fixed
            // upstream by pull request 16822): a server bug no client can
            // see coming.
            "etcd3" => &["server-pause"],
            // Replication is asynchronous: a failover can lose a lock or a
            // renewal the replicas did not have (`sentinel-wait` claims it
            // cannot).
            "sentinel" | "cluster" => &["server-kill", "server-pause"],
            _ => &[],
        };
        Ok(summarize(
            a,
            backend_name(&self.kind),
            seed,
            &history,
            &register,
            counts,
            leaked,
            unavailable,
            outside,
        ))
    }
}

fn backend_name(kind: &str) -> &'static str {
    match kind {
        "zk" | "zk3" => "zookeeper",
        "postgres" | "postgres-table" => "postgres",
        "mysql" => "mysql",
        "etcd" | "etcd3" => "etcd",
        "redis" | "sentinel" | "sentinel-wait" | "cluster" | "cluster-wait" => "redis",
        "redlock" => "redlock",
        _ => "memory",
    }
}

/// The faults to inject, drawn at random without replacement and refilled
/// once all have been drawn: a run meets as many different faults as it has
/// time for (a 30 s run about six of nine) instead of some several times.
struct Bag {
    all: Vec<FaultKind>,
    left: Vec<FaultKind>,
}

impl Bag {
    fn new(all: &[FaultKind]) -> Self {
        Bag {
            all: all.to_vec(),
            left: Vec::new(),
        }
    }

    fn draw(&mut self, rng: &mut Rng) -> Option<FaultKind> {
        if self.left.is_empty() {
            self.left = self.all.clone();
        }
        if self.left.is_empty() {
            return None;
        }
        let i = rng.below(self.left.len() as u64) as usize;
        Some(self.left.swap_remove(i))
    }

    /// Returns a fault that was drawn but could not be injected.
    fn put_back(&mut self, fault: FaultKind) {
        self.left.push(fault);
    }
}

/// Gathers events into a history as they come.
fn collect(mut rx: mpsc::UnboundedReceiver<(String, Event)>) -> Collector {
    let history = Arc::new(Mutex::new(History::default()));
    let shared = history.clone();
    let (finish, mut finished) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                biased;
                event = rx.recv() => match event {
                    Some((process, event)) => shared.lock().unwrap().record(&process, event),
                    None => return,
                },
                _ = &mut finished => {
                    // Every producer is done: what is queued is the rest.
                    while let Ok((process, event)) = rx.try_recv() {
                        shared.lock().unwrap().record(&process, event);
                    }
                    return;
                }
            }
        }
    });
    Collector {
        history,
        finish,
        task,
    }
}

/// The task that gathers the history, and the history.
struct Collector {
    history: Arc<Mutex<History>>,
    finish: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    /// The whole history, once every client and worker is done and its
    /// events are queued: nothing sent is left out.
    async fn finish(self) -> History {
        let _ = self.finish.send(());
        let _ = self.task.await;
        std::mem::take(&mut *self.history.lock().unwrap())
    }
}
