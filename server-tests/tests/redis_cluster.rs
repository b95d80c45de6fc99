//! The Redis backend on a Redis Cluster: three masters and a replica of
//! each, that each test starts on loopback (`tests/common/redis_cluster.rs`)
//! so that it can move slots, kill masters and cut replication.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::redis_cluster::RedisCluster;
use tower_lock::backend::redis::{RedisBackend, RedisOptions};
use tower_lock::backend::CohortOptions;
use tower_lock::{Backend, BackendExt, LockError, LockMode};

async fn backend(url: &str, options: RedisOptions) -> RedisBackend {
    RedisBackend::connect_with(url, options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the cluster at {url}: {e}"))
}

/// Lock keys whose slots are on three different masters.
async fn one_key_per_master(cluster: &RedisCluster) -> Vec<String> {
    let (mut keys, mut masters) = (Vec::new(), HashSet::new());
    for i in 0.. {
        let key = format!("order:{i}");
        let (master, _) = cluster
            .master_of(cluster.slot(&format!("lock:{{{key}}}")).await)
            .await;
        if masters.insert(master.id) {
            keys.push(key);
        }
        if keys.len() == 3 {
            return keys;
        }
    }
    unreachable!()
}

/// The hash slot of a Redis key with a `{tag}`: CRC16 (XMODEM) of the tag,
/// modulo 16384, as the cluster computes it.
fn key_slot(key: &str) -> u16 {
    let tag = key
        .split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map_or(key, |(tag, _)| tag);
    let mut crc: u16 = 0;
    for byte in tag.bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// Every layout on every master: exclusion with rising tokens, readers
/// together and writers alone, a semaphore's permits, keys of three slots
/// taken together, replicas waited for, scripts a master lost sent again;
/// and nothing left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_layout_works_on_every_master() {
    let cluster = RedisCluster::start("layouts").await;
    let url = cluster.url("");
    let a = backend(&url, RedisOptions::default()).await;
    let b = backend(&url, RedisOptions::default().cohort(CohortOptions::off())).await;
    let keys = one_key_per_master(&cluster).await;
    for key in &keys {
        common::excludes_with_increasing_tokens(&[a.clone(), b.clone()], key, 4, 20).await;
    }
    for key in keys.iter().map(String::as_str) {
        let r1 = a.lock(key).read().await.unwrap();
        let r2 = b.lock(key).read().fail_fast().await.unwrap();
        assert!(matches!(
            b.lock(key).write().fail_fast().await,
            Err(LockError::Busy)
        ));
        drop((r1, r2));
        let w = b.lock(key).write().await.unwrap();
        assert!(matches!(
            a.lock(key).read().fail_fast().await,
            Err(LockError::Busy)
        ));
        w.release().await.unwrap();

        let two = LockMode::Semaphore { permits: 2 };
        let s1 = a.lock(key).mode(two).await.unwrap();
        let s2 = b.lock(key).mode(two).await.unwrap();
        assert!(matches!(
            a.lock(key).mode(two).fail_fast().await,
            Err(LockError::Busy)
        ));
        drop((s1, s2));
    }
    // Braces in a key neither break the hash tag (`}x` would leave it
    // empty: the lock's keys on different slots, its script refused with
    // CROSSSLOT) nor steer it (`a}x` would take the slot of `a`).
    for key in ["}x", "a}x", "{x", "a{b}c", "}"] {
        common::excludes_with_increasing_tokens(&[a.clone(), b.clone()], key, 2, 5).await;
        let w = a.lock(key).write().await.unwrap();
        assert!(matches!(
            b.lock(key).read().fail_fast().await,
            Err(LockError::Busy)
        ));
        w.release().await.unwrap();
        let name = a.redis_key(&tower_lock::LockKey::new(key).unwrap());
        let tag = name.split_once('{').unwrap().1.rsplit_once('}').unwrap().0;
        assert_eq!(key_slot(&name), key_slot(&format!("{{{tag}}}")), "{name}");
        assert!(!tag.contains('}'), "{key}: the tag of {name} holds a brace");
    }
    let key = keys[0].as_str();

    let all = a.lock_all(keys.iter().map(String::as_str)).await.unwrap();
    for key in &keys {
        assert!(
            matches!(b.lock(key.as_str()).fail_fast().await, Err(LockError::Busy)),
            "{key} is held by the lock_all"
        );
    }
    all.release().await.unwrap();

    // Waiting for replicas: granted while the slot's replica acknowledges,
    // refused while it is stopped. The grant may wait long: with every test
    // of this file running its own cluster, an acknowledgement can take more
    // than the 200 ms the refusal waits.
    let waits = backend(
        &cluster.url("?wait_replicas=1&wait_timeout_ms=5000"),
        RedisOptions::default().response_timeout(Duration::from_secs(10)),
    )
    .await;
    waits.lock(key).await.unwrap().release().await.unwrap();
    let refuses = backend(
        &cluster.url("?wait_replicas=1&wait_timeout_ms=200"),
        RedisOptions::default(),
    )
    .await;
    let (_, replica) = cluster
        .master_of(cluster.slot(&format!("lock:{{{key}}}")).await)
        .await;
    let replica = replica.expect("the master has a replica");
    cluster.signal(replica.port, "STOP");
    let refused = refuses.lock(key).fail_fast().await;
    cluster.signal(replica.port, "CONT");
    match refused {
        Err(LockError::Backend { message, .. }) if message.contains("replicas acknowledged") => {}
        other => panic!("expected a refusal naming the replicas, got {other:?}"),
    }

    // A master that lost its scripts (a promoted replica, a restart) is
    // sent their text, even while a node of another shard does not answer
    // (`SCRIPT LOAD` on a cluster would need every node).
    let (master, _) = cluster
        .master_of(cluster.slot(&format!("lock:{{{key}}}")).await)
        .await;
    let (_, elsewhere) = cluster
        .master_of(cluster.slot(&format!("lock:{{{}}}", keys[1])).await)
        .await;
    let elsewhere = elsewhere.expect("the master has a replica");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut cluster.conn(master.port).await)
        .await
        .unwrap();
    cluster.signal(elsewhere.port, "STOP");
    let taken = a.lock(key).fail_fast().await;
    cluster.signal(elsewhere.port, "CONT");
    taken
        .expect("a lock on a master without the scripts")
        .release()
        .await
        .unwrap();

    for backend in [&a, &b, &waits, &refuses] {
        backend.flush().await;
    }
    assert_eq!(
        cluster.all_lock_keys().await,
        Vec::<String>::new(),
        "lock keys left"
    );
}

