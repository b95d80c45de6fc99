//! A lock holder: what every worker of every client process does, and the
//! client process itself.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tower_lock::backend::etcd::{EtcdBackend, EtcdOptions};
use tower_lock::backend::mysql::{MysqlBackend, MysqlOptions};
use tower_lock::backend::postgres::{PostgresBackend, PostgresOptions};
use tower_lock::backend::redis::redlock::RedlockBackend;
use tower_lock::backend::redis::{RedisBackend, RedisOptions};
use tower_lock::backend::zookeeper::{ZookeeperBackend, ZookeeperOptions};
use tower_lock::backend::Capabilities;
use tower_lock::{Backend, BackendExt, LockError, LockGuard, LockMode, LockSet, Wait};

use crate::history::{now_ns, Event, Mode};
use crate::register::{Answer, RegisterClient};
use crate::sabotage::{Sabotage, Sabotaged};

/// A small, seeded pseudo-random sequence (xorshift64*), so that a run can
/// be replayed from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A duration between `lo` and `hi`.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = hi.saturating_sub(lo).as_micros() as u64;
        lo + Duration::from_micros(self.below(span + 1))
    }
}

/// Where a worker's events go: the client process's standard output (read
/// by the harness), or straight to the harness when it runs in process.
#[derive(Clone)]
pub enum Sink {
    Stdout,
    Channel(tokio::sync::mpsc::UnboundedSender<(String, Event)>),
}

impl Sink {
    fn emit(&self, process: &str, event: Event) {
        match self {
            // One write per line (stdout is line-buffered), so lines of
            // different workers never interleave.
            Sink::Stdout => println!("{}", event.line()),
            Sink::Channel(tx) => {
                let _ = tx.send((process.to_owned(), event));
            }
        }
    }
}

/// One worker's settings.
pub struct Worker {
    pub backend: Arc<dyn Backend>,
    pub register: SocketAddr,
    pub keys: Arc<Vec<String>>,
    pub lease: Duration,
    /// The process (or, in process, the task) it belongs to.
    pub process: String,
    pub name: String,
    pub seed: u64,
    pub until_ns: u64,
    pub sink: Sink,
    /// In process: set by the nemesis to make the worker panic while it
    /// holds a lock.
    pub panic: Option<Arc<AtomicBool>>,
}

/// What one turn of a worker locks: its keys and mode.
struct Pick {
    keys: Vec<String>,
    mode: Mode,
}

impl Worker {
    /// What to lock next: mostly a mutex on one of the keys; where the
    /// backend has them, a read or write lock on a key of the read/write
    /// family (`<key>:rw`) or a permit of a two-permit semaphore
    /// (`<key>:sem`); and `lock_all` over two of the keys. Each family has
    /// keys of its own: a mutex and a read/write lock on one key do not
    /// exclude each other on a remote backend (`LockMode`'s docs). The
    /// names keep the keys' prefix, which the leak checks look for.
    fn pick(&self, rng: &mut Rng, caps: Capabilities) -> Pick {
        let key = |rng: &mut Rng| self.keys[rng.below(self.keys.len() as u64) as usize].clone();
        let one = |key: String, mode| Pick {
            keys: vec![key],
            mode,
        };
        match rng.below(10) {
            5 | 6 if caps.supports(LockMode::Read) => {
                let mode = if rng.below(2) == 0 {
                    Mode::Read
                } else {
                    Mode::Write
                };
                one(format!("{}:rw", key(rng)), mode)
            }
            7 if caps.supports(LockMode::Semaphore {
                permits: SEMAPHORE_PERMITS,
            }) =>
            {
                one(
                    format!("{}:sem", key(rng)),
                    Mode::Semaphore(SEMAPHORE_PERMITS),
                )
            }
            8 | 9 if self.keys.len() > 1 => {
                let first = rng.below(self.keys.len() as u64) as usize;
                let second =
                    (first + 1 + rng.below(self.keys.len() as u64 - 1) as usize) % self.keys.len();
                Pick {
                    keys: vec![self.keys[first].clone(), self.keys[second].clone()],
                    mode: Mode::All,
                }
            }
            _ => one(key(rng), Mode::Exclusive),
        }
    }

