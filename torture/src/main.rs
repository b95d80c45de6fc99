//! The torture harness: many lock holders under injected faults, and a
//! checker over what happened.
//!
//! ```text
//! cargo run --release -p tower-lock-torture -- --backend zk --secs 30 --processes 3 --workers 4 \
//!     --keys 4 --lease-ms 2000 --nemesis all --seed 1
//! ```
//!
//! `--backend` is `memory`, `redis`, `sentinel` (a Redis master, two
//! replicas and three Sentinels), `sentinel-wait` (the same, every lock and
//! renewal waiting for both replicas), `cluster` (a Redis Cluster of three
//! masters and a replica of each), `cluster-wait` (the same, waiting for
//! the replica), `redlock`, `zk`, `zk3` (a three-server
//! ensemble), `postgres` (advisory locks), `postgres-table` (the lease-table
//! mode), `mysql` (MariaDB's `GET_LOCK`), `etcd` or `etcd3` (a three-member
//! etcd cluster):
//! the harness starts its own servers, so that it can kill, restart and
//! pause them. Or a URL (`redis://..`, `redlock://..`, `zk://..`) of
//! servers it does not own, which rules out the server faults.
//!
//! P client processes of W workers each lock random keys among K with the
//! given lease (ZooKeeper: session timeout) and, inside the critical
//! section, read-modify-write a fenced register kept in the harness
//! ([`register`]). Every client connects to every server through a fault
//! proxy ([`fault_proxy`]). The nemesis ([`nemesis`]) injects the faults
//! `--nemesis` names, one at a time, at random moments, each bounded and
//! healed. Every hold is recorded on the system-wide monotonic clock
//! (granted, told lost, released) and checked ([`history`]) once the run
//! and a liveness check are over. One summary line in the bench format; exit
//! code 1 when a guarantee was broken, 2 for bad arguments.
//!
//! The whole description of the checks and of what each backend promises
//! under which fault is in `torture/README.md`.

mod checks;
mod clients;
mod faults;
mod history;
mod mode;
mod nemesis;
mod register;
mod sabotage;
mod summary;
mod worker;

use std::process::ExitCode;
use std::time::Duration;

use nemesis::Nemesis;

/// The run's settings.
#[derive(Clone, Debug)]
pub struct Args {
    pub backend: String,
    pub secs: u64,
    pub processes: usize,
    pub workers: usize,
    pub keys: usize,
    pub lease: Duration,
    pub nemesis: String,
    pub seed: Option<u64>,
    /// Redis: `RedisOptions::restart_quarantine`.
    pub quarantine: bool,
    /// A promise to break on purpose: the run must then fail.
    pub sabotage: Option<sabotage::Sabotage>,
    /// Internal: run as a client process with these settings.
    pub client: Option<worker::ClientArgs>,
}

const USAGE: &str =
    "usage: torture --backend <memory|redis|sentinel|sentinel-wait|cluster|cluster-wait|redlock|zk|zk3|postgres|postgres-table|mysql|etcd|etcd3|URL> [--secs S] \
[--processes P] [--workers W] [--keys K] [--lease-ms L] [--nemesis all|none|LIST] [--seed N] \
[--quarantine] [--sabotage early-release|same-token|no-lost|ignore-lease]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        backend: String::new(),
        secs: 30,
        processes: 3,
        workers: 4,
        keys: 4,
        lease: Duration::from_secs(2),
        nemesis: "all".into(),
        seed: None,
        quarantine: false,
        sabotage: None,
        client: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{flag}: {v:?} is not a number"))
        }
        match flag.as_str() {
            "--backend" => a.backend = value()?,
            "--secs" => a.secs = num(&flag, value()?)?,
            "--processes" => a.processes = num(&flag, value()?)?,
            "--workers" => a.workers = num(&flag, value()?)?,
            "--keys" => a.keys = num(&flag, value()?)?,
            "--lease-ms" => a.lease = Duration::from_millis(num(&flag, value()?)?),
            "--nemesis" => a.nemesis = value()?,
            "--seed" => a.seed = Some(num(&flag, value()?)?),
            "--quarantine" => a.quarantine = true,
            "--sabotage" => a.sabotage = Some(sabotage::Sabotage::parse(&value()?)?),
            "--client" => a.client = Some(worker::ClientArgs::parse(&value()?)?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.client.is_none() && a.backend.is_empty() {
        return Err(format!("--backend is required\n{USAGE}"));
    }
    if a.secs == 0 || a.processes == 0 || a.workers == 0 || a.keys == 0 {
        return Err("every count must be at least 1".into());
    }
    if matches!(a.backend.as_str(), "zk" | "zk3" | "etcd" | "etcd3")
        && a.lease < Duration::from_millis(500)
    {
        return Err("--lease-ms must be at least 500 on ZooKeeper (its shortest session here) and etcd (whole seconds)".into());
    }
    // A lease a few times the cohort's 50 ms hold bound makes it keep back
    // hand-offs of leases not surely fresh, which the summary counts.
    if a.lease < Duration::from_millis(30) {
        return Err("--lease-ms must be at least 30 (the library's shortest lease)".into());
    }
    Ok(a)
}

/// Tells the harness of every hand-off a cohort kept back.
struct KeptBack;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for KeptBack {
    fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        println!(
            "{}",
            history::Event::KeptBack {
                at: history::now_ns()
            }
            .line()
        );
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Some(client) = args.client {
        // Warnings (a lock lost, a master moved) go to the process's log,
        // which the harness keeps when a guarantee broke.
        // A hand-off the cohort keeps back (the lease not surely fresh) is
        // counted: told to the harness on stdout, as the workers' events are.
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        use tracing_subscriber::Layer;
        let log = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            );
        let kept_back = KeptBack.with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target("tower_lock::cohort", tracing::Level::DEBUG),
        );
        tracing_subscriber::registry()
            .with(log)
            .with(kept_back)
            .init();
        return rt.block_on(worker::client_main(client));
    }
    let nemesis = match Nemesis::plan(&args) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("torture: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(nemesis.run()) {
        Ok(summary) => {
            println!("{}", summary.line);
            for example in &summary.examples {
                eprintln!("torture: {example}");
            }
            if summary.broken.is_empty() {
                ExitCode::SUCCESS
            } else {
                eprintln!(
                    "torture: guarantees broken: {} (replay with --seed {})",
                    summary.broken.join(", "),
                    summary.seed
                );
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("torture: {e}");
            ExitCode::from(2)
        }
    }
}