/// A slot resharded while a lock in it is held: a new lock asked for while
/// the slot migrates is taken on the new master once it has moved (`ASK`,
/// then `TRYAGAIN` retried, then `MOVED`), the held one's keys move with
/// the slot, both holders' renewals follow them (neither is told
/// lost), nobody else is granted either meanwhile, and the releases remove
/// them on the new master (`MOVED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resharded_slot_keeps_its_locks() {
    let cluster = RedisCluster::start("reshard").await;
    let url = cluster.url("");
    let (a, b) = (
        backend(&url, RedisOptions::default()).await,
        backend(&url, RedisOptions::default()).await,
    );
    let key = "moving";
    let slot = cluster.slot("lock:{moving}").await;
    let fresh = (0..)
        .map(|i| format!("fresh{i}"))
        .find(|k| key_slot(&format!("lock:{{{k}}}")) == slot)
        .unwrap();
    let lease = Duration::from_secs(3);
    let held = a.lock(key).lease(lease).await.unwrap();
    let to = cluster.other_master(slot).await;
    // The acquisition started while the slot migrates is awaited once it
    // has moved.
    #[allow(clippy::async_yields_async)]
    let fresh_guard = cluster
        .move_slot(slot, &to, || async {
            // Migrating: the keys are still on the source, which answers.
            assert!(matches!(
                b.lock(key).fail_fast().await,
                Err(LockError::Busy)
            ));
            // The slot's epoch cache gone from the source (moved first, or
            // never written): a script that reads it there would fail (a
            // key not on the node); declared, it is sent again until the
            // slot has moved, and then finds the lock held.
            let (source, _) = cluster.master_of(slot).await;
            let () = redis::cmd("DEL")
                .arg(epoch_cache_of(slot))
                .query_async(&mut cluster.conn(source.port).await)
                .await
                .unwrap();
            let b = b.clone();
            let busy = tokio::spawn(async move { b.lock(key).fail_fast().await.map(drop) });
            tokio::time::sleep(Duration::from_millis(100)).await;
            // A key of the same slot that neither master has: the source
            // sends the script on with `ASK`, and the importing master
            // answers `TRYAGAIN` (a script of several keys, some missing)
            // until the slot is moved; retried within the response
            // timeout, it is then taken there.
            let (a, fresh) = (a.clone(), fresh.clone());
            let taking = tokio::spawn(async move { a.lock(fresh.as_str()).lease(lease).await });
            tokio::time::sleep(Duration::from_millis(100)).await;
            (taking, busy)
        })
        .await;
    let (fresh_guard, busy) = fresh_guard;
    assert!(
        matches!(busy.await.unwrap(), Err(LockError::Busy)),
        "an acquisition on a migrating slot without its epoch cache on the source"
    );
    let fresh_guard = fresh_guard
        .await
        .unwrap()
        .expect("a new lock in a migrating slot is taken once the slot has moved");
    assert_eq!(cluster.master_of(slot).await.0.id, to.id, "the slot moved");
    let mut moved = cluster.lock_keys(to.port).await;
    moved.sort();
    assert_eq!(
        moved,
        [format!("lock:{{{fresh}}}"), "lock:{moving}".into()],
        "the locks are there"
    );
    // Past a whole lease: only renewals on the new master keep it.
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    assert!(!held.is_lost(), "the holder was told its lock was lost");
    assert!(matches!(
        b.lock(key).fail_fast().await,
        Err(LockError::Busy)
    ));
    assert!(!fresh_guard.is_lost());
    held.release().await.unwrap();
    fresh_guard.release().await.unwrap();
    let g = b.lock(key).fail_fast().await.expect("free once released");
    g.release().await.unwrap();
    assert!(cluster.lock_keys(to.port).await.is_empty());
}

