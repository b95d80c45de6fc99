//! Starts the servers the test command and the bench use, for a shell
//! script (`scripts/servers.sh`):
//!
//! ```text
//! tower-lock-servers DIR SET...
//! ```
//!
//! starts every server of each SET on free loopback ports, under DIR,
//! writes `DIR/env` (shell assignments of their addresses, sourced by the
//! script) once all serve, and stops them all when it is sent SIGTERM or
//! SIGINT. The sets:
//!
//! - `base`: one redis-server (`TOWER_LOCK_REDIS_URL`), three more for
//!   Redlock (`TOWER_LOCK_REDLOCK_URL`, and `redlock`, their addresses),
//!   ZooKeeper (`TOWER_LOCK_ZK_ADDR`), PostgreSQL (`TOWER_LOCK_POSTGRES_URL`)
//!   and PgBouncer in transaction pooling in front of it
//!   (`TOWER_LOCK_PGBOUNCER_URL`), MariaDB (`TOWER_LOCK_MYSQL_URL`), one
//!   etcd member (`TOWER_LOCK_ETCD_URL`). PostgreSQL and MariaDB are the
//!   machine's (127.0.0.1:5432 and :3306, database `test`) when they
//!   answer and `TOWER_LOCK_PRIVATE_POSTGRES` / `_MARIADB` is not set.
//! - `sentinel`: a master, two replicas, three Sentinels (`sentinel_urls`).
//! - `redis-cluster`: three masters and a replica of each
//!   (`redis_cluster_urls`).
//! - `zk-ensemble`: three ZooKeeper servers (`zk_ensemble`).
//! - `etcd3`: three etcd members (`etcd_urls`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use tower_lock_servers::redis_groups::Failover;
use tower_lock_servers::{Kind, Server};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((dir, sets)) = args.split_first().filter(|(_, sets)| !sets.is_empty()) else {
        eprintln!("usage: tower-lock-servers DIR SET... (SET: base, sentinel, redis-cluster, zk-ensemble, etcd3)");
        return ExitCode::from(2);
    };
    let dir = Path::new(dir);
    // Caught from now on (servers started later reset them to the default
    // as they exec), so that a stop while starting still stops them all.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tower-lock-servers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stop = {
        use tokio::signal::unix::{signal, SignalKind};
        let _entered = runtime.enter();
        let kinds = [
            SignalKind::terminate(),
            SignalKind::interrupt(),
            SignalKind::hangup(),
        ];
        match kinds.map(signal) {
            [Ok(mut term), Ok(mut int), Ok(mut hup)] => {
                async move {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                        _ = hup.recv() => {}
                    }
                }
            }
            _ => {
                eprintln!("tower-lock-servers: cannot catch signals");
                return ExitCode::FAILURE;
            }
        }
    };
    let mut servers = Vec::new();
    let mut env = Vec::new();
    for set in sets {
        if let Err(e) = start(set, dir, &runtime, &mut servers, &mut env) {
            eprintln!("tower-lock-servers: {set}: {e}");
            return ExitCode::FAILURE;
        }
    }
    // Written whole, then renamed: the script never reads half of it.
    let text: String = env.iter().map(|line| format!("{line}\n")).collect();
    let written = std::fs::write(dir.join("env.tmp"), text)
        .and_then(|()| std::fs::rename(dir.join("env.tmp"), dir.join("env")));
    if let Err(e) = written {
        eprintln!(
            "tower-lock-servers: writing {}: {e}",
            dir.join("env").display()
        );
        return ExitCode::FAILURE;
    }
    runtime.block_on(stop);
    // Each server is stopped (resumed if paused, killed, reaped) as it drops.
    drop(servers);
    ExitCode::SUCCESS
}

