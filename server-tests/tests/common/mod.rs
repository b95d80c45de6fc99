//! Helpers shared by the server tests (`mod common;` in each).
#![allow(dead_code)]

/// The fault proxy of the project's harnesses: a holder's connections go
/// through it, and only that path fails while the server stays up for
/// everyone else.
pub use tower_lock_servers::fault_proxy;

/// A fault proxy in front of the server `url` names (`scheme://[user@]
/// IP:port/...`), and the same URL through it.
pub async fn proxied_url(url: &str) -> (fault_proxy::FaultProxy, String) {
    let authority = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    let server = authority.rsplit('@').next().unwrap();
    let proxy = fault_proxy::FaultProxy::start(server.parse().expect("a URL with IP:port"))
        .await
        .unwrap();
    let through = url.replacen(server, &proxy.addr().to_string(), 1);
    (proxy, through)
}

/// Waits until `cond` holds, checking every millisecond for ten seconds.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Every operation dropped at every poll point.
pub mod cancel;

/// The conformance suite every backend and mode runs.
pub mod contract;

/// Its tests of an operator's inspect, list and break.
pub mod operators;

/// Three-server clusters on loopback, and what is checked on them.
pub mod cluster;

/// A Redis master, replicas and Sentinels on loopback.
pub mod sentinel;

/// A Redis Cluster of three masters and their replicas on loopback.
pub mod redis_cluster;

/// The last lines of every `*.log` under `dir` (a test's servers), for a
/// failure message: a CI run's files are gone with its machine.
pub fn log_tails(dir: &std::path::Path) -> String {
    fn logs(dir: &std::path::Path, found: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                logs(&path, found);
            } else if path.extension().is_some_and(|e| e == "log") {
                found.push(path);
            }
        }
    }
    let mut found = Vec::new();
    logs(dir, &mut found);
    found.sort();
    let mut out = format!("logs in {}:\n", dir.display());
    for path in found {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let name = path.strip_prefix(dir).unwrap_or(&path).display();
        out.push_str(&format!("--- {name}, last lines:\n"));
        for line in &lines[lines.len().saturating_sub(8)..] {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A free loopback port, for a server a test starts (or for one that is
/// surely not listening).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits (up to 15 s: a backend's release-subscription sweeper looks
/// every 10 s) until no more tasks are alive than `before`.
pub async fn no_task_left_after(before: usize) {
    let metrics = tokio::runtime::Handle::current().metrics();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while metrics.num_alive_tasks() > before {
        assert!(
            std::time::Instant::now() < deadline,
            "{} tasks left behind",
            metrics.num_alive_tasks() - before
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// `kill -SIGNAL` (`STOP`, `CONT`, `INT`) of a child process a test
/// started; whether it was sent.
pub fn signal(child: &std::process::Child, signal: &str) -> bool {
    std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .expect("kill runs")
        .success()
}

/// A child process that does not outlive a failed test.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs this test binary's `child_entry` test as another OS process, with
/// `TOWER_LOCK_CHILD=role` and `env`; its stdin and stdout are piped.
pub fn spawn_child(role: &str, env: &[(&str, String)]) -> KillOnDrop {
    use std::process::{Command, Stdio};
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child_entry",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("TOWER_LOCK_CHILD", role)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    KillOnDrop(cmd.spawn().unwrap())
}

/// Reads a child's lines until one holds the word `word` (libtest may print
/// on the same line).
pub fn expect_word(out: &mut std::io::BufReader<std::process::ChildStdout>, word: &str) {
    use std::io::BufRead;
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended before saying {word:?}"
        );
        if line.split_whitespace().any(|w| w == word) {
            return;
        }
    }
}

/// `tasks` tasks, spread over `backends` in turn, each lock `key` `rounds`
/// times: never two holders at once, and every holder's token above the
/// one before.
pub async fn excludes_with_increasing_tokens<B: tower_lock::Backend + Clone>(
    backends: &[B],
    key: &str,
    tasks: usize,
    rounds: usize,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use tower_lock::BackendExt;

    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut running = Vec::new();
    for i in 0..tasks {
        let backend = backends[i % backends.len()].clone();
        let (inside, tokens, key) = (inside.clone(), tokens.clone(), key.to_owned());
        running.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let wait = std::time::Duration::from_secs(30);
                let g = backend.lock(key.as_str()).wait(wait).await.unwrap();
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokens.lock().unwrap().push(g.token());
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await.unwrap();
            }
        }));
    }
    for t in running {
        t.await.unwrap();
    }
    let tokens = std::mem::take(&mut *tokens.lock().unwrap());
    assert_eq!(tokens.len(), tasks * rounds);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing"
    );
}

