//! The ZooKeeper backend against a real ZooKeeper server, Curator and kazoo.
//! `scripts/test-all.sh` starts the server and sets `TOWER_LOCK_ZK_ADDR`;
//! the fault tests start servers of their own so they can pause them. Run
//! without it, every test here fails and says how to start one.
//!
//! This package always builds tower-lock with the `zookeeper` feature, so
//! these tests are never skipped by a feature set.

#[path = "../common/mod.rs"]
mod common;
mod conformance;
mod faults;
mod interop;
mod one_server;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::fault_proxy::{Fault as ProxyFault, FaultProxy};
use tower_lock::backend::zookeeper::{ZookeeperBackend, ZookeeperOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError, LockKey, LockMode, Wait};
use zookeeper_client as zk;

fn zk_addr() -> String {
    std::env::var("TOWER_LOCK_ZK_ADDR").unwrap_or_else(|_| {
        panic!(
            "TOWER_LOCK_ZK_ADDR is not set. Run scripts/test-all.sh, which starts a ZooKeeper \
             server, or start one (java -cp /etc/zookeeper/conf:/usr/share/java/zookeeper.jar \
             org.apache.zookeeper.server.quorum.QuorumPeerMain zoo.cfg, with \
             4lw.commands.whitelist=* in zoo.cfg) and set TOWER_LOCK_ZK_ADDR=127.0.0.1:PORT"
        )
    })
}

/// This test's own root, so tests never see each other's nodes.
fn root(test: &str) -> String {
    format!("/t-{test}-{}", std::process::id())
}

async fn backend(test: &str) -> ZookeeperBackend {
    backend_at(&zk_addr(), test, Duration::from_secs(4)).await
}

