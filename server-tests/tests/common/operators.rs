//! The conformance suite's tests of what an operator does from another
//! process (`common::contract` has the rest and instantiates them all):
//! inspect who holds a key, list the held keys, break a stuck holder.

use std::time::Duration;

use tower_lock::Backend;

use super::contract::{assert_left_free, key, runtime, Subject};

/// Another process sees the holder of a key (its token where the store
/// keeps one, its lease within the lease), the waiter where the server
/// counts waiters, and the key free once released.
pub fn another_process_sees_who_holds_a_key<S: Subject>(subject: &S) {
    const TEST: &str = "inspect";
    runtime(true).block_on(async {
        use tower_lock::{BackendExt, LockError, LockKey};
        let (a, b, c) = (
            subject.connect(TEST).await,
            subject.connect(TEST).await,
            subject.connect(TEST).await,
        );
        let k = key(subject, TEST, "k");
        let lock_key = LockKey::new(&k).unwrap();
        if !subject.inspects() {
            let e = b.inspect(lock_key).await.unwrap_err();
            assert!(matches!(e, LockError::Unsupported(_)), "{e:?}");
            return;
        }
        let free = b.inspect(lock_key.clone()).await.unwrap();
        assert!(!free.is_held(), "{}: {free:?}", a.name());
        let lease = Duration::from_secs(10);
        let held = a.lock(k.as_str()).lease(lease).await.unwrap();
        let seen = b.inspect(lock_key.clone()).await.unwrap();
        assert_eq!(seen.holders.len(), 1, "{}: {seen:?}", a.name());
        let holder = &seen.holders[0];
        if let Some(who) = subject.holder_identity(TEST) {
            let shown = holder.identity.as_deref().unwrap_or_default();
            assert!(shown.contains(&who), "{}: {shown:?} for {who:?}", a.name());
        }
        if let Some(token) = holder.token {
            assert_eq!(token, held.token(), "{}", a.name());
        }
        if let Some(left) = holder.lease_left {
            assert!(left <= lease, "{}: {left:?}", a.name());
        }
        let waiter = tokio::spawn({
            let (c, k) = (c.clone(), k.clone());
            async move {
                c.lock(k.as_str())
                    .wait(Duration::from_secs(30))
                    .await
                    .map(|g| g.token())
            }
        });
        if seen.waiters.is_some() {
            let mut tries = 0;
            while b.inspect(lock_key.clone()).await.unwrap().waiters < Some(1) {
                tries += 1;
                assert!(tries < 500, "{}: the waiter never showed", a.name());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let token = held.token();
        drop(held);
        assert!(waiter.await.unwrap().unwrap() > token);
        a.flush().await;
        c.flush().await;
        // Two readers, in two processes: both holders, in read mode.
        if a.capabilities().supports(tower_lock::LockMode::Read) {
            let r1 = a.lock(k.as_str()).read().await.unwrap();
            let r2 = c.lock(k.as_str()).read().await.unwrap();
            let seen = b.inspect(lock_key.clone()).await.unwrap();
            assert_eq!(seen.holders.len(), 2, "{}: {seen:?}", a.name());
            for h in &seen.holders {
                assert_eq!(
                    h.mode.unwrap_or(tower_lock::LockMode::Read),
                    tower_lock::LockMode::Read
                );
            }
            drop((r1, r2));
            a.flush().await;
            c.flush().await;
        }
        // Two permits of a semaphore, in two processes.
        let semaphore = tower_lock::LockMode::Semaphore { permits: 2 };
        if a.capabilities().supports(semaphore) && subject.inspects_semaphores() {
            let p1 = a.lock(k.as_str()).mode(semaphore).await.unwrap();
            let p2 = c.lock(k.as_str()).mode(semaphore).await.unwrap();
            let seen = b.inspect(lock_key.clone()).await.unwrap();
            assert_eq!(seen.holders.len(), 2, "{}: {seen:?}", a.name());
            drop((p1, p2));
            a.flush().await;
            c.flush().await;
        }
        let mut tries = 0;
        while b.inspect(lock_key.clone()).await.unwrap().is_held() {
            tries += 1;
            assert!(tries < 500, "{}: still held once released", a.name());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_left_free(subject, TEST, &[k]).await;
    })
}

/// An operator breaks a key held by another process: the floor returned
/// is above the holder's token, a fenced store that has seen it refuses
/// the broken holder's write, the next holder's token is at or above it,
/// and the broken holder's release frees nobody else's lock.
pub fn a_broken_holder_is_fenced_out<S: Subject>(subject: &S) {
    const TEST: &str = "break";
    runtime(true).block_on(async {
        use tower_lock::backend::BreakScope;
        use tower_lock::{BackendExt, LockError, LockKey};
        let (a, b, c) = (
            subject.connect(TEST).await,
            subject.connect(TEST).await,
            subject.connect(TEST).await,
        );
        let k = key(subject, TEST, "k");
        let lock_key = LockKey::new(&k).unwrap();
        let Some(scope) = subject.breaks_with() else {
            let e = b.break_lock(lock_key, BreakScope::LocksOnly).await;
            assert!(matches!(e, Err(LockError::Unsupported(_))), "{e:?}");
            return;
        };
        let held = a
            .lock(k.as_str())
            .lease(Duration::from_secs(10))
            .await
            .unwrap();
        let old = held.token();
        // A waiter in a third process, queued in the server where it
        // queues: its token may be fixed before the break.
        let waiter = tokio::spawn({
            let (c, k) = (c.clone(), k.clone());
            async move { c.lock(k.as_str()).wait(Duration::from_secs(20)).await }
        });
        let mut tries = 0;
        while b.inspect(lock_key.clone()).await.unwrap().waiters == Some(0) {
            tries += 1;
            assert!(tries < 500, "{}: the waiter never showed", a.name());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        if scope == BreakScope::Sessions {
            let e = b.break_lock(lock_key.clone(), BreakScope::LocksOnly).await;
            match e {
                Err(LockError::Unsupported(m)) => assert!(m.contains("--force"), "{m}"),
                e => panic!("{}: broken without ending a session: {e:?}", a.name()),
            }
            assert!(b.inspect(lock_key.clone()).await.unwrap().is_held());
        }
        let broken = b.break_lock(lock_key.clone(), scope).await.unwrap();
        assert_eq!(broken.holders.len(), 1, "{}: {broken:?}", a.name());
        assert!(
            broken.floor > old,
            "{}: floor {} under {old}",
            a.name(),
            broken.floor
        );
        // The fenced store, told the floor as the operator would: the
        // broken holder's write is refused, the next holder's accepted.
        let mut fence = broken.floor;
        let mut write = |token: tower_lock::FencingToken| {
            let ok = token >= fence;
            fence = fence.max(token);
            ok
        };
        assert!(!write(old), "{}: the broken holder wrote", a.name());
        let next = waiter
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{}: not free once broken: {e}", a.name()));
        assert!(
            next.token() >= broken.floor,
            "{}: the waiter's token {} under the floor {}",
            a.name(),
            next.token(),
            broken.floor
        );
        assert!(write(next.token()));
        // The broken holder lets go: the new holder keeps the key.
        drop(held);
        a.flush().await;
        let seen = b.inspect(lock_key.clone()).await.unwrap();
        assert_eq!(seen.holders.len(), 1, "{}: {seen:?}", a.name());
        let again = b.lock(k.as_str()).fail_fast().await;
        assert!(
            again.is_err(),
            "{}: the broken holder freed the next",
            a.name()
        );
        drop(next);
        b.flush().await;
        c.flush().await;
        assert_left_free(subject, TEST, &[k]).await;
    })
}

/// Another process lists the keys held under a prefix, and none once
/// they are released.
pub fn another_process_lists_the_held_keys<S: Subject>(subject: &S) {
    const TEST: &str = "list";
    runtime(true).block_on(async {
        use tower_lock::{BackendExt, LockError};
        let (a, b) = (subject.connect(TEST).await, subject.connect(TEST).await);
        let prefix = format!("{}:", subject.namespace(TEST));
        if !subject.lists() {
            let e = b.list(&prefix).await.unwrap_err();
            assert!(matches!(e, LockError::Unsupported(_)), "{e:?}");
            return;
        }
        // Several, so that a Redis Cluster holds them on several masters.
        let keys: Vec<String> = ["k1", "k{2}", "k3", "k4", "k5", "k6"]
            .iter()
            .map(|k| key(subject, TEST, k))
            .collect();
        let held = a.lock_all(keys.iter()).await.unwrap();
        let listed: Vec<String> = b
            .list(&prefix)
            .await
            .unwrap()
            .iter()
            .map(|k| k.to_string())
            .collect();
        let mut want = keys.clone();
        want.sort();
        assert_eq!(listed, want, "{}", a.name());
        held.release().await.unwrap();
        a.flush().await;
        let mut tries = 0;
        while !b.list(&prefix).await.unwrap().is_empty() {
            tries += 1;
            assert!(tries < 500, "{}: still listed once released", a.name());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_left_free(subject, TEST, &keys).await;
    })
}