/// Acquires `key` on `b`, retrying through a failover's refusals, within
/// 30 s.
pub async fn lock_after_failover<B: tower_lock::Backend>(
    b: &B,
    key: &str,
) -> tower_lock::LockGuard {
    use tower_lock::BackendExt;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match b.lock(key).wait(std::time::Duration::from_secs(1)).await {
            Ok(g) => return g,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("during the failover: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no lock 30 s after the failover: {e}"),
        }
    }
}

/// Two `worker` children, made by `spawn` with the path of the log they
/// share, connect, then contend for one key at the same time (each runs
/// [`worker_child`]); their log must show one holder at a time.
pub fn two_processes_exclude(spawn: impl Fn(&str) -> KillOnDrop) {
    use std::io::Write;
    let log = std::env::temp_dir().join(format!(
        "tower-lock-procs-{}-{}.log",
        std::process::id(),
        std::thread::current()
            .name()
            .unwrap_or("t")
            .replace("::", "-")
    ));
    let _ = std::fs::remove_file(&log);
    let mut kids: Vec<(KillOnDrop, std::io::BufReader<std::process::ChildStdout>)> = (0..2)
        .map(|_| {
            let mut c = spawn(&log.display().to_string());
            let out = std::io::BufReader::new(c.0.stdout.take().unwrap());
            (c, out)
        })
        .collect();
    // Both connected, then both told to go: they contend at the same time.
    for (_, out) in &mut kids {
        expect_word(out, "ready");
    }
    for (c, _) in &mut kids {
        writeln!(c.0.stdin.as_mut().unwrap(), "go").unwrap();
    }
    for (c, _) in &mut kids {
        assert!(c.0.wait().unwrap().success());
    }
    // Each process appends `start` and `end` around its run and `enter` and
    // `leave` around each critical section (appends are ordered).
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    check_two_process_log(&lines, 30);
    let _ = std::fs::remove_file(&log);
}

/// The child side of [`two_processes_exclude`]: says `ready`, waits for
/// `go`, then locks `key` 30 times, logging to `log`.
pub async fn worker_child<B: tower_lock::Backend>(backend: &B, key: &str, log: &str) {
    use std::io::Write;
    use tower_lock::BackendExt;
    let me = std::process::id();
    // One write per line: appends from both processes interleave only
    // whole lines.
    let append = |line: String| {
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(log)
            .unwrap()
            .write_all(format!("{line}\n").as_bytes())
            .unwrap();
    };
    println!("ready");
    std::io::stdout().flush().unwrap();
    std::io::stdin().read_line(&mut String::new()).unwrap();
    append(format!("start {me}"));
    for _ in 0..30 {
        let g = backend
            .lock(key)
            .wait(std::time::Duration::from_secs(30))
            .await
            .unwrap();
        append(format!("enter {me}"));
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        append(format!("leave {me}"));
        g.release().await.unwrap();
    }
    append(format!("end {me}"));
}