fn start(
    set: &str,
    dir: &Path,
    runtime: &tokio::runtime::Runtime,
    servers: &mut Vec<Server>,
    env: &mut Vec<String>,
) -> Result<(), String> {
    let list = |addrs: &[SocketAddr]| {
        addrs
            .iter()
            .map(SocketAddr::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    match set {
        "base" => {
            let redis = Server::start(Kind::Redis, dir, "redis")?;
            env.push(format!(
                "export TOWER_LOCK_REDIS_URL=redis://{}",
                redis.addr
            ));
            servers.push(redis);
            let mut redlock = Vec::new();
            for i in 1..=3 {
                let server = Server::start(Kind::Redis, dir, &format!("redlock{i}"))?;
                redlock.push(server.addr);
                servers.push(server);
            }
            env.push(format!(
                "export TOWER_LOCK_REDLOCK_URL=redlock://{}",
                list(&redlock)
            ));
            env.push(format!("redlock=({})", list(&redlock).replace(',', " ")));
            let zk = Server::start(Kind::ZooKeeper, dir, "zk")?;
            env.push(format!("export TOWER_LOCK_ZK_ADDR={}", zk.addr));
            servers.push(zk);
            let postgres = match machines("TOWER_LOCK_PRIVATE_POSTGRES", 5432, postgres_answers) {
                Some(addr) => addr,
                None => {
                    let server = Server::start(Kind::Postgres, dir, "postgres")?;
                    create_test_database(server.addr)?;
                    let addr = server.addr;
                    servers.push(server);
                    addr
                }
            };
            env.push(format!(
                "export TOWER_LOCK_POSTGRES_URL=postgres://postgres@{postgres}/test"
            ));
            let bouncer = Server::start_pgbouncer(dir, "pgbouncer", postgres)?;
            env.push(format!(
                "export TOWER_LOCK_PGBOUNCER_URL=postgres://postgres@{}/test",
                bouncer.addr
            ));
            servers.push(bouncer);
            let mariadb = match machines("TOWER_LOCK_PRIVATE_MARIADB", 3306, mariadb_answers) {
                Some(addr) => addr,
                None => {
                    let server = Server::start(Kind::Mariadb, dir, "mariadb")?;
                    let addr = server.addr;
                    servers.push(server);
                    addr
                }
            };
            env.push(format!(
                "export TOWER_LOCK_MYSQL_URL=mysql://root@{mariadb}/test"
            ));
            let etcd = Server::start(Kind::Etcd, dir, "etcd")?;
            env.push(format!("export TOWER_LOCK_ETCD_URL=etcd://{}", etcd.addr));
            servers.push(etcd);
        }
        "sentinel" => {
            let group =
                Server::start_sentinel_group(&dir.join("sentinel"), Duration::from_secs(1))?;
            let (data, sentinels) = group.split_at(3);
            let addrs = |s: &[Server]| s.iter().map(|s| s.addr).collect::<Vec<_>>();
            let failover = Failover::Sentinel {
                sentinels: addrs(sentinels),
                data: addrs(data),
            };
            runtime.block_on(failover.settled(SETTLE_WITHIN));
            runtime.block_on(replicated(addrs(data), addrs(sentinels)))?;
            env.push(format!("sentinel_urls={}", list(&addrs(sentinels))));
            servers.extend(group);
        }
        "redis-cluster" => {
            let nodes = Server::start_redis_cluster(&dir.join("redis-cluster"))?;
            let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
            let failover = Failover::Cluster {
                nodes: addrs.clone(),
            };
            runtime.block_on(failover.settled(SETTLE_WITHIN));
            env.push(format!("redis_cluster_urls={}", list(&addrs)));
            servers.extend(nodes);
        }
        "zk-ensemble" => {
            let members = Server::start_cluster(Kind::ZooKeeper, &dir.join("zk-ensemble"), 3)?;
            let addrs: Vec<SocketAddr> = members.iter().map(|m| m.addr).collect();
            env.push(format!("zk_ensemble={}", list(&addrs)));
            servers.extend(members);
        }
        "etcd3" => {
            let members = Server::start_cluster(Kind::Etcd, &dir.join("etcd3"), 3)?;
            let addrs: Vec<SocketAddr> = members.iter().map(|m| m.addr).collect();
            env.push(format!("etcd_urls={}", list(&addrs)));
            servers.extend(members);
        }
        other => return Err(format!("no set {other:?}")),
    }
    Ok(())
}

/// The machine's server on `port` when it answers and `private` is not
/// set in the environment.
fn machines(private: &str, port: u16, answers: fn(SocketAddr) -> bool) -> Option<SocketAddr> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    (std::env::var_os(private).is_none() && answers(addr)).then_some(addr)
}

fn quietly(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn postgres_answers(addr: SocketAddr) -> bool {
    quietly(Command::new("psql").args([
        &format!("postgres://postgres@{addr}/test"),
        "-Atqc",
        "SELECT 1",
    ]))
}

fn mariadb_answers(addr: SocketAddr) -> bool {
    quietly(Command::new("mariadb").args([
        "-h",
        &addr.ip().to_string(),
        "-P",
        &addr.port().to_string(),
        "-u",
        "root",
        "test",
        "-e",
        "SELECT 1",
    ]))
}

fn create_test_database(addr: SocketAddr) -> Result<(), String> {
    let url = format!("postgres://postgres@{addr}/postgres");
    if quietly(Command::new("psql").args([&url, "-qc", "CREATE DATABASE test"])) {
        Ok(())
    } else {
        Err(format!("CREATE DATABASE test on {addr} failed"))
    }
}

/// How long a Sentinel group or a Cluster has to agree on its masters.
const SETTLE_WITHIN: Duration = Duration::from_secs(60);

/// Waits (a minute at most) until the first of `data`, the master, streams
/// to the two others and every Sentinel knows both: until then a failover
/// could not happen, and `wait_for_replicas` would wait for nothing.
async fn replicated(data: Vec<SocketAddr>, sentinels: Vec<SocketAddr>) -> Result<(), String> {
    async fn ask<T: redis::FromRedisValue>(addr: SocketAddr, cmd: &redis::Cmd) -> Option<T> {
        let client = redis::Client::open(format!("redis://{addr}")).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        cmd.query_async(&mut conn).await.ok()
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let info: Option<String> = ask(data[0], redis::cmd("INFO").arg("replication")).await;
        let online = info.map_or(0, |i| i.matches("state=online").count());
        let mut known = Vec::new();
        for &sentinel in &sentinels {
            let master: Option<std::collections::HashMap<String, String>> = ask(
                sentinel,
                redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(tower_lock_servers::SENTINEL_MASTER),
            )
            .await;
            known.push(master.and_then(|m| m.get("num-slaves")?.parse::<usize>().ok()));
        }
        if online == data.len() - 1 && known.iter().all(|k| *k == Some(data.len() - 1)) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "the Sentinel group did not replicate within a minute: {online} replicas \
                 online, each Sentinel knows {known:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
