//! Behaviour on one ZooKeeper server: exclusion, hand-over, Curator's
//! node names, ordering, clean-up, modes and errors.

use super::*;

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
    let spacing = u64::from(tower_lock::backend::zookeeper::ZookeeperBackend::TOKEN_SPACING);
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
    let spacing = u64::from(tower_lock::backend::zookeeper::ZookeeperBackend::TOKEN_SPACING);
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
    let port = common::free_port();
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

/// A key locked for the first time costs one round trip and one write to
/// take: its parent and node are created in one `multi`, where the node's
/// create used to fail first and the parent be made after (then, the
/// parent's create sent just before the node's, with a listing).
/// Counted by the server (`cons`: the requests each session sent), the
/// least over five keys, so that a ping in between does not count.
#[tokio::test]
async fn a_new_key_is_taken_in_one_round_trip() {
    let addr = zk_addr();
    let root = root("new-key");
    let zk = backend_rooted(&addr, &root, Duration::from_secs(4)).await;
    let raw = raw(&addr).await;
    // The backend's session, found as the owner of its first lock node
    // (whose lock also makes the root).
    let first = zk.lock("first").await.unwrap();
    let node = lock_nodes(&raw, &root)
        .await
        .pop()
        .expect("the first lock's node");
    let session = raw
        .check_stat(&node)
        .await
        .unwrap()
        .expect("held")
        .ephemeral_owner;
    first.release().await.unwrap();
    let sent = || {
        let cons = four_letter(&addr, "cons");
        let line = cons
            .lines()
            .find(|l| l.contains(&format!("sid=0x{session:x},")))
            .unwrap_or_else(|| panic!("session 0x{session:x} not in `cons`:\n{cons}"));
        let recved = line.split("recved=").nth(1).expect("a recved count");
        recved[..recved.find(',').expect("a field after it")]
            .parse::<u64>()
            .expect("a count")
    };
    let mut least = u64::MAX;
    for i in 0..5 {
        let before = sent();
        let guard = zk.lock(format!("new-{i}").as_str()).await.unwrap();
        if i == 0 {
            // Created with its parent in one transaction; the token is the
            // node's creation zxid all the same.
            let node = lock_nodes(&raw, &format!("{root}/new-0"))
                .await
                .pop()
                .unwrap();
            let (_, stat) = raw.get_data(&node).await.unwrap();
            let (_, parent) = raw.get_data(&format!("{root}/new-0")).await.unwrap();
            assert_eq!(parent.czxid, stat.czxid, "the parent was created apart");
            let spacing = u64::from(ZookeeperBackend::TOKEN_SPACING);
            assert_eq!(guard.token().get(), stat.czxid as u64 * spacing);
        }
        guard.release().await.unwrap();
        least = least.min(sent() - before);
    }
    // The `multi` that creates the parent and the node (its only child: no
    // listing), and the release's delete.
    assert_eq!(least, 2, "requests to lock and release a new key");
}

/// A parent the backend has seen, reaped since (a container, once empty),
/// is made again by the next lock of its key.
#[tokio::test]
async fn a_parent_reaped_since_it_was_seen_is_made_again() {
    let addr = zk_addr();
    let root = root("reaped");
    let zk = backend_rooted(&addr, &root, Duration::from_secs(4)).await;
    let raw = raw(&addr).await;
    zk.lock("k").await.unwrap().release().await.unwrap();
    // As the server's container reaper would.
    raw.delete(&format!("{root}/k"), None).await.unwrap();
    let guard = zk.lock("k").await.unwrap();
    assert_eq!(lock_nodes(&raw, &root).await.len(), 1);
    guard.release().await.unwrap();
}