/// Checks a log of `start P`, `enter P`, `leave P` and `end P` entries from
/// two processes: each critical section is entered and left by one process
/// with no other entry between, and both processes started before either
/// ended, so they contended for the lock at the same time.
pub fn check_two_process_log(log: &[String], sections_each: usize) {
    let pids: std::collections::BTreeSet<&str> = log
        .iter()
        .filter_map(|l| l.strip_prefix("start "))
        .collect();
    assert_eq!(pids.len(), 2, "{log:?}");
    let first_end = log
        .iter()
        .position(|l| l.starts_with("end "))
        .expect("no process ended");
    let started_before = log[..first_end]
        .iter()
        .filter(|l| l.starts_with("start "))
        .count();
    assert_eq!(
        started_before, 2,
        "one process ended before the other started: they never overlapped"
    );
    let sections: Vec<&String> = log
        .iter()
        .filter(|l| l.starts_with("enter ") || l.starts_with("leave "))
        .collect();
    assert_eq!(sections.len(), 2 * 2 * sections_each);
    for pair in sections.chunks(2) {
        let (enter, leave) = (pair[0], pair[1]);
        assert!(enter.starts_with("enter "), "overlap: {pair:?}");
        assert_eq!(
            leave.strip_prefix("leave "),
            enter.strip_prefix("enter "),
            "overlap"
        );
    }
    let switches = sections
        .chunks(2)
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0][0] != w[1][0])
        .count();
    eprintln!("the lock went from one process to the other {switches} times");
}

/// Re-entrancy through `backend` under the layer: a handler re-locking its
/// own request's key, through the layer's locker and through a clone of the
/// backend, gets the request's token at once (fail-fast: waiting for itself
/// would be `Busy`); a key the handler took itself is re-entered too; and
/// once the response is ready the key is free again. The layer's
/// namespace is `namespace`.
pub async fn reenters_under_the_layer<B: tower_lock::Backend + Clone>(backend: B, namespace: &str) {
    use axum::{body::Body, extract::Path, routing::post, Extension, Router};
    use tower::ServiceExt;
    use tower_lock::{BackendExt, HeldLock, LockError, LockLayer, Locker, PathParam};

    let layer = LockLayer::new(backend.clone(), PathParam("sku")).namespace(namespace);
    let locker = layer.locker().clone();
    let clone = backend.clone();
    let app = Router::new()
        .route(
            "/orders/{sku}",
            post(
                move |locker: Locker, held: HeldLock, Path(sku): Path<String>| async move {
                    let again = locker.lock(&sku).fail_fast().await?;
                    assert_eq!(again.token(), held.token());
                    let through_clone = clone.lock(held.key()).fail_fast().await?;
                    assert_eq!(through_clone.token(), held.token());
                    let first = locker.lock("other").fail_fast().await?;
                    let second = locker.lock("other").fail_fast().await?;
                    assert_eq!(first.token(), second.token());
                    Ok::<_, LockError>("re-entered")
                },
            ),
        )
        .route_layer(layer)
        .layer(Extension(locker.clone()));
    let request = http::Request::post("/orders/A1")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, "re-entered");
    backend.flush().await;
    for key in ["A1", "other"] {
        let free = locker.lock(key).fail_fast().await;
        assert!(
            free.is_ok(),
            "{key} still held after the response: {free:?}"
        );
    }
}

/// Twenty waiters queued in one process behind a holder get `key` in the
/// order they asked for it, also where the lock goes back to the server
/// between them (a cohort's bound of holders, or of time). On the
/// current-thread runtime each waiter runs until it queues before the next
/// is spawned.
///
/// Without `ordered` (a mode that promises no order), every waiter must
/// still get the key, once, in some order.
pub async fn waiters_in_one_process_in_arrival_order<B: tower_lock::Backend + Clone + 'static>(
    backend: B,
    key: &str,
    ordered: bool,
) {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tower_lock::BackendExt;

    let holder = backend.lock(key).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..20 {
        let (b, order, key) = (backend.clone(), order.clone(), key.to_owned());
        waiters.push(tokio::spawn(async move {
            let g = b.lock(key).wait(Duration::from_secs(10)).await.unwrap();
            order.lock().unwrap().push(i);
            tokio::task::yield_now().await;
            g.release().await.unwrap();
        }));
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
    }
    holder.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    let mut served = std::mem::take(&mut *order.lock().unwrap());
    if !ordered {
        served.sort_unstable();
    }
    assert_eq!(served, (0..20).collect::<Vec<_>>());
    backend.flush().await;
}