    /// Locks random keys in every mode the backend has until `until_ns`,
    /// doing a read-modify-write on the register inside each critical
    /// section (readers only read; semaphore holders only count).
    pub async fn run(self) {
        let mut rng = Rng::new(self.seed);
        let mut register = RegisterClient::connect(self.register)
            .await
            .expect("the harness's register");
        let caps = self.backend.capabilities();
        let mut seq = 0u64;
        while now_ns() < self.until_ns {
            let pick = self.pick(&mut rng, caps);
            let asked = now_ns();
            let acquired = if pick.mode == Mode::All {
                self.backend
                    .lock_all(pick.keys.iter().map(String::as_str))
                    .lease(self.lease)
                    .wait(Wait::Timeout(self.lease * 2))
                    .await
                    .map(Held::Set)
            } else {
                self.backend
                    .lock(pick.keys[0].as_str())
                    .mode(pick.mode.lock_mode())
                    .lease(self.lease)
                    .wait(Wait::Timeout(self.lease * 2))
                    .await
                    .map(Held::One)
            };
            let held = match acquired {
                Ok(held) => held,
                Err(e) => {
                    self.sink.emit(&self.process, Event::Failed);
                    if !matches!(e, LockError::Timeout { .. } | LockError::Busy) {
                        // The backend is unreachable: do not spin.
                        let pause = rng.between(Duration::from_millis(10), self.lease / 10);
                        tokio::time::sleep(pause).await;
                    }
                    continue;
                }
            };
            seq += 1;
            let at = now_ns();
            // One hold per lock: a set's locks are recorded one by one.
            let holds: Vec<(String, &LockGuard)> = held
                .guards()
                .iter()
                .enumerate()
                .map(|(i, g)| match held {
                    Held::One(_) => (format!("{}.{}", self.name, seq), g),
                    Held::Set(_) => (format!("{}.{}+{}", self.name, seq, i), g),
                })
                .collect();
            for (hold, guard) in &holds {
                self.sink.emit(
                    &self.process,
                    Event::Granted {
                        hold: hold.clone(),
                        key: guard.key().as_str().to_owned(),
                        token: guard.token().get(),
                        at,
                        asked,
                        mode: pick.mode,
                    },
                );
            }
            // Declared after the locks, so dropped before them, also when
            // the task is cancelled or panics: each hold's end is recorded
            // before the release can let anyone else in.
            let endings: Vec<Ending> = holds
                .iter()
                .map(|(hold, guard)| {
                    let lost = guard.lost();
                    let (sink, process, id) =
                        (self.sink.clone(), self.process.clone(), hold.clone());
                    Ending {
                        sink: &self.sink,
                        process: &self.process,
                        hold: hold.clone(),
                        told: tokio::spawn(async move {
                            lost.await;
                            sink.emit(
                                &process,
                                Event::ToldLost {
                                    hold: id,
                                    at: now_ns(),
                                },
                            );
                        }),
                    }
                })
                .collect();
            // Whether the holder knows one of its locks is lost, recorded
            // as it learns it (the watchers above may not run before the
            // release).
            let told_now = || {
                let mut any = false;
                for (hold, guard) in &holds {
                    if guard.is_lost() {
                        any = true;
                        self.sink.emit(
                            &self.process,
                            Event::ToldLost {
                                hold: hold.clone(),
                                at: now_ns(),
                            },
                        );
                    }
                }
                any
            };
            // The critical section: read, think, write what was read plus
            // one, on each key (a reader only reads; a semaphore's holder
            // only thinks: its holders share the key). Its last act is
            // dated when it starts (the write sent, or the write skipped):
            // a holder stopped between sending its write and reading the
            // answer acted before it was stopped. Dated after the check, as
            // the one below: a holder stopped right after its grant and
            // told as it runs again skips, and its skip must not be dated
            // before it was told.
            let mut outcome = if told_now() { "skip" } else { "ok" };
            let mut last_act = now_ns();
            let mut values = Vec::new();
            if outcome == "ok" && pick.mode.uses_register() {
                for (hold, guard) in &holds {
                    let key = guard.key().as_str();
                    match register
                        .read(key, guard.token().get(), hold)
                        .await
                        .expect("register")
                    {
                        Answer::Value(v) => values.push(v),
                        _ => outcome = "stale",
                    }
                }
            }
            if outcome == "ok" {
                // Mostly short; one in six outlives the lease, so that
                // faults find holders to take locks from.
                let think = if rng.below(6) == 0 {
                    rng.between(self.lease / 2, self.lease * 2)
                } else {
                    rng.between(Duration::ZERO, self.lease / 20)
                };
                tokio::time::sleep(think).await;
                let told = told_now();
                last_act = now_ns();
                if told {
                    outcome = "skip";
                } else if pick.mode.writes() {
                    for ((hold, guard), v) in holds.iter().zip(&values) {
                        let (key, token) = (guard.key().as_str(), guard.token().get());
                        match register.write(key, token, hold, v + 1).await {
                            Ok(Answer::Ok) => {}
                            Ok(_) => outcome = "stale",
                            Err(e) => panic!("register: {e}"),
                        }
                    }
                }
            }
            for (hold, _) in &holds {
                self.sink.emit(
                    &self.process,
                    Event::Wrote {
                        hold: hold.clone(),
                        outcome: outcome.into(),
                        at: last_act,
                    },
                );
            }
            drop(holds);
            if self
                .panic
                .as_ref()
                .is_some_and(|p| p.swap(false, Ordering::SeqCst))
            {
                // Unwinding drops the locks: the release must still happen.
                panic!("torture: a holder panics, as the nemesis asked");
            }
            drop(endings);
            if rng.below(2) == 0 {
                drop(held);
            } else {
                let _ = held.release().await;
            }
        }
    }
}

