//! ZooKeeper under a one-way partition, through the torture harness's fault
//! proxy: a holder whose requests no longer reach the server, while the
//! server's watch notifications still reach it, must be told its lock is lost
//! before anyone else is granted it. (The server expires a session from what
//! it last received; notifications say nothing about that.)
#![cfg(feature = "zookeeper")]

#[path = "../examples/torture/fault_proxy.rs"]
mod fault_proxy;

use std::time::{Duration, Instant};

use fault_proxy::{Fault, FaultProxy};
use tower_lock::backend::{ZookeeperBackend, ZookeeperOptions};
use tower_lock::{Backend, BackendExt, Wait};

fn zk_addr() -> String {
    std::env::var("TOWER_LOCK_ZK_ADDR").unwrap_or_else(|_| {
        panic!(
            "TOWER_LOCK_ZK_ADDR is not set. Run scripts/test-all.sh, which starts a ZooKeeper \
             server, or start one (see scripts/test-all.sh for its zoo.cfg) and set \
             TOWER_LOCK_ZK_ADDR=127.0.0.1:PORT"
        )
    })
}

async fn backend(addr: &str, root: &str, session: Duration) -> ZookeeperBackend {
    ZookeeperBackend::connect_with(
        &format!("zk://{addr}"),
        ZookeeperOptions::default()
            .root(root)
            .session_timeout(session),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot reach ZooKeeper at {addr}: {e}"))
}

/// The holder's session also waits on other keys, so notifications keep
/// arriving after its requests stop getting through: the case an outside
/// test found told lost about 2 s after another process took the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_way_partition_tells_the_holder_before_anyone_else_is_granted() {
    let server: std::net::SocketAddr = zk_addr().parse().expect("TOWER_LOCK_ZK_ADDR host:port");
    let proxy = FaultProxy::start(server).await.expect("proxy");
    let root = format!("/t-partition-{}", std::process::id());
    let session = Duration::from_secs(2);
    let holder = backend(&proxy.addr().to_string(), &root, session).await;
    let other = backend(&server.to_string(), &root, Duration::from_secs(10)).await;

    let held = holder.lock("order:1").await.expect("holder locks");
    // Keys the other side holds and the holder waits for: each release sends
    // the holder a notification across the partition.
    let mut blockers = Vec::new();
    for i in 0..12 {
        blockers.push(other.lock(format!("blocker:{i}")).await.expect("blocker"));
    }
    let mut waiting = Vec::new();
    for i in 0..12 {
        let holder = holder.clone();
        waiting.push(tokio::spawn(async move {
            let _ = holder
                .lock(format!("blocker:{i}"))
                .wait(Wait::Timeout(Duration::from_secs(30)))
                .await;
        }));
    }
    // Give the waiters time to set their watches.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!held.is_lost(), "lost before any fault");

    let lost = held.lost();
    let told = tokio::spawn(async move {
        lost.await;
        Instant::now()
    });
    let contender = {
        let other = other.clone();
        tokio::spawn(async move {
            let guard = other
                .lock("order:1")
                .wait(Wait::Timeout(Duration::from_secs(30)))
                .await
                .expect("the other side gets the lock once the session expires");
            (Instant::now(), guard)
        })
    };
    let frozen_at = Instant::now();
    proxy.set(Fault::FreezeUp);
    // Notifications keep flowing to the holder for twice the session.
    for blocker in blockers {
        tokio::time::sleep(session / 6).await;
        drop(blocker);
    }
    let (granted_at, guard) = tokio::time::timeout(Duration::from_secs(30), contender)
        .await
        .expect("the other side waited more than 30 s")
        .expect("contender task");
    let told_at = tokio::time::timeout(Duration::from_secs(10), told)
        .await
        .expect("the holder was never told its lock was lost")
        .expect("lost task");
    assert!(
        told_at < granted_at,
        "the holder was told {} ms after someone else was granted its lock",
        granted_at.elapsed().as_millis() as i64 - told_at.elapsed().as_millis() as i64
    );
    assert!(
        told_at.duration_since(frozen_at) < session,
        "told {} ms after the partition began, past the session timeout",
        told_at.duration_since(frozen_at).as_millis()
    );
    assert!(guard.token() > held.token(), "fencing token did not rise");

    proxy.heal();
    drop(held);
    for w in waiting {
        w.abort();
    }
    guard.release().await.expect("release");
    other.flush().await;
    holder.flush().await;
}