/// Every way a request under the layer ends releases its lock on the server,
/// there and then, not when a lease runs out: a response, an error response,
/// a handler that panics, a client that goes away mid-handler, and a wait
/// cancelled while another holds the key. `other` is a second instance on
/// the same servers (another process, as far as they can tell): it must get
/// each key within 5 s, and so must `backend` itself. The layer's lease is
/// 60 s, so a lock left to expire (on the backends whose locks end with
/// their lease) fails this too. The layer's namespace is `namespace`.
pub async fn released_under_the_layer<B: tower_lock::Backend + Clone>(
    backend: B,
    other: B,
    namespace: &str,
) {
    use std::sync::Arc;

    use axum::{body::Body, routing::post, Router};
    use http::StatusCode;
    use tower::ServiceExt;
    use tower_lock::{BackendExt, LockError, LockLayer, PathParam};

    async fn panics() -> &'static str {
        panic!("the handler panics (on purpose)")
    }
    let started = Arc::new(tokio::sync::Notify::new());
    let in_handler = started.clone();
    let app = Router::new()
        .route("/ok/{sku}", post(|| async { "ok" }))
        .route(
            "/error/{sku}",
            post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "failed") }),
        )
        .route("/panic/{sku}", post(panics))
        .route(
            "/stuck/{sku}",
            post(move || async move {
                in_handler.notify_one();
                std::future::pending::<&str>().await
            }),
        )
        .route_layer(
            LockLayer::new(backend.clone(), PathParam("sku"))
                .namespace(namespace)
                .lease(std::time::Duration::from_secs(60)),
        );
    let call = |path: &str| {
        let request = http::Request::post(path).body(Body::empty()).unwrap();
        tokio::spawn(app.clone().oneshot(request))
    };
    // Both instances can take `key` at once (each released it at once).
    async fn free<B: tower_lock::Backend>(instances: [&B; 2], key: &str, after: &str) {
        for (which, backend) in instances.into_iter().enumerate() {
            let mut last = None;
            for _ in 0..250 {
                match backend.lock(key).fail_fast().await {
                    Ok(guard) => {
                        guard.release().await.unwrap();
                        last = None;
                        break;
                    }
                    Err(LockError::Busy) => last = Some(LockError::Busy),
                    Err(e) => panic!("locking {key} after {after}: {e}"),
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            let who = ["another instance", "the layer's own backend"][which];
            assert!(
                last.is_none(),
                "{key} still held for {who} 5 s after {after}"
            );
        }
    }
    let both = [&other, &backend];

    // The response (and with it the body, which may hold the lock) is
    // dropped at the end of each statement.
    let status = call("/ok/A-ok").await.unwrap().unwrap().status();
    assert_eq!(status, 200);
    free(both, &format!("{namespace}:A-ok"), "a response").await;

    let status = call("/error/A-error").await.unwrap().unwrap().status();
    assert_eq!(status, 500);
    free(both, &format!("{namespace}:A-error"), "an error response").await;

    let panicked = call("/panic/A-panic").await.unwrap_err();
    assert!(panicked.is_panic(), "{panicked}");
    free(
        both,
        &format!("{namespace}:A-panic"),
        "a panic in the handler",
    )
    .await;

    let stuck = call("/stuck/A-gone");
    started.notified().await;
    stuck.abort();
    assert!(stuck.await.unwrap_err().is_cancelled());
    free(both, &format!("{namespace}:A-gone"), "the client went away").await;

    let wait_key = format!("{namespace}:A-wait");
    let held = other.lock(wait_key.as_str()).await.unwrap();
    let waiting = call("/ok/A-wait");
    // Time to queue behind `held` (had it not yet, the abort still cancels
    // an acquisition under way, which must leave nothing either).
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    held.release().await.unwrap();
    free(both, &wait_key, "a cancelled wait").await;

    backend.flush().await;
    other.flush().await;
}

/// Four workers on each of two backends (two processes, as far as the
/// server can tell) lock one key in a loop for `run`; returns how many
/// times each side held it. Checks that no two held it at once and that
/// tokens rose with every holder: cohorting passes a lock within a side,
/// and must neither break exclusion nor keep the other side out.
pub async fn take_turns<B: tower_lock::Backend + Clone>(
    a: &B,
    b: &B,
    key: &str,
    run: std::time::Duration,
) -> (u64, u64) {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use tower_lock::BackendExt;

    let inside = Arc::new(AtomicUsize::new(0));
    let last_token = Arc::new(Mutex::new(0u64));
    let counts = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
    let stop = tokio::time::Instant::now() + run;
    let mut workers = Vec::new();
    for (backend, count) in [a, b].into_iter().zip(&counts) {
        for _ in 0..4 {
            let backend = backend.clone();
            let (inside, last_token) = (inside.clone(), last_token.clone());
            let (count, key) = (count.clone(), key.to_owned());
            workers.push(tokio::spawn(async move {
                while tokio::time::Instant::now() < stop {
                    let wait = std::time::Duration::from_secs(30);
                    let guard = backend.lock(key.as_str()).wait(wait).await.unwrap();
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    {
                        let mut last = last_token.lock().unwrap();
                        assert!(guard.token().get() > *last, "token did not rise");
                        *last = guard.token().get();
                    }
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    count.fetch_add(1, Ordering::Relaxed);
                    drop(guard);
                }
            }));
        }
    }
    for w in workers {
        w.await.unwrap();
    }
    (
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
    )
}

/// Asserts that neither side of [`take_turns`] was kept out: each held the
/// lock at least a tenth as often as the other.
pub fn assert_neither_starved((a, b): (u64, u64)) {
    assert!(a > 0 && b > 0, "a side never held the lock: {a} and {b}");
    assert!(
        a.min(b) * 10 >= a.max(b),
        "one side was starved: {a} against {b} holds"
    );
}

/// Cuts a holder off one way (`proxies`, through which it reaches its
/// servers, stop passing its requests; answers would still come) while
/// `other` waits for `key`: the holder must be told its lock is lost
/// before `other` is granted it, with a higher token. Returns how long
/// after the cut each happened, in milliseconds; heals the proxies. With
/// `heal_when_told`, they heal as soon as the holder is told: for stores
/// whose server keeps a silent connection's locks until it closes
/// (PostgreSQL), where the holder's close reaches it only then.
pub async fn cut_off_holder_is_told_first<B: tower_lock::Backend + Clone + 'static>(
    held: &tower_lock::LockGuard,
    proxies: &[fault_proxy::FaultProxy],
    other: &B,
    key: &str,
    heal_when_told: bool,
) -> (u128, u128) {
    use std::time::{Duration, Instant};
    use tower_lock::BackendExt;

    let waiting = {
        let (other, key) = (other.clone(), key.to_owned());
        tokio::spawn(async move {
            let g = other.lock(key.as_str()).wait(Duration::from_secs(30)).await;
            (g, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    // When the last request went through any of them.
    let mut cut_at: Option<Instant> = None;
    for proxy in proxies {
        let at = proxy.set(fault_proxy::Fault::FreezeUp).await;
        let at = at.unwrap_or_else(Instant::now);
        cut_at = Some(cut_at.map_or(at, |c| c.max(at)));
    }
    let cut_at = cut_at.expect("a proxy to cut");
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder was not told");
    let told_at = Instant::now();
    if heal_when_told {
        for proxy in proxies {
            proxy.heal().await;
        }
    }
    let (g, granted_at) = waiting.await.unwrap();
    let g = g.unwrap();
    assert!(told_at < granted_at, "granted before the holder was told");
    assert!(g.token() > held.token());
    g.release().await.unwrap();
    for proxy in proxies {
        proxy.heal().await;
    }
    (
        told_at.duration_since(cut_at).as_millis(),
        granted_at.duration_since(cut_at).as_millis(),
    )
}

/// The ZooKeeper lock nodes (ephemeral) anywhere under `path`; none if
/// `path` does not exist. Any other error fails the test.
pub async fn zk_lock_nodes(client: &zookeeper_client::Client, path: String) -> Vec<String> {
    use zookeeper_client as zk;
    let mut found = Vec::new();
    let mut todo = vec![path];
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
