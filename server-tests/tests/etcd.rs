//! The etcd backend against a real etcd server, and `etcdctl lock`.
//! `scripts/test-all.sh` starts one member and sets `TOWER_LOCK_ETCD_URL`;
//! the cluster tests start a three-member cluster of their own so they can
//! stop members. Run without it, every test here fails and says how to
//! start one.
//!
//! Every test locks under a root of its own (the test's name and this
//! process's id), and checks that it leaves no key behind.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::fault_proxy::FaultProxy;
use etcd_client::GetOptions;
use tower_lock::backend::etcd::{EtcdBackend, EtcdOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError, LockKey, LockMode, Wait};

fn etcd_url() -> String {
    std::env::var("TOWER_LOCK_ETCD_URL").unwrap_or_else(|_| {
        panic!(
            "TOWER_LOCK_ETCD_URL is not set. Run scripts/test-all.sh, which starts an etcd \
             server, or start one (Debian: apt-get install etcd-server; etcd \
             --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls \
             http://127.0.0.1:2379) and set TOWER_LOCK_ETCD_URL=etcd://127.0.0.1:2379"
        )
    })
}

/// `host:port,...` of the URL.
fn endpoints(url: &str) -> String {
    url.trim_start_matches("etcd://").to_owned()
}

/// This test's own root, so tests never see each other's keys.
fn root(test: &str) -> String {
    format!("/t-{test}-{}", std::process::id())
}

fn options(test: &str) -> EtcdOptions {
    EtcdOptions::default()
        .root(root(test))
        .lease_ttl(Duration::from_secs(4))
}