/// Permits of the torture's semaphores: two, so that holders share a key
/// and a third is one too many.
const SEMAPHORE_PERMITS: u32 = 2;

/// One turn's locks.
enum Held {
    One(LockGuard),
    Set(LockSet),
}

impl Held {
    fn guards(&self) -> &[LockGuard] {
        match self {
            Held::One(g) => std::slice::from_ref(g),
            Held::Set(s) => s.guards(),
        }
    }

    async fn release(self) -> Result<(), LockError> {
        match self {
            Held::One(g) => g.release().await,
            Held::Set(s) => s.release().await,
        }
    }
}

/// Records the end of a hold when dropped: when its holder stops acting on
/// it, whether by releasing, by being cancelled or by panicking.
struct Ending<'a> {
    sink: &'a Sink,
    process: &'a str,
    hold: String,
    told: tokio::task::JoinHandle<()>,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.told.abort();
        self.sink.emit(
            self.process,
            Event::Released {
                hold: std::mem::take(&mut self.hold),
                at: now_ns(),
            },
        );
    }
}

/// What the harness tells a client process, passed as one `--client`
/// argument: `key=value` pairs separated by `;`.
#[derive(Clone, Debug, Default)]
pub struct ClientArgs {
    pub kind: String,
    /// Server addresses (the proxies'), comma-separated.
    pub servers: String,
    pub register: String,
    pub workers: usize,
    pub keys: usize,
    pub lease_ms: u64,
    pub seed: u64,
    pub id: String,
    pub until_ns: u64,
    pub quarantine: bool,
    pub root: String,
    /// `--sabotage`'s name, or empty.
    pub sabotage: String,
}

impl ClientArgs {
    pub fn parse(s: &str) -> Result<ClientArgs, String> {
        let mut c = ClientArgs::default();
        for pair in s.split(';') {
            let (k, v) = pair.split_once('=').ok_or(format!("--client: {pair:?}"))?;
            let bad = |_| format!("--client: {k}={v}");
            match k {
                "kind" => c.kind = v.into(),
                "servers" => c.servers = v.into(),
                "register" => c.register = v.into(),
                "workers" => c.workers = v.parse().map_err(bad)?,
                "keys" => c.keys = v.parse().map_err(bad)?,
                "lease_ms" => c.lease_ms = v.parse().map_err(bad)?,
                "seed" => c.seed = v.parse().map_err(bad)?,
                "id" => c.id = v.into(),
                "until_ns" => c.until_ns = v.parse().map_err(bad)?,
                "quarantine" => c.quarantine = v == "1",
                "root" => c.root = v.into(),
                "sabotage" => c.sabotage = v.into(),
                _ => return Err(format!("--client: unknown {k}")),
            }
        }
        Ok(c)
    }

    pub fn format(&self) -> String {
        format!(
            "kind={};servers={};register={};workers={};keys={};lease_ms={};seed={};id={};\
             until_ns={};quarantine={};root={};sabotage={}",
            self.kind,
            self.servers,
            self.register,
            self.workers,
            self.keys,
            self.lease_ms,
            self.seed,
            self.id,
            self.until_ns,
            u8::from(self.quarantine),
            self.root,
            self.sabotage
        )
    }
}

/// The keys of a run.
pub fn keys(root: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{root}-k{i}")).collect()
}

