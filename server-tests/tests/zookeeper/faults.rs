//! Server faults on servers of the tests' own: pauses, restarts,
//! one-way partitions.

use super::*;

/// A ZooKeeper server of the test's own (`tower_lock_servers`), on a free
/// port, stopped when dropped: the fault tests pause and restart it.
struct ZkServer {
    addr: String,
    inner: tower_lock_servers::Server,
    dir: PathBuf,
}

impl ZkServer {
    fn start(name: &str) -> ZkServer {
        let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("zk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        let inner = tower_lock_servers::Server::start(tower_lock_servers::Kind::ZooKeeper, &work, name)
            .unwrap_or_else(|e| {
                panic!("cannot start ZooKeeper ({e}): install Debian's zookeeper (scripts/test-all.sh does)")
            });
        ZkServer {
            addr: inner.addr.to_string(),
            inner,
            dir: work,
        }
    }

    /// Kills the server and starts it again on the same port and data.
    fn restart(&mut self) {
        self.inner.kill();
        self.inner.restart().unwrap_or_else(|e| {
            panic!(
                "ZooKeeper did not start again: {e}\n{}",
                common::log_tails(&self.dir)
            )
        });
    }

    fn signal(&self, sig: &str) {
        self.inner.signal(sig);
    }
}

impl Drop for ZkServer {
    fn drop(&mut self) {
        // Stopped before its files go.
        self.inner.signal("CONT");
        self.inner.kill();
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
            move |_req: http::Request<axum::body::Body>| {
                let flag = Flag(aborted.clone());
                let held = HeldLock::current().expect("called by the layer");
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
    let first_token = stat.czxid as u64
        * u64::from(tower_lock::backend::zookeeper::ZookeeperBackend::TOKEN_SPACING);

    // The next holder, on a session of its own, already waits.
    let other = backend_rooted(&server.addr, "/paused", Duration::from_secs(10)).await;
    let next = tokio::spawn(async move {
        let g = other.lock("42").wait(Duration::from_secs(20)).await;
        (Instant::now(), g)
    });
    settle(&client, "/paused/42", 2).await;
    drop(client);

    server.signal("STOP");
    // The server heard nothing from the holder after this, and can expire
    // its session a session timeout later at the earliest. It runs again
    // past that, expires the session if the holder is silent, and may then
    // give the lock to the waiting client.
    let stopped = Instant::now();
    eprintln!("paused: server stopped");
    tokio::time::sleep_until((stopped + SESSION * 3 / 2).into()).await;
    server.signal("CONT");
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
    let before = server.inner.pid();
    server.restart();
    assert_ne!(server.inner.pid(), before);
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
