//! Locks between processes: this test binary run again as children.

use super::*;

#[tokio::test]
async fn excludes_between_processes() {
    let test = "procs";
    let url = redis_url();
    let log = format!("{}log", prefix(test));
    let _: () = raw(&url).await.del(&log).await.unwrap();
    let mut kids: Vec<(common::KillOnDrop, BufReader<ChildStdout>)> = (0..2)
        .map(|_| {
            let mut c = child("worker", test, &[]);
            let out = BufReader::new(c.0.stdout.take().unwrap());
            (c, out)
        })
        .collect();
    for (_, out) in &mut kids {
        common::expect_word(out, "ready");
    }
    for (c, _) in &mut kids {
        writeln!(c.0.stdin.as_mut().unwrap(), "go").unwrap();
    }
    for (c, out) in &mut kids {
        let mut line = String::new();
        let mut overlaps = None;
        while out.read_line(&mut line).unwrap() > 0 {
            overlaps = overlaps.or_else(|| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix("overlaps="))
                    .map(str::to_owned)
            });
            line.clear();
        }
        assert_eq!(overlaps.as_deref(), Some("0"));
        assert!(c.0.wait().unwrap().success());
    }
    let entries: Vec<String> = raw(&url).await.lrange(&log, 0, -1).await.unwrap();
    check_two_process_log(&entries, 100);
    let _: () = raw(&url).await.del(&log).await.unwrap();
}

#[tokio::test]
async fn a_release_reaches_redis_when_the_process_exits_right_after() {
    let test = "exit";
    let b = backend(test).await;
    for how in ["await", "drop_flush"] {
        let mut c = child("release_and_exit", test, &[("HOW", how.into())]);
        read_value(&mut c.0, "token");
        assert!(c.0.wait().unwrap().success());
        // Other connections see the release a moment later; a lost one
        // would keep the key for the child's whole lease.
        let g = b.lock("exit").wait(Duration::from_secs(5)).await;
        g.expect("the child's release was lost")
            .release()
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_killed_holder_frees_the_key_when_its_lease_ends() {
    let test = "killed";
    let mut holder = child("holder", test, &[("LEASE_MS", "1000".into())]);
    read_value(&mut holder.0, "token");
    holder.0.kill().unwrap(); // SIGKILL: no release, no renewal
    holder.0.wait().unwrap();
    let b = backend(test).await;
    assert!(matches!(
        b.lock("held").fail_fast().await,
        Err(LockError::Busy)
    ));
    let g = b.lock("held").wait(Duration::from_secs(10)).await.unwrap();
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_a_killed_holder_frees_the_key_when_its_lease_ends() {
    use tower_lock::backend::redis::redlock::RedlockBackend;
    let servers: Vec<Server> = (0..3).map(|_| Server::start()).collect();
    let url = redlock_url(&servers);
    let extra = [("REDLOCK_URL", url.clone()), ("LEASE_MS", "1000".into())];
    let mut holder = child("redlock_holder", "redlock-killed", &extra);
    let token: u64 = read_value(&mut holder.0, "token").parse().unwrap();
    holder.0.kill().unwrap(); // SIGKILL: no release, no renewal
    holder.0.wait().unwrap();
    let b = RedlockBackend::connect(&url).await.unwrap();
    assert!(matches!(
        b.lock("held").fail_fast().await,
        Err(LockError::Busy)
    ));
    let g = b.lock("held").wait(Duration::from_secs(10)).await.unwrap();
    assert!(g.token().get() > token);
    g.release().await.unwrap();
}

#[tokio::test]
async fn a_paused_holder_loses_the_lock_and_its_stale_token_is_refused() {
    let test = "paused";
    let url = redis_url();
    let mut holder = child("holder", test, &[("LEASE_MS", "600".into())]);
    let stale: u64 = read_value(&mut holder.0, "token").parse().unwrap();
    assert!(common::signal(&holder.0, "STOP"));

    // The lease runs out while the holder is stopped; we take the key and
    // write with our (higher) token.
    let b = backend(test).await;
    let g = b.lock("held").wait(Duration::from_secs(10)).await.unwrap();
    assert!(g.token().get() > stale);
    assert!(fenced_write(&url, &format!("{}store", prefix(test)), g.token().get()).await);

    assert!(common::signal(&holder.0, "CONT"));
    // The holder wakes, learns at its next renewal that the lock is gone,
    // and its write is refused by the fenced store.
    assert_eq!(read_value(&mut holder.0, "stale_write"), "refused");
    assert!(holder.0.wait().unwrap().success());
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_makes_the_holder_lost_and_tokens_keep_rising() {
    // Its own server, since the test restarts it.
    let mut server = Server::start();
    let url = server.url();
    let b = backend_at(&url, "restart:").await;
    let lease = Duration::from_secs(3);
    let asked = Instant::now();
    let g = b.lock("k").lease(lease).await.unwrap();
    let lost = when_lost(g.held().lost_signal());

    server.kill();
    let killed = Instant::now();
    server.restart();

    let lost = lost_at(lost, 2 * lease, "restart").await;
    // The renewal that finds the failure starts at once, on the dropped
    // connection.
    told_within_a_renewal(lost, asked, lease, killed, "the server was killed");
    // The restarted server forgot the lock and the counter; a new holder's
    // token is still higher, so storage can refuse the old one.
    let other = backend_at(&url, "restart:").await;
    let g2 = other.lock("k").wait(Duration::from_secs(10)).await.unwrap();
    assert!(g2.token() > g.token());
    g2.release().await.unwrap();
    drop(g);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_restart_quarantine_no_one_takes_a_key_an_old_holder_may_still_hold() {
    let mut server = Server::start();
    let url = server.url();
    let quarantined = |url: String| async move {
        RedisBackend::connect_with(
            &url,
            RedisOptions::default()
                .prefix("q:")
                .restart_quarantine(Duration::from_millis(1500)),
        )
        .await
        .unwrap()
    };
    // A new server waits once too: the marker tells an empty server apart.
    let b = quarantined(url.clone()).await;
    assert!(matches!(
        b.lock("k").lease(Duration::from_secs(30)).await,
        Err(LockError::Config(_))
    ));
    let lease = Duration::from_millis(1500);
    assert!(matches!(
        b.lock("k").lease(lease).fail_fast().await,
        Err(LockError::Busy)
    ));
    let g = b
        .lock("k")
        .lease(lease)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();

    // Restarted mid-hold: the holder may be inside its lease for 1.5 s more.
    server.kill();
    server.restart();
    let other = quarantined(url.clone()).await;
    let restarted = std::time::Instant::now();
    assert!(matches!(
        other.lock("k").lease(lease).fail_fast().await,
        Err(LockError::Busy)
    ));
    let g2 = other
        .lock("k")
        .lease(lease)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        restarted.elapsed() >= Duration::from_millis(1400),
        "granted {:?} after the restart, inside the old holder's lease",
        restarted.elapsed()
    );
    assert!(
        g.is_lost(),
        "the old holder was not told before the next grant"
    );
    assert!(g2.token() > g.token());
    g2.release().await.unwrap();
    drop(g);
    drop(server);
}
