//! The ZooKeeper backend against a real ZooKeeper server, Curator and kazoo.
//! `scripts/test-all.sh` starts the server and sets `TOWER_LOCK_ZK_ADDR`;
//! the fault tests start servers of their own so they can pause them. Run
//! without it, every test here fails and says how to start one.
//!
//! Cargo.toml's dev-dependency on this crate turns the `zookeeper` feature
//! on for every test build, plain `cargo test` included, so these tests are
//! always built: they are never skipped by a feature set.

#[cfg(not(feature = "zookeeper"))]
compile_error!(
    "tests/zookeeper.rs needs the `zookeeper` feature (Cargo.toml's self dev-dependency \
     enables it); run scripts/test-all.sh, or `cargo test --all-features` with the server it starts"
);

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::fault_proxy::{Fault as ProxyFault, FaultProxy};
use tower_lock::backend::{CohortOptions, ZookeeperBackend, ZookeeperOptions};
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

/// The lock nodes (ephemeral) anywhere under `path`; none if `path` does
/// not exist. Any other error fails the test.
async fn lock_nodes(client: &zk::Client, path: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut todo = vec![path.to_owned()];
    while let Some(p) = todo.pop() {
        let (children, stat) = match client.get_children(&p).await {
            Ok(listing) => listing,
            // Gone meanwhile (a released node, a reaped parent).
            Err(zk::Error::NoNode) => continue,
            Err(e) => panic!("listing {p}: {e}"),
        };
        if stat.ephemeral_owner != 0 {
            found.push(p.clone());
        }
        todo.extend(children.into_iter().map(|c| format!("{p}/{c}")));
    }
    found
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_under_contention_with_increasing_tokens() {
    // Two backends: two sessions, as two replicas would have.
    let (a, b) = (backend("contention").await, backend("contention").await);
    common::excludes_with_increasing_tokens(&[a, b], "hot", 8, 10).await;
    let client = raw(&zk_addr()).await;
    assert_eq!(
        lock_nodes(&client, &root("contention")).await,
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_passes_to_local_waiters_with_one_node_per_bound() {
    let addr = zk_addr();
    let b = ZookeeperBackend::connect_with(
        &format!("zk://{addr}"),
        ZookeeperOptions::default().root(root("cohort")).cohort(
            CohortOptions::default()
                .max_grants(8)
                .max_hold(Duration::from_secs(60)),
        ),
    )
    .await
    .unwrap();
    let first = b.lock("k").await.unwrap();
    let tokens = Arc::new(Mutex::new(vec![first.token().get()]));
    let waiters: Vec<_> = (0..16)
        .map(|_| {
            let (b, tokens) = (b.clone(), tokens.clone());
            tokio::spawn(async move {
                let g = b.lock("k").wait(Duration::from_secs(10)).await.unwrap();
                tokens.lock().unwrap().push(g.token().get());
                g.release().await.unwrap();
            })
        })
        .collect();
    // Every waiter queues in this process, behind the holder, not on the
    // server.
    let client = raw(&addr).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(lock_nodes(&client, &root("cohort")).await.len(), 1);
    first.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    // 17 grants from three nodes: each node's token is its zxid times the
    // spacing, and the holders it served took the next ones.
    let spacing = u64::from(tower_lock::backend::zookeeper::TOKEN_SPACING);
    let tokens = tokens.lock().unwrap().clone();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    let mut nodes: Vec<u64> = tokens.iter().map(|t| t / spacing).collect();
    nodes.dedup();
    assert_eq!(nodes.len(), 3, "{tokens:?}");
    for node in nodes {
        let served: Vec<u64> = tokens
            .iter()
            .filter(|t| *t / spacing == node)
            .copied()
            .collect();
        let first = node * spacing;
        assert_eq!(
            served,
            (first..first + served.len() as u64).collect::<Vec<_>>()
        );
    }
    settle(&client, &root("cohort"), 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_with_queues_of_their_own_take_turns() {
    let (a, b) = (backend("turns").await, backend("turns").await);
    let counts = common::take_turns(&a, &b, "k", Duration::from_millis(1500)).await;
    common::assert_neither_starved(counts);
    settle(&raw(&zk_addr()).await, &root("turns"), 0).await;
}

#[tokio::test]
async fn a_request_reenters_its_own_lock() {
    common::reenters_under_the_layer(backend("reentry").await).await;
}

#[tokio::test]
async fn nodes_are_named_as_curator_names_them() {
    let zk = backend("layout").await;
    let client = raw(&zk_addr()).await;
    let dir = format!("{}/order:42", root("layout"));
    assert_eq!(zk.lock_path(&LockKey::new("order:42").unwrap()), dir);
    let g = zk.lock("order:42").await.unwrap();
    let (children, _) = client.get_children(&dir).await.unwrap();
    assert_eq!(children.len(), 1);
    let name = &children[0];
    // _c_<uuid>-lock-<10 digits>
    let rest = name.strip_prefix("_c_").expect(name);
    let (uuid, seq) = rest.split_at(36);
    assert_eq!(uuid.matches('-').count(), 4, "{name}");
    assert!(
        seq.strip_prefix("-lock-").is_some_and(|s| s.len() == 10),
        "{name}"
    );
    // The fencing token is the node's creation zxid, spaced for the
    // holders a cohort may pass the lock to.
    let (_, stat) = client.get_data(&format!("{dir}/{name}")).await.unwrap();
    let spacing = u64::from(tower_lock::backend::zookeeper::TOKEN_SPACING);
    assert_eq!(g.token().get(), stat.czxid as u64 * spacing);
    assert_ne!(stat.ephemeral_owner, 0);
    // The parent is a container node, reaped by the server once empty.
    // The release is sent, not awaited: another session sees it shortly.
    g.release().await.unwrap();
    settle(&client, &dir, 0).await;

    // Keys ZooKeeper could not take as names are encoded, one-to-one.
    let odd = LockKey::new("50%\u{e000}").unwrap();
    let g = zk.lock(odd.clone()).await.unwrap();
    let encoded = format!("{}/50%25%EE%80%80", root("layout"));
    assert_eq!(zk.lock_path(&odd), encoded);
    assert_eq!(client.get_children(&encoded).await.unwrap().0.len(), 1);
    g.release().await.unwrap();
    // `..` inside a name is a name like any other to ZooKeeper.
    let dots = LockKey::new("x..y").unwrap();
    let g = zk.lock(dots.clone()).await.unwrap();
    assert_eq!(zk.lock_path(&dots), format!("{}/x..y", root("layout")));
    assert_eq!(
        client
            .get_children(&zk.lock_path(&dots))
            .await
            .unwrap()
            .0
            .len(),
        1
    );
    g.release().await.unwrap();
    // Names the core refuses never get here.
    for bad in ["a/b", "..", "."] {
        assert!(
            matches!(zk.lock(bad).await, Err(LockError::InvalidKey(_))),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order_each_watching_one_node() {
    let addr = zk_addr();
    let holder_side = plain_backend("fifo").await;
    let waiter_side = plain_backend("fifo").await;
    let client = raw(&addr).await;
    let dir = format!("{}/k", root("fifo"));
    let holder = holder_side.lock("k").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..5 {
        let (zk, order) = (waiter_side.clone(), order.clone());
        waiters.push(tokio::spawn(async move {
            let g = zk.lock("k").wait(Duration::from_secs(30)).await.unwrap();
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(5)).await;
            g.release().await.unwrap();
        }));
        // Queue in a known order.
        settle(&client, &dir, i + 2).await;
    }
    // No herd: five waiters, five watches, each on a different node.
    let mut watched = Vec::new();
    for _ in 0..100 {
        watched = watched_under(&addr, &dir);
        if watched.len() == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(watched.len(), 5, "watches under {dir}: {watched:?}");
    holder.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
    settle(&client, &dir, 0).await;
    assert!(watched_under(&addr, &dir).is_empty());
}

#[tokio::test]
async fn cancelled_and_failed_fast_acquires_leave_no_node_or_watch() {
    let addr = zk_addr();
    let zk = plain_backend("cancel").await;
    let client = raw(&addr).await;
    let dir = format!("{}/k", root("cancel"));
    let holder = zk.lock("k").await.unwrap();
    assert!(matches!(
        zk.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    assert_eq!(lock_nodes(&client, &dir).await.len(), 1);
    // What a waiter looks like from the server: one node, one watch. The
    // checks below that none is left would pass unchecked otherwise.
    let waiter = {
        let zk = zk.clone();
        tokio::spawn(async move { zk.lock("k").wait(Duration::from_secs(30)).await })
    };
    let mut watched = Vec::new();
    for _ in 0..100 {
        watched = watched_under(&addr, &dir);
        if !watched.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        watched.len(),
        1,
        "a waiter's watch under {dir}: {watched:?}"
    );
    assert_eq!(lock_nodes(&client, &dir).await.len(), 2);
    waiter.abort();
    let _ = waiter.await;
    let timed_out = zk.lock("k").wait(Duration::from_millis(200)).await;
    assert!(
        matches!(timed_out, Err(LockError::Timeout { .. })),
        "{timed_out:?}"
    );
    // Dropped at every stage: before the create is answered, while waiting.
    for delay_ms in [0, 1, 3, 10, 50] {
        let attempt = zk.lock("k");
        let _ = tokio::time::timeout(Duration::from_millis(delay_ms), attempt).await;
    }
    settle(&client, &dir, 1).await;
    for _ in 0..100 {
        if watched_under(&addr, &dir).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(watched_under(&addr, &dir), Vec::<String>::new());
    holder.release().await.unwrap();
    settle(&client, &dir, 0).await;
    // A dropped guard releases too.
    drop(zk.lock("k").await.unwrap());
    settle(&client, &dir, 0).await;
}

#[tokio::test]
async fn readers_share_writers_exclude_and_semaphores_count() {
    let zk = plain_backend("rw").await;
    let other = plain_backend("rw").await;
    let r1 = zk.lock("doc").mode(LockMode::Read).await.unwrap();
    let r2 = other
        .lock("doc")
        .mode(LockMode::Read)
        .fail_fast()
        .await
        .unwrap();
    let w = other.lock("doc").mode(LockMode::Write).fail_fast().await;
    assert!(matches!(w, Err(LockError::Busy)));
    let writer = {
        let other = other.clone();
        tokio::spawn(async move {
            other
                .lock("doc")
                .mode(LockMode::Write)
                .wait(Duration::from_secs(10))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A reader arriving after a queued writer waits for it (no starvation).
    assert!(matches!(
        zk.lock("doc").mode(LockMode::Read).fail_fast().await,
        Err(LockError::Busy)
    ));
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let w = writer.await.unwrap().unwrap();
    assert!(matches!(
        zk.lock("doc").mode(LockMode::Read).fail_fast().await,
        Err(LockError::Busy)
    ));
    w.release().await.unwrap();

    let sem = LockMode::Semaphore { permits: 2 };
    let a = zk.lock("pool").mode(sem).await.unwrap();
    let b = other.lock("pool").mode(sem).await.unwrap();
    assert!(matches!(
        zk.lock("pool").mode(sem).fail_fast().await,
        Err(LockError::Busy)
    ));
    let third = {
        let zk = zk.clone();
        tokio::spawn(async move {
            zk.lock("pool")
                .mode(sem)
                .wait(Duration::from_secs(10))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!third.is_finished());
    a.release().await.unwrap();
    let c = third.await.unwrap().unwrap();
    b.release().await.unwrap();
    c.release().await.unwrap();
    let client = raw(&zk_addr()).await;
    settle(&client, &root("rw"), 0).await;
}

#[tokio::test]
async fn several_keys_at_once() {
    let zk = backend("multi").await;
    let set = zk.lock_all(["a", "b", "c"]).await.unwrap();
    assert!(matches!(
        zk.lock("b").fail_fast().await,
        Err(LockError::Busy)
    ));
    set.release().await.unwrap();
    zk.lock("b")
        .fail_fast()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[tokio::test]
async fn an_unreachable_server_is_a_clear_error_within_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let e = ZookeeperBackend::connect_with(
        &format!("zk://127.0.0.1:{port}"),
        ZookeeperOptions::default().connect_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(ZookeeperBackend::connect("zk://127.0.0.1:1/")
        .await
        .is_err());
    assert!(matches!(
        ZookeeperBackend::connect("zk://127.0.0.1:2181/zookeeper").await,
        Err(LockError::Config(_))
    ));
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

// ---- Curator and kazoo -----------------------------------------------------

/// Curator's jars from Debian's libcurator-recipes-java, and the interop
/// program compiled against them (once per test run).
fn curator_classpath() -> &'static str {
    static CP: OnceLock<String> = OnceLock::new();
    CP.get_or_init(|| {
        let jars = [
            "curator-client", "curator-framework", "curator-recipes", "zookeeper",
            "zookeeper-jute", "guava", "slf4j-api", "slf4j-nop",
        ];
        let mut cp: Vec<String> = Vec::new();
        for jar in jars {
            let path = format!("/usr/share/java/{jar}.jar");
            assert!(
                std::path::Path::new(&path).exists(),
                "{path} is missing: install Debian's libcurator-recipes-java (scripts/test-all.sh does)"
            );
            cp.push(path);
        }
        let out: PathBuf = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("curator-interop");
        std::fs::create_dir_all(&out).unwrap();
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/interop/CuratorLock.java");
        let status = Command::new("javac")
            .args(["-d", &out.display().to_string(), "-cp", &cp.join(":"), source])
            .status()
            .expect("javac not found: install a JDK (default-jdk-headless)");
        assert!(status.success(), "compiling {source} failed");
        cp.insert(0, out.display().to_string());
        cp.join(":")
    })
}

/// A foreign client process holding or trying a lock.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Peer {
    fn curator(path: &str, recipe: &str, action: &[&str]) -> Peer {
        let mut cmd = Command::new("java");
        cmd.args([
            "-cp",
            curator_classpath(),
            "CuratorLock",
            &zk_addr(),
            path,
            recipe,
        ]);
        cmd.args(action);
        Self::spawn(cmd)
    }

    fn kazoo(path: &str, action: &[&str]) -> Peer {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/interop/kazoo_lock.py");
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.args([script, &zk_addr(), path]);
        cmd.args(action);
        Self::spawn(cmd)
    }

    fn spawn(mut cmd: Command) -> Peer {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect(
                "cannot start the peer (java / python3-kazoo; scripts/test-all.sh installs them)",
            );
        Peer {
            stdin: child.stdin.take(),
            out: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    /// The peer's next word on its own line.
    fn says(&mut self) -> String {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    /// Tells a holding peer to release, and waits for it.
    fn release(mut self) {
        writeln!(self.stdin.take().unwrap()).unwrap();
        assert_eq!(self.says(), "released");
        assert!(self.child.wait().unwrap().success());
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `(peer, recipe)`: Curator holds, we wait; then we hold, Curator waits.
async fn interop_both_ways(test: &str, ours: LockMode, recipe: &str) {
    let zk = backend(test).await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());

    let mut theirs = Peer::curator(&path, recipe, &["hold"]);
    assert_eq!(theirs.says(), "held");
    assert!(matches!(
        zk.lock("k").mode(ours).fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let zk = zk.clone();
        tokio::spawn(async move { zk.lock("k").mode(ours).wait(Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "acquired while Curator held {recipe}"
    );
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
    let g = waiting.await.unwrap().unwrap();

    let mut peer = Peer::curator(&path, recipe, &["try", "300"]);
    assert_eq!(
        peer.says(),
        "timeout",
        "Curator's {recipe} ignored our lock"
    );
    g.release().await.unwrap();
    let mut peer2 = Peer::curator(&path, recipe, &["try", "5000"]);
    assert_eq!(peer2.says(), "acquired");
    peer.child.wait().unwrap();
    peer2.child.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_mutex_interoperates_both_ways() {
    interop_both_ways("curator-mutex", LockMode::Exclusive, "mutex").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_read_write_lock_interoperates() {
    interop_both_ways("curator-write", LockMode::Write, "write").await;
    // Readers share with Curator's readers; a Curator writer waits for ours.
    let zk = backend("curator-read").await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());
    let theirs = Peer::curator(&path, "read", &["hold"]);
    let mut theirs = theirs;
    assert_eq!(theirs.says(), "held");
    let r = zk.lock("k").mode(LockMode::Read).fail_fast().await.unwrap();
    assert!(matches!(
        zk.lock("k").mode(LockMode::Write).fail_fast().await,
        Err(LockError::Busy)
    ));
    let mut writer = Peer::curator(&path, "write", &["try", "300"]);
    assert_eq!(writer.says(), "timeout");
    writer.child.wait().unwrap();
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
    r.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_semaphore_v2_counts_our_leases() {
    let zk = backend("curator-sem").await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());
    let sem = LockMode::Semaphore { permits: 2 };
    let mut theirs = Peer::curator(&path, "semaphore:2", &["hold"]);
    assert_eq!(theirs.says(), "held");
    let ours = zk.lock("k").mode(sem).fail_fast().await.unwrap();
    assert!(matches!(
        zk.lock("k").mode(sem).fail_fast().await,
        Err(LockError::Busy)
    ));
    let mut third = Peer::curator(&path, "semaphore:2", &["try", "300"]);
    assert_eq!(third.says(), "timeout");
    third.child.wait().unwrap();
    ours.release().await.unwrap();
    let mut third = Peer::curator(&path, "semaphore:2", &["try", "5000"]);
    assert_eq!(third.says(), "acquired");
    third.child.wait().unwrap();
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kazoo_locks_coexist_on_the_same_path() {
    let zk = backend("kazoo").await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());
    let mut theirs = Peer::kazoo(&path, &["hold"]);
    assert_eq!(theirs.says(), "held");
    assert!(matches!(
        zk.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let zk = zk.clone();
        tokio::spawn(async move { zk.lock("k").wait(Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished());
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
    let g = waiting.await.unwrap().unwrap();
    let mut peer = Peer::kazoo(&path, &["try", "300"]);
    assert_eq!(peer.says(), "timeout", "kazoo ignored our lock");
    peer.child.wait().unwrap();
    g.release().await.unwrap();
    let mut peer = Peer::kazoo(&path, &["try", "5000"]);
    assert_eq!(peer.says(), "acquired");
    peer.child.wait().unwrap();
}

// ---- server faults ---------------------------------------------------------

/// A ZooKeeper server of the test's own, on a free port, stopped when
/// dropped: the fault tests pause and restart it.
struct ZkServer {
    addr: String,
    child: Child,
    dir: PathBuf,
}

impl ZkServer {
    fn start(name: &str) -> ZkServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("zk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        std::fs::write(
            dir.join("zoo.cfg"),
            format!(
                "tickTime=200\nminSessionTimeout=400\nmaxSessionTimeout=60000\ndataDir={}\n\
                 clientPort={port}\nclientPortAddress=127.0.0.1\nadmin.enableServer=false\n\
                 4lw.commands.whitelist=*\n",
                dir.join("data").display()
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{port}");
        let child = Self::launch(&dir);
        let server = ZkServer { addr, child, dir };
        server.wait_ready();
        server
    }

    /// Runs the server on the configuration in `dir`. Empty container
    /// parents are reaped every half second rather than every minute.
    fn launch(dir: &std::path::Path) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("zookeeper.log"))
            .unwrap();
        Command::new("java")
            .arg(format!("-Dzookeeper.log.dir={}", dir.display()))
            .arg("-Dznode.container.checkIntervalMs=500")
            .args(["-cp", "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar"])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(dir.join("zoo.cfg"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("cannot start java: install Debian's zookeeper (scripts/test-all.sh does)")
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if try_four_letter(&self.addr, "isro").is_ok_and(|a| a == "rw") {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "ZooKeeper did not start; see {}",
            self.dir.join("zookeeper.log").display()
        );
    }

    /// Kills the server and starts it again on the same port and data.
    fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::launch(&self.dir);
        self.wait_ready();
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status();
        assert!(status.is_ok_and(|s| s.success()), "kill {sig} failed");
    }
}

impl Drop for ZkServer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The session timeout the paused holder asks for, which the test servers
/// (tick 200 ms, at least 400 ms) grant as it is.
const SESSION: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_paused_past_the_session_timeout_aborts_the_holder_before_anyone_else_is_granted()
{
    use tower::ServiceExt;
    use tower_lock::{Header, HeldLock, LockLayer};

    let server = ZkServer::start("paused");
    eprintln!("paused: server up at {}", server.addr);
    let zk = backend_rooted(&server.addr, "/paused", SESSION).await;
    let client = raw(&server.addr).await;

    // A handler that never finishes on its own, and says when it is
    // dropped; it notes when its lock's lost signal fires.
    struct Flag(Arc<AtomicUsize>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let aborted = Arc::new(AtomicUsize::new(0));
    let lost_at = Arc::new(Mutex::new(None::<Instant>));
    let svc = tower::ServiceBuilder::new()
        .layer(LockLayer::new(zk.clone(), Header::new("x-order")))
        .service_fn({
            let (aborted, lost_at) = (aborted.clone(), lost_at.clone());
            move |req: http::Request<axum::body::Body>| {
                let flag = Flag(aborted.clone());
                let held = req.extensions().get::<HeldLock>().cloned().unwrap();
                let lost_at = lost_at.clone();
                tokio::spawn(async move {
                    held.lost().await;
                    *lost_at.lock().unwrap() = Some(Instant::now());
                });
                async move {
                    let _flag = flag;
                    std::future::pending::<()>().await;
                    Ok::<_, std::convert::Infallible>(
                        http::Response::new(axum::body::Body::empty()),
                    )
                }
            }
        });
    let request = http::Request::builder()
        .header("x-order", "42")
        .body(axum::body::Body::empty())
        .unwrap();
    let response = tokio::spawn(async move {
        let r = svc.oneshot(request).await;
        (Instant::now(), r)
    });
    settle(&client, "/paused/42", 1).await;
    let (children, _) = client.get_children("/paused/42").await.unwrap();
    let (_, stat) = client
        .get_data(&format!("/paused/42/{}", children[0]))
        .await
        .unwrap();
    let first_token = stat.czxid as u64 * u64::from(tower_lock::backend::zookeeper::TOKEN_SPACING);

    // The next holder, on a session of its own, already waits.
    let other = backend_rooted(&server.addr, "/paused", Duration::from_secs(10)).await;
    let next = tokio::spawn(async move {
        let g = other.lock("42").wait(Duration::from_secs(20)).await;
        (Instant::now(), g)
    });
    settle(&client, "/paused/42", 2).await;
    drop(client);

    server.signal("-STOP");
    // The server heard nothing from the holder after this, and can expire
    // its session a session timeout later at the earliest. It runs again
    // past that, expires the session if the holder is silent, and may then
    // give the lock to the waiting client.
    let stopped = Instant::now();
    eprintln!("paused: server stopped");
    tokio::time::sleep_until((stopped + SESSION * 3 / 2).into()).await;
    server.signal("-CONT");
    eprintln!("paused: server resumed");
    let (answered, response) = tokio::time::timeout(4 * SESSION, response)
        .await
        .expect("the holder was not told it lost its lock within four session timeouts")
        .unwrap();
    let response = response.unwrap();
    let lost = lost_at.lock().unwrap().expect("lost() never completed");
    let (granted, g) = tokio::time::timeout(20 * SESSION, next)
        .await
        .expect("the waiting client was never granted the lock")
        .unwrap();
    let g = g.unwrap();
    eprintln!(
        "paused: told {:?}, aborted {:?} and the next holder granted {:?} after the server stopped",
        lost - stopped,
        answered - stopped,
        granted - stopped
    );
    assert!(
        lost < granted,
        "the next holder was granted the lock {:?} before the old one was told",
        lost - granted
    );
    assert_eq!(response.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        aborted.load(Ordering::SeqCst),
        1,
        "the handler was not aborted"
    );
    assert!(
        answered < stopped + SESSION,
        "the handler was aborted {:?} after the server stopped, past the {SESSION:?} session",
        answered - stopped
    );
    assert!(g.token().get() > first_token);
    g.release().await.unwrap();
    let again = zk.lock("42").wait(Duration::from_secs(20)).await.unwrap();
    assert!(!again.is_lost());
    again.release().await.unwrap();
}

/// Tokens are creation zxids: they keep rising when a key's container
/// parent is reaped (and its sequence numbers start again from zero) and
/// when the server restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_rising_across_reaped_parents_and_server_restarts() {
    let mut server = ZkServer::start("tokens");
    let zk = backend_rooted(&server.addr, "/tokens", Duration::from_secs(4)).await;
    let dir = "/tokens/k";
    let mut last = 0;
    // Locks `k` three times, each token above the one before; the last
    // token and the name of the first node.
    let take = |zk: ZookeeperBackend, addr: String, mut last: u64| async move {
        let client = raw(&addr).await;
        let mut first = None;
        for _ in 0..3 {
            let g = zk.lock("k").await.unwrap();
            assert!(g.token().get() > last, "token {} after {last}", g.token());
            last = g.token().get();
            let name = client.get_children(dir).await.unwrap().0.remove(0);
            first.get_or_insert(name);
            g.release().await.unwrap();
        }
        (last, first.unwrap())
    };
    let (t, _) = take(zk.clone(), server.addr.clone(), last).await;
    last = t;

    // The emptied parent is reaped; the next node's sequence restarts.
    let client = raw(&server.addr).await;
    let mut reaped = false;
    for _ in 0..100 {
        if client.check_stat(dir).await.unwrap().is_none() {
            reaped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reaped, "the server never reaped the empty parent {dir}");
    drop(client);
    let (t, name) = take(zk.clone(), server.addr.clone(), last).await;
    assert!(
        name.ends_with("-lock-0000000000"),
        "{name}: the sequence did not start again"
    );
    last = t;

    // A restart: a new server process on the same data.
    let before = server.child.id();
    server.restart();
    assert_ne!(server.child.id(), before);
    let zk = backend_rooted(&server.addr, "/tokens", Duration::from_secs(4)).await;
    let (t, _) = take(zk, server.addr.clone(), last).await;
    assert!(t > last);
}

/// A one-way partition: the holder's requests no longer reach the server,
/// while the server's watch notifications still reach the holder. It must be
/// told its lock is lost before anyone else is granted it (the server
/// expires a session from what it received; notifications say nothing about
/// that). The holder's session also waits on other keys, so notifications keep
/// arriving after its requests stop getting through: the case an outside
/// test found told lost about 2 s after another process took the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_way_partition_tells_the_holder_before_anyone_else_is_granted() {
    let server: std::net::SocketAddr = zk_addr().parse().expect("TOWER_LOCK_ZK_ADDR host:port");
    let proxy = FaultProxy::start(server).await.expect("proxy");
    let root = root("one-way-partition");
    let session = Duration::from_secs(2);
    let holder = backend_rooted(&proxy.addr().to_string(), &root, session).await;
    let other = backend_rooted(&server.to_string(), &root, Duration::from_secs(10)).await;

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
    proxy.set(ProxyFault::FreezeUp).await;
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

    proxy.heal().await;
    drop(held);
    for w in waiting {
        w.abort();
    }
    guard.release().await.expect("release");
    other.flush().await;
    holder.flush().await;
}