/// Opens the backend of `kind` on `servers` (comma-separated host:port).
pub async fn open(
    kind: &str,
    servers: &str,
    lease: Duration,
    quarantine: bool,
    root: &str,
) -> Result<Arc<dyn Backend>, LockError> {
    Ok(match kind {
        "redis" => {
            let mut options = RedisOptions::default();
            if quarantine {
                options = options.restart_quarantine(lease);
            }
            Arc::new(RedisBackend::connect_with(&format!("redis://{servers}"), options).await?)
        }
        // Both replicas' acknowledgement, as the option's docs ask: one
        // would not do. A paused master that runs again serves until the
        // Sentinels convert it, and a replica not yet moved to the new
        // master still acknowledges its grants, then drops them as it
        // follows the new one (a CI run: 3 overlaps unwarned). The replica
        // being promoted has stopped following the old master, so waiting
        // for all of them refuses those grants.
        "sentinel" | "sentinel-wait" => {
            let mut options = RedisOptions::default();
            if kind == "sentinel-wait" {
                options = options.wait_for_replicas(2, Duration::from_millis(100));
            }
            let url = format!(
                "redis+sentinel://{servers}/{}",
                tower_lock_servers::SENTINEL_MASTER
            );
            Arc::new(RedisBackend::connect_with(&url, options).await?)
        }
        // Each master has one replica, which a failover promotes.
        "cluster" | "cluster-wait" => {
            let mut options = RedisOptions::default();
            if kind == "cluster-wait" {
                options = options.wait_for_replicas(1, Duration::from_millis(100));
            }
            let url = format!("redis+cluster://{servers}");
            Arc::new(RedisBackend::connect_with(&url, options).await?)
        }
        "redlock" => Arc::new(RedlockBackend::connect(&format!("redlock://{servers}")).await?),
        "zk" | "zk3" => Arc::new(
            ZookeeperBackend::connect_with(
                &format!("zk://{servers}"),
                ZookeeperOptions::default()
                    .root(format!("/{root}"))
                    .session_timeout(lease),
            )
            .await?,
        ),
        // A lease TTL is whole seconds.
        "etcd" | "etcd3" => Arc::new(
            EtcdBackend::connect_with(
                &format!("etcd://{servers}"),
                EtcdOptions::default()
                    .root(format!("/{root}"))
                    .lease_ttl(Duration::from_secs(lease.as_secs().max(1))),
            )
            .await?,
        ),
        "mysql" => Arc::new(
            MysqlBackend::connect_with(
                // TCP through the fault proxy: by default the driver moves
                // a connection to a server on this host onto its Unix
                // socket, round every fault the harness injects.
                &format!("mysql://root@{servers}/test?prefer_socket=false"),
                MysqlOptions::default().session_lease(lease),
            )
            .await?,
        ),
        "postgres" => Arc::new(
            PostgresBackend::connect_with(
                &format!("postgres://postgres@{servers}/postgres"),
                PostgresOptions::default().session_lease(lease),
            )
            .await?,
        ),
        "postgres-table" => Arc::new(
            PostgresBackend::connect_with(
                &format!("postgres://postgres@{servers}/postgres"),
                PostgresOptions::default().lease_table("tower_lock_leases"),
            )
            .await?,
        ),
        other => {
            return Err(LockError::Config(format!(
                "no client process for backend {other}"
            )))
        }
    })
}

/// A client process: W workers until the deadline, then release, flush,
/// and say `D` (done).
pub async fn client_main(c: ClientArgs) -> ExitCode {
    let lease = Duration::from_millis(c.lease_ms);
    // The servers may be down or cut off right now: keep trying.
    let backend = loop {
        match open(&c.kind, &c.servers, lease, c.quarantine, &c.root).await {
            Ok(b) => {
                let sabotage = match c.sabotage.as_str() {
                    "" => None,
                    name => Some(Sabotage::parse(name).expect("the harness's own --sabotage")),
                };
                break Sabotaged::wrap(b, sabotage);
            }
            Err(e) if now_ns() < c.until_ns => {
                eprintln!("torture client {}: {e}; retrying", c.id);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                eprintln!("torture client {}: {e}", c.id);
                println!("D");
                return ExitCode::SUCCESS;
            }
        }
    };
    let register: SocketAddr = match c.register.parse() {
        Ok(a) => a,
        Err(_) => return ExitCode::from(2),
    };
    let keys = Arc::new(keys(&c.root, c.keys));
    let mut tasks = Vec::new();
    for w in 0..c.workers {
        let worker = Worker {
            backend: backend.clone(),
            register,
            keys: keys.clone(),
            lease,
            process: c.id.clone(),
            name: format!("{}.{w}", c.id),
            seed: c.seed ^ ((w as u64 + 1) << 32) ^ u64::from(std::process::id()),
            until_ns: c.until_ns,
            sink: Sink::Stdout,
            panic: None,
        };
        tasks.push(tokio::spawn(worker.run()));
    }
    for t in tasks {
        let _ = t.await;
    }
    let _ = tokio::time::timeout(lease * 3, backend.flush()).await;
    println!("D");
    ExitCode::SUCCESS
}

/// In process (the memory backend): whether a worker panicking is the fault
/// the nemesis injected.
pub fn panic_flag() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}