/// A backend whose every acquisition makes a node, as Curator's do: for
/// tests of what the server sees of waiters.
async fn plain_backend(test: &str) -> ZookeeperBackend {
    let addr = zk_addr();
    ZookeeperBackend::connect_with(
        &format!("zk://{addr}"),
        ZookeeperOptions::default()
            .root(root(test))
            .session_timeout(Duration::from_secs(4))
            .cohort(CohortOptions::off()),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot reach ZooKeeper at {addr}: {e}"))
}

async fn backend_at(addr: &str, test: &str, session: Duration) -> ZookeeperBackend {
    backend_rooted(addr, &root(test), session).await
}

async fn backend_rooted(addr: &str, root: &str, session: Duration) -> ZookeeperBackend {
    ZookeeperBackend::connect_with(
        &format!("zk://{addr}"),
        ZookeeperOptions::default()
            .root(root)
            .session_timeout(session),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot reach ZooKeeper at {addr}: {e}"))
}

async fn raw(addr: &str) -> zk::Client {
    tokio::time::timeout(Duration::from_secs(10), zk::Client::connect(addr))
        .await
        .unwrap_or_else(|_| panic!("no ZooKeeper session at {addr} within 10 s"))
        .unwrap_or_else(|e| panic!("cannot reach ZooKeeper at {addr}: {e}"))
}

/// The lock nodes (ephemeral) anywhere under `path`.
async fn lock_nodes(client: &zk::Client, path: &str) -> Vec<String> {
    common::zk_lock_nodes(client, path.to_owned()).await
}

/// Waits until `path` has exactly `n` lock nodes under it (nodes are created
/// and deleted asynchronously by waiters and cancellations).
async fn settle(client: &zk::Client, path: &str, n: usize) {
    for _ in 0..250 {
        if lock_nodes(client, path).await.len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "expected {n} lock nodes under {path}, found {:?}",
        lock_nodes(client, path).await
    );
}

/// Asks the server a four-letter word; an error if it does not answer
/// within two seconds.
fn try_four_letter(addr: &str, word: &str) -> std::io::Result<String> {
    let addr: std::net::SocketAddr = addr.parse().expect("a host:port address");
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(word.as_bytes())?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// The server's answer to a four-letter word. Fails the test if the server
/// does not answer, answers nothing, or refuses the word: a check built on
/// the answer would otherwise pass unchecked.
fn four_letter(addr: &str, word: &str) -> String {
    let how = "start ZooKeeper as scripts/test-all.sh does (4lw.commands.whitelist=* in zoo.cfg) \
               and set TOWER_LOCK_ZK_ADDR";
    let out = try_four_letter(addr, word).unwrap_or_else(|e| {
        panic!("ZooKeeper at {addr} did not answer the four-letter word {word:?}: {e}; {how}")
    });
    assert!(
        !out.is_empty(),
        "ZooKeeper at {addr} closed the connection without answering {word:?}; {how}"
    );
    assert!(
        !out.contains("is not executed"),
        "ZooKeeper at {addr} refused {word:?} ({}); {how}",
        out.trim()
    );
    out
}

/// The watched paths under `dir`, from `wchp` (path → sessions).
fn watched_under(addr: &str, dir: &str) -> Vec<String> {
    let out = four_letter(addr, "wchp");
    out.lines()
        .filter(|l| l.starts_with(&format!("{dir}/")))
        .map(str::to_owned)
        .collect()
}

// ---- other processes -------------------------------------------------------

/// Runs this test binary's `child_entry` as another OS process.
fn child(role: &str, test: &str, extra: &[(&str, String)]) -> common::KillOnDrop {
    let mut env = vec![
        ("TOWER_LOCK_CHILD_ROOT", root(test)),
        ("TOWER_LOCK_ZK_ADDR", zk_addr()),
    ];
    env.extend(extra.iter().cloned());
    common::spawn_child(role, &env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_between_processes() {
    common::two_processes_exclude(|log| {
        child(
            "worker",
            "processes",
            &[("TOWER_LOCK_CHILD_LOG", log.to_owned())],
        )
    });
}

#[tokio::test]
async fn a_release_reaches_the_server_when_the_process_exits_right_after() {
    let zk = backend("exit").await;
    for how in ["await", "drop_flush"] {
        let mut c = child("release_and_exit", "exit", &[("HOW", how.into())]);
        common::expect_word(&mut BufReader::new(c.0.stdout.take().unwrap()), "held");
        assert!(c.0.wait().unwrap().success());
        // A lost delete would keep the node for the child's whole session.
        let g = zk.lock("exit").wait(Duration::from_secs(5)).await;
        g.unwrap_or_else(|e| panic!("{how}: the child's release was lost: {e}"))
            .release()
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_replaced_after_its_session_times_out() {
    let mut holder = child("holder", "killed", &[]);
    let mut out = BufReader::new(holder.0.stdout.take().unwrap());
    common::expect_word(&mut out, "held");
    let zk = backend("killed").await;
    assert!(matches!(
        zk.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let killed_at = Instant::now();
    holder.0.kill().unwrap();
    holder.0.wait().unwrap();
    // The child's session timeout is one second; the server expires it and
    // deletes its node, which wakes us.
    let g = zk.lock("k").wait(Duration::from_secs(15)).await.unwrap();
    assert!(
        killed_at.elapsed() >= Duration::from_millis(500),
        "taken before the session ended"
    );
    g.release().await.unwrap();
}

#[tokio::test]
#[ignore = "run as a child process by the tests above"]
async fn child_entry() {
    let Ok(role) = std::env::var("TOWER_LOCK_CHILD") else {
        return;
    };
    let root = std::env::var("TOWER_LOCK_CHILD_ROOT").unwrap();
    match role.as_str() {
        "worker" => {
            let zk = backend_rooted(&zk_addr(), &root, Duration::from_secs(4)).await;
            let log = std::env::var("TOWER_LOCK_CHILD_LOG").unwrap();
            common::worker_child(&zk, "shared", &log).await;
        }
        "holder" => {
            let zk = backend_rooted(&zk_addr(), &root, Duration::from_secs(1)).await;
            let g = zk.lock("k").await.unwrap();
            println!("held");
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(g);
        }
        "release_and_exit" => {
            // A session that outlives this process by far: a delete that is
            // never written leaves the node that long.
            let zk = backend_rooted(&zk_addr(), &root, Duration::from_secs(20)).await;
            let g = zk.lock("exit").await.unwrap();
            println!("held");
            std::io::stdout().flush().unwrap();
            match std::env::var("HOW").unwrap().as_str() {
                "await" => g.release().await.unwrap(),
                "drop_flush" => {
                    drop(g);
                    zk.flush().await;
                }
                _ => drop(g),
            }
            // At once, without the runtime's orderly shutdown.
            std::process::exit(0);
        }
        other => panic!("unknown child role {other}"),
    }
}