/// Replication is asynchronous: a lock the slot's replica never received is
/// gone once that replica is promoted, and the next client is granted it.
/// The holder is told, and its fencing token is below the new holder's by
/// more than 2^36 (the new master's config epoch is higher), so that a
/// fenced store refuses whatever the old master could still grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_loses_an_unreplicated_lock_and_its_token_is_refusable() {
    let mut cluster = RedisCluster::start("failover").await;
    let url = cluster.url("");
    let opts = || RedisOptions::default().cohort(CohortOptions::off());
    let (a, b) = (backend(&url, opts()).await, backend(&url, opts()).await);
    let key = "k";
    let slot = cluster.slot("lock:{k}").await;
    let (master, replica) = cluster.master_of(slot).await;
    let replica = replica.expect("the master has a replica");
    // The counter reaches the replica; what follows while it is stopped
    // does not.
    a.lock(key).await.unwrap().release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Stopped, and its link closed by the master: a stopped replica would
    // still find in its socket whatever the master sent before dying.
    cluster.signal(replica.port, "STOP");
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut cluster.conn(master.port).await)
        .await
        .unwrap();
    let held = a
        .lock(key)
        .lease(Duration::from_secs(20))
        .await
        .expect("the master grants without its replica");
    cluster.kill(master.port);
    cluster.signal(replica.port, "CONT");
    cluster.wait_promoted(replica.port, slot).await;
    let other = common::lock_after_failover(&b, key).await;
    // A failover gives the promoted replica a config epoch above every
    // other node's: its floor is at least 2^36 µs (19 hours of clock)
    // above the old master's, whatever that one still hands out.
    assert!(
        other.token().get() > held.token().get() + (1 << 36),
        "the new holder's token {} is not an epoch above the lost one's {}",
        other.token().get(),
        held.token().get()
    );
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder whose lock the failover lost was not told");
    drop(held);
    other.release().await.unwrap();
}