async fn backend_with(url: &str, options: EtcdOptions) -> EtcdBackend {
    EtcdBackend::connect_with(url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach etcd at {url}: {e}"))
}

async fn backend(test: &str) -> EtcdBackend {
    backend_with(&etcd_url(), options(test)).await
}

/// A backend that reaches the (first) server through a fault proxy.
async fn proxied(options: EtcdOptions) -> (FaultProxy, EtcdBackend) {
    let url = etcd_url();
    let server = endpoints(&url).split(',').next().unwrap().parse().unwrap();
    let proxy = FaultProxy::start(server).await.unwrap();
    let etcd = backend_with(&format!("etcd://{}", proxy.addr()), options).await;
    (proxy, etcd)
}

/// Every acquisition puts a key, as `etcdctl lock` does.
async fn plain_backend(test: &str) -> EtcdBackend {
    backend_with(&etcd_url(), options(test).cohort(CohortOptions::off())).await
}

async fn raw() -> etcd_client::Client {
    let url = etcd_url();
    let hosts: Vec<String> = endpoints(&url).split(',').map(str::to_owned).collect();
    etcd_client::Client::connect(hosts, None).await.unwrap()
}

/// The keys under `test`'s root.
async fn keys_under(test: &str) -> Vec<String> {
    let got = raw()
        .await
        .get(
            root(test),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    got.kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect()
}

/// Waits until no key is left under `test`'s root.
async fn settle_empty(test: &str) {
    for _ in 0..500 {
        if keys_under(test).await.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut left = Vec::new();
    for key in keys_under(test).await {
        let got = raw().await.get(key.as_str(), None).await.unwrap();
        let Some(kv) = got.kvs().first() else {
            continue;
        };
        let ttl = raw().await.lease_time_to_live(kv.lease(), None).await;
        left.push(format!(
            "{key} (lease {:x} with {:?} s to live, create revision {})",
            kv.lease(),
            ttl.map(|t| t.ttl()),
            kv.create_revision()
        ));
    }
    panic!("keys left behind: {left:?}");
}

/// The etcd backend in one mode, for the conformance suite.
struct Etcd {
    mode: &'static str,
    cohort: bool,
}

impl common::contract::Subject for Etcd {
    type Backend = EtcdBackend;

    async fn connect(&self, test: &str) -> EtcdBackend {
        let options = options(&format!("{test}-{}", self.mode))
            .label("conformance")
            .cohort(common::contract::cohort(self.cohort));
        backend_with(&etcd_url(), options).await
    }

    fn holder_identity(&self, _test: &str) -> Option<String> {
        Some(format!("conformance, pid {} on ", std::process::id()))
    }

    async fn connect_through_proxy(&self, test: &str) -> Option<(Vec<FaultProxy>, EtcdBackend)> {
        let options = options(&format!("{test}-{}", self.mode))
            .lease_ttl(Duration::from_secs(2))
            .cohort(common::contract::cohort(self.cohort));
        {
            let (proxy, backend) = proxied(options).await;
            Some((vec![proxy], backend))
        }
    }

    /// Without a cohort each waiter puts a key of its own, and etcd orders
    /// them by revision: concurrent puts of one process may land in any
    /// order.
    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        settle_empty(&format!("{test}-{}", self.mode)).await;
    }
}

mod conformance {
    mod cohort {
        crate::common::contract::conformance!(crate::Etcd {
            mode: "cohort",
            cohort: true
        });
    }
    mod one_key_per_lock {
        crate::common::contract::conformance!(crate::Etcd {
            mode: "plain",
            cohort: false
        });
    }
}

#[tokio::test]
async fn readers_share_writers_exclude_and_there_is_no_semaphore() {
    let (a, b) = (plain_backend("rw").await, plain_backend("rw").await);
    let r1 = a.lock("k").mode(LockMode::Read).await.unwrap();
    let r2 = b.lock("k").mode(LockMode::Read).fail_fast().await.unwrap();
    assert!(matches!(
        b.lock("k").mode(LockMode::Write).fail_fast().await,
        Err(LockError::Busy)
    ));
    // A writer queued behind the readers, then a reader behind the writer:
    // the reader waits for the writer (no starvation of writers).
    let writer = {
        let b = b.clone();
        tokio::spawn(async move { b.lock("k").mode(LockMode::Write).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(matches!(
        a.lock("k").mode(LockMode::Read).fail_fast().await,
        Err(LockError::Busy)
    ));
    let readers = r1.token().max(r2.token());
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let w = writer.await.unwrap().unwrap();
    assert!(w.token() > readers);
    w.release().await.unwrap();
    let e = a.lock("k").mode(LockMode::Semaphore { permits: 2 }).await;
    assert!(matches!(e, Err(LockError::InvalidMode(_))), "{e:?}");
    settle_empty("rw").await;
}

#[tokio::test]
async fn timed_out_and_cancelled_waits_leave_no_key_on_the_server() {
    let (holder, waiter) = (plain_backend("cancel").await, plain_backend("cancel").await);
    let held = holder.lock("k").await.unwrap();
    let timed_out = waiter.lock("k").wait(Duration::from_millis(300)).await;
    assert!(
        matches!(timed_out, Err(LockError::Timeout { .. })),
        "{timed_out:?}"
    );
    assert!(matches!(
        waiter.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.lock("k").wait(Wait::Forever).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    waiter.flush().await;
    assert_eq!(keys_under("cancel").await.len(), 1, "only the holder's key");
    held.release().await.unwrap();
    let again = waiter.lock("k").fail_fast().await.unwrap();
    again.release().await.unwrap();
    settle_empty("cancel").await;
}

/// Key names are reused per lease: etcd keeps every name it has seen in
/// its index until compaction, and the queue reads scan the prefix.
#[tokio::test]
async fn acquisitions_on_one_lease_reuse_key_names() {
    let etcd = plain_backend("names").await;
    let mut names = Vec::new();
    for _ in 0..3 {
        let g = etcd.lock("k").await.unwrap();
        names.extend(keys_under("names").await);
        g.release().await.unwrap();
    }
    assert_eq!(names.len(), 3);
    assert!(names.iter().all(|n| *n == names[0]), "{names:?}");
    // Two at once take two names; released, the first is used again.
    let r1 = etcd.lock("k").read().await.unwrap();
    let r2 = etcd.lock("k").read().await.unwrap();
    assert_eq!(keys_under("names").await.len(), 2);
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let g = etcd.lock("k").await.unwrap();
    assert_eq!(keys_under("names").await, names[..1]);
    g.release().await.unwrap();
    settle_empty("names").await;
}

/// A key of our own lease that no acquisition owns (a create applied after
/// the delete of a cancelled attempt) would block the lock for as long as
/// the lease lives: the next acquisition that meets it deletes it, whether
/// it has the name it is about to put or stands in the queue.
#[tokio::test]
async fn stray_keys_of_our_own_lease_are_deleted_not_waited_for() {
    let etcd = plain_backend("stray").await;
    let g = etcd.lock("k").await.unwrap();
    let name = keys_under("stray").await.pop().unwrap();
    g.release().await.unwrap();
    let lease = etcd.lease_id().unwrap();
    let prefix = name.rsplit_once('-').unwrap().0;
    let mut raw = raw().await;
    let on_lease = || Some(etcd_client::PutOptions::new().with_lease(lease));
    raw.put(name.as_str(), "left over", on_lease())
        .await
        .unwrap();
    raw.put(format!("{prefix}-7"), "left over", on_lease())
        .await
        .unwrap();
    let g = etcd
        .lock("k")
        .wait(Duration::from_secs(3))
        .await
        .expect("a stray of our own lease blocked the lock");
    assert_eq!(keys_under("stray").await, [name]);
    g.release().await.unwrap();
    settle_empty("stray").await;
}

/// Go's mutex names its key after its lease alone: a Go client that
/// unlocks and locks again puts a key of the same name, behind us. Deleted
/// and put again before our watch begins, it must not be mistaken for the
/// key we wait for. The waiter talks through a proxy with latency, so that
/// the test can act between its queue read and its watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_put_again_under_its_name_is_behind_the_waiter() {
    let (proxy, etcd) = proxied(options("reput").cohort(CohortOptions::off())).await;
    let latency = Duration::from_millis(150);
    proxy
        .set(common::fault_proxy::Fault::Latency(latency))
        .await;
    let blocker = format!("{}/go-style", etcd.lock_name(&LockKey::new("k").unwrap()));
    let mut raw = raw().await;
    raw.put(blocker.as_str(), "", None).await.unwrap();
    let waiting = tokio::spawn(async move {
        let got = etcd.lock("k").wait(Duration::from_secs(20)).await;
        (etcd, got)
    });
    // Our key reaches the server one latency after it is sent; the queue
    // read three, the watch five: put the blocker again at four.
    while keys_under("reput").await.len() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(latency * 3).await;
    raw.delete(blocker.as_str(), None).await.unwrap();
    raw.put(blocker.as_str(), "", None).await.unwrap();
    let (_etcd, got) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiter waits for a key put after its own")
        .unwrap();
    got.unwrap().release().await.unwrap();
    raw.delete(blocker.as_str(), None).await.unwrap();
    settle_empty("reput").await;
}

/// `etcdctl lock NAME`: holds until interrupted, printing its key.
fn etcdctl_lock(name: &str) -> common::KillOnDrop {
    let child = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &endpoints(&etcd_url()), "lock", name])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl (Debian: etcd-client) runs");
    common::KillOnDrop(child)
}

fn interrupt(child: &common::KillOnDrop) {
    assert!(common::signal(&child.0, "INT"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_lock_and_this_backend_exclude_each_other_both_ways() {
    let etcd = plain_backend("etcdctl").await;
    let name = etcd.lock_name(&LockKey::new("k").unwrap());
    // etcdctl first: we wait until it lets go.
    let mut theirs = etcdctl_lock(&name);
    let mut out = BufReader::new(theirs.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with(&format!("{name}/")), "{line}");
    assert!(matches!(
        etcd.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let etcd = etcd.clone();
        tokio::spawn(async move { etcd.lock("k").wait(Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());
    interrupt(&theirs);
    theirs.0.wait().unwrap();
    let ours = waiting.await.unwrap().unwrap();
    // Ours first: etcdctl waits until we let go.
    let mut theirs = etcdctl_lock(&name);
    let out = theirs.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = BufReader::new(out);
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let _ = tx.send(line);
        // Read on to the end: etcdctl prints the key's value on a second
        // line, and a closed pipe there kills it by SIGPIPE before it
        // unlocks, leaving its key for its lease's 60 s.
        let _ = std::io::copy(&mut out, &mut std::io::sink());
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(700)).is_err(),
        "etcdctl took a lock we hold"
    );
    ours.release().await.unwrap();
    let line = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(line.starts_with(&format!("{name}/")), "{line}");
    interrupt(&theirs);
    theirs.0.wait().unwrap();
    settle_empty("etcdctl").await;
}

#[tokio::test]
async fn tokens_are_create_revisions_and_rise_across_backends() {
    let (a, b) = (plain_backend("tokens").await, plain_backend("tokens").await);
    let g = a.lock("k").await.unwrap();
    let key = keys_under("tokens").await.pop().unwrap();
    let got = raw().await.get(key.as_str(), None).await.unwrap();
    let revision = got.kvs()[0].create_revision() as u64;
    assert_eq!(g.token().get(), revision * 64);
    let first = g.token();
    g.release().await.unwrap();
    let h = b.lock("k").await.unwrap();
    assert!(h.token() > first);
    h.release().await.unwrap();
    settle_empty("tokens").await;
}

#[tokio::test]
async fn a_revoked_lease_tells_the_holder_at_once() {
    let etcd = plain_backend("revoked").await;
    let held = etcd.lock("k").await.unwrap();
    let lease = etcd.lease_id().unwrap();
    raw().await.lease_revoke(lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), held.lost())
        .await
        .expect("the holder was not told");
    drop(held);
    // The next acquisition takes a new lease.
    let g = etcd.lock("k").await.unwrap();
    assert_ne!(etcd.lease_id(), Some(lease));
    g.release().await.unwrap();
    settle_empty("revoked").await;
}

#[tokio::test]
async fn bad_urls_and_an_unreachable_server_are_clear_errors_within_the_timeout() {
    for bad in [
        "etcd://127.0.0.1",
        "etcd://",
        "redis://127.0.0.1:1",
        "etcd://a:1,",
    ] {
        let e = EtcdBackend::connect(bad).await.unwrap_err();
        assert!(matches!(e, LockError::Config(_)), "{bad}: {e:?}");
    }
    let port = common::free_port();
    let started = Instant::now();
    let e = EtcdBackend::connect_with(
        &format!("etcd://127.0.0.1:{port}"),
        EtcdOptions::default().connect_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

#[tokio::test]
async fn the_lease_is_revoked_once_the_backend_and_its_locks_are_gone() {
    let etcd = backend("dropped").await;
    let g = etcd.lock("k").await.unwrap();
    let lease = etcd.lease_id().unwrap();
    // The guard outlives the backend and keeps the lease.
    drop(etcd);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(keys_under("dropped").await.len(), 1);
    drop(g);
    settle_empty("dropped").await;
    let mut client = raw().await;
    for _ in 0..500 {
        let ttl = client.lease_time_to_live(lease, None).await.unwrap();
        if ttl.ttl() <= 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the lease is still alive");
}

// ---- other processes -------------------------------------------------------

fn child(role: &str, k: &str, extra: &[(&str, String)]) -> common::KillOnDrop {
    let mut env = vec![
        ("TOWER_LOCK_CHILD_KEY", k.to_owned()),
        ("TOWER_LOCK_ETCD_URL", etcd_url()),
        // The parent's root, which holds its process id.
        ("TOWER_LOCK_CHILD_ROOT", root("child")),
    ];
    env.extend(extra.iter().cloned());
    common::spawn_child(role, &env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_between_processes() {
    common::two_processes_exclude(|log| {
        child(
            "worker",
            "shared",
            &[("TOWER_LOCK_CHILD_LOG", log.to_owned())],
        )
    });
    settle_empty("child").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_key_when_its_lease_expires() {
    let mut holder = child("holder", "k", &[]);
    let mut out = BufReader::new(holder.0.stdout.take().unwrap());
    common::expect_word(&mut out, "held");
    let etcd = plain_backend("child").await;
    assert!(matches!(
        etcd.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let killed_at = Instant::now();
    holder.0.kill().unwrap();
    holder.0.wait().unwrap();
    let g = etcd.lock("k").wait(Duration::from_secs(30)).await.unwrap();
    eprintln!(
        "kill -9 of the holder: the waiter had the lock {} ms later (lease TTL 4 s)",
        killed_at.elapsed().as_millis()
    );
    g.release().await.unwrap();
    settle_empty("child").await;
}

#[tokio::test]
#[ignore = "run as a child process by the tests above"]
async fn child_entry() {
    let Ok(role) = std::env::var("TOWER_LOCK_CHILD") else {
        return;
    };
    let k = std::env::var("TOWER_LOCK_CHILD_KEY").unwrap();
    let root = std::env::var("TOWER_LOCK_CHILD_ROOT").unwrap();
    let etcd = backend_with(&etcd_url(), options("child").root(root)).await;
    match role.as_str() {
        "worker" => {
            let log = std::env::var("TOWER_LOCK_CHILD_LOG").unwrap();
            common::worker_child(&etcd, &k, &log).await;
        }
        "holder" => {
            let g = etcd.lock(k.as_str()).await.unwrap();
            println!("held");
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(g);
        }
        other => panic!("unknown child role {other}"),
    }
}