/// The key of `slot` its locks' scripts keep the slot's epoch in:
/// `lock:{{~n}:epoch`, `n` the least number whose tag `{~n` is on it.
fn epoch_cache_of(slot: u16) -> String {
    let n = (0u32..)
        .find(|n| key_slot(&format!("{{~{n}")) == slot)
        .unwrap();
    format!("lock:{{{{~{n}}}:epoch")
}

/// The epoch a slot's locks take their fencing floor from is a high-water
/// mark of the slot: a master that finds it kept by another (here one of a
/// far higher epoch, as a slot resharded from such a master keeps it) takes
/// the higher of its own epoch and the kept one, whose tokens may still be
/// out. Its own epoch alone would put the next token below them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slots_kept_epoch_is_a_floor_for_any_master_that_finds_it() {
    let cluster = RedisCluster::start("highwater").await;
    let url = cluster.url("");
    let b = backend(&url, RedisOptions::default().cohort(CohortOptions::off())).await;
    let slot = cluster.slot("lock:{k}").await;
    let (master, _) = cluster.master_of(slot).await;
    let cache = epoch_cache_of(slot);
    assert_eq!(key_slot(&cache), slot);
    let kept = 4000u64;
    let () = redis::cmd("SET")
        .arg(&[cache.as_str(), &format!("0123456789abcdef {kept}")])
        .query_async(&mut cluster.conn(master.port).await)
        .await
        .unwrap();
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let g = b.lock("k").await.unwrap();
    assert!(
        g.token().get() > (kept << 36) + now_us - 10_000_000,
        "token {} below the kept epoch's floor {}",
        g.token().get(),
        (kept << 36) + now_us
    );
    g.release().await.unwrap();
}

/// `CLUSTER INFO` counts the state of every slot, some 270,000
/// instructions of the server's: the acquire scripts read the node's
/// config epoch from it once per slot and keep it beside the node's
/// replication ID (see `a_failover_loses_an_unreplicated_lock_and_its_token_is_refusable`
/// for a promoted node reading it again), not once per lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_epoch_is_read_once_per_slot_not_once_per_lock() {
    let cluster = RedisCluster::start("epoch").await;
    let url = cluster.url("");
    let b = backend(&url, RedisOptions::default().cohort(CohortOptions::off())).await;
    let (master, _) = cluster.master_of(cluster.slot("lock:{k}").await).await;
    let masters: Vec<u16> = cluster
        .nodes(master.port)
        .await
        .iter()
        .filter(|n| n.master)
        .map(|n| n.port)
        .collect();
    let read = || async {
        let mut calls = 0;
        for port in &masters {
            let stats: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut cluster.conn(*port).await)
                .await
                .unwrap();
            calls += stats
                .lines()
                .filter_map(|l| l.strip_prefix("cmdstat_cluster|info:calls="))
                .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
                .sum::<u64>();
        }
        calls
    };
    let before = read().await;
    for _ in 0..20 {
        b.lock("k").await.unwrap().release().await.unwrap();
    }
    assert_eq!(
        read().await - before,
        1,
        "CLUSTER INFO calls for 20 locks of one key"
    );
}

/// A waiter subscribes to the release channel on its slot's master only
/// (sharded), the subscription follows the slot when it moves, and the
/// waiter gets the lock once it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_messages_are_sharded_and_follow_the_slot() {
    let cluster = RedisCluster::start("messages").await;
    let url = cluster.url("");
    let (a, b) = (
        backend(&url, RedisOptions::default()).await,
        backend(&url, RedisOptions::default()).await,
    );
    let channel = "lock:{waited}:rel";
    let slot = cluster.slot(channel).await;
    let held = a
        .lock("waited")
        .lease(Duration::from_secs(10))
        .await
        .unwrap();
    let waiter = tokio::spawn(async move {
        let g = b.lock("waited").wait(Duration::from_secs(30)).await;
        (b, g)
    });
    let (from, _) = cluster.master_of(slot).await;
    cluster.wait_subscribed(from.port, channel, 1).await;
    let to = cluster.other_master(slot).await;
    cluster.move_slot(slot, &to, || async {}).await;
    cluster.wait_subscribed(to.port, channel, 1).await;
    cluster.wait_subscribed(from.port, channel, 0).await;
    held.release().await.unwrap();
    let (b, g) = waiter.await.unwrap();
    g.expect("the waiter gets the released lock")
        .release()
        .await
        .unwrap();
    b.flush().await;
}

#[tokio::test]
async fn cluster_urls_and_options_are_checked_and_unreachable_nodes_fail_in_time() {
    for bad in [
        "redis+cluster://127.0.0.1",
        "redis+cluster://127.0.0.1:1/2",
        "redis+cluster://127.0.0.1:1?wait_replicas=two",
        "redis+cluster://127.0.0.1:1?wait_replicas=1&wait_timeout_ms=5000",
    ] {
        assert!(
            matches!(RedisBackend::connect(bad).await, Err(LockError::Config(_))),
            "{bad}"
        );
    }
    let port = common::free_port();
    let url = format!("redis+cluster://127.0.0.1:{port}");
    let quarantined = RedisOptions::default().restart_quarantine(Duration::from_secs(30));
    assert!(matches!(
        RedisBackend::connect_with(&url, quarantined).await,
        Err(LockError::Config(_))
    ));
    let started = Instant::now();
    assert!(matches!(
        RedisBackend::connect(&url).await,
        Err(LockError::Backend { .. })
    ));
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Dropped, the backend leaves no task running: not the cluster
/// connection's, not the subscription sweeper.
#[tokio::test]
async fn a_dropped_backend_leaves_no_task_behind() {
    let cluster = RedisCluster::start("tasks").await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let b = backend(&cluster.url(""), RedisOptions::default()).await;
    let g = b.lock("k").await.unwrap();
    // A waiter subscribes to the release channel.
    let waiter = b.lock("k").wait(Duration::from_secs(5));
    let (waited, ()) = tokio::join!(waiter, async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        g.release().await.unwrap();
    });
    waited.unwrap().release().await.unwrap();
    assert!(metrics.num_alive_tasks() > before);
    drop(b);
    common::no_task_left_after(before).await;
}

/// The backend on a cluster of its test's own, with or without cohorting.
struct OnTheCluster<'a> {
    cluster: &'a RedisCluster,
    cohort: bool,
}

impl common::contract::Subject for OnTheCluster<'_> {
    type Backend = RedisBackend;

    async fn connect(&self, _test: &str) -> RedisBackend {
        let options = RedisOptions::default().cohort(common::contract::cohort(self.cohort));
        backend(&self.cluster.url(""), options).await
    }

    /// Each key's master comes from the cluster's slot map: there is no
    /// one link to cut (the failover tests stop masters instead).
    async fn connect_through_proxy(
        &self,
        _test: &str,
    ) -> Option<(Vec<common::fault_proxy::FaultProxy>, RedisBackend)> {
        None
    }

    fn serves_one_process_in_order(&self) -> bool {
        self.cohort
    }

    /// As on one server: no share without a cohort (redis/conformance.rs).
    fn takes_turns_across_processes(&self) -> bool {
        self.cohort
    }

    async fn assert_nothing_left(&self, _test: &str, _keys: &[String]) {
        common::contract::until_nothing_left("lock keys", || self.cluster.all_lock_keys()).await;
    }
}

/// The conformance suite on a cluster (`lock_all`'s keys fall on several
/// masters), with cohorting and without.
#[test]
fn conformance_with_cohorting_on_and_off() {
    common::contract::on_servers_of_its_own(
        RedisCluster::start("conformance"),
        |cluster, cohort| common::contract::every_contract_test(&OnTheCluster { cluster, cohort }),
    );
}
