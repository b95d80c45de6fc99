//! How waiters learn of a release: notifications, or polling where they
//! cannot arrive, and what the waiters a release wakes write.

use super::*;

#[tokio::test]
async fn waiters_hear_the_release_and_poll_where_they_cannot() {
    let k = key("heard", "k");
    let holder = direct().await;
    // The listener's test notification has arrived once this is true.
    common::eventually("the direct listener hears its test notification", || {
        holder.hears_releases()
    })
    .await;
    let bounced_only = connect(&bouncer_url(), options()).await;
    let with_listener = bounced().await;
    common::eventually("the listener given a direct URL hears", || {
        with_listener.hears_releases()
    })
    .await;
    let listener_in_url = bounced_by_url().await;
    common::eventually("the listener the URL sends to the server hears", || {
        listener_in_url.hears_releases()
    })
    .await;
    // Through the pooler the test notification never comes (give it its
    // second to arrive).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!bounced_only.hears_releases());
    // The holder is a backend of its own: a waiter in the holder's process
    // would be handed the lock locally.
    let other = direct().await;
    for (waiter, hears) in [
        (&holder, true),
        (&bounced_only, false),
        (&with_listener, true),
        (&listener_in_url, true),
    ] {
        // A long lease: a waiter that got the lock before it ended heard
        // of (or polled for) the release.
        let g = other
            .lock(k.as_str())
            .lease(Duration::from_secs(60))
            .await
            .unwrap();
        let heard_before = waiter.releases_heard();
        let waiting = {
            let (w, k) = (waiter.clone(), k.clone());
            tokio::spawn(async move { w.lock(k.as_str()).wait(Duration::from_secs(30)).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let token = g.token();
        g.release().await.unwrap();
        let next = waiting.await.unwrap().unwrap();
        assert!(next.token() > token);
        // Woken by the release's notification, or (through the pooler) by
        // looking again.
        assert_eq!(waiter.releases_heard() > heard_before, hears);
        next.release().await.unwrap();
    }
    settle_free(&raw().await, &k).await;
}

/// Waits until `query` (one `int8`) answers `want`, for at most 10 s.
async fn until_answers(client: &tokio_postgres::Client, query: &str, want: i64, what: &str) {
    let mut got = 0;
    for _ in 0..1000 {
        got = client.query_one(query, &[]).await.unwrap().get::<_, i64>(0);
        if got == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: {got}, not {want}");
}

/// Waiters woken by one release write nothing but the winner's row: each
/// loser's write would queue on the row, with a commit and its WAL flush,
/// ahead of the winner's release. Counted by a trigger, on a table of the
/// test's own (left by a failed run: dropped first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_woken_by_a_release_write_only_the_winners_row() {
    let table = "tower_lock_leases_writes";
    let k = key("woken", "k");
    let client = raw().await;
    let drop_all = format!(
        "DROP TABLE IF EXISTS {table}; DROP SEQUENCE IF EXISTS {table}_writes; \
         DROP FUNCTION IF EXISTS {table}_count()"
    );
    client.batch_execute(&drop_all).await.unwrap();
    let url = pg_url();
    let open = || connect(&url, PostgresOptions::default().lease_table(table));
    let holder = open().await;
    client
        .batch_execute(&format!(
            "CREATE SEQUENCE {table}_writes; \
             CREATE FUNCTION {table}_count() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM nextval('{table}_writes'); RETURN NEW; END $$; \
             CREATE TRIGGER counted AFTER INSERT OR UPDATE ON {table} \
             FOR EACH ROW EXECUTE FUNCTION {table}_count()"
        ))
        .await
        .unwrap();
    let writes =
        format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {table}_writes");
    let count = || async {
        client
            .query_one(&writes, &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let mut held = holder
        .lock(k.as_str())
        .lease(Duration::from_secs(60))
        .await
        .unwrap();
    // Four replicas waiting: each a backend of its own, as a waiter in the
    // holder's process would be handed the lock locally.
    let (granted, mut grants) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..4 {
        let (waiter, k, granted) = (open().await, k.clone(), granted.clone());
        tokio::spawn(async move {
            let g = waiter
                .lock(k.as_str())
                .lease(Duration::from_secs(60))
                .wait(Duration::from_secs(30))
                .await
                .unwrap();
            granted.send(g).unwrap();
        });
    }
    drop(granted);
    // The holder's insert, and each waiter's mark on arrival.
    until_answers(&client, &writes, 5, "rows written before the first release").await;
    for round in 0..4 {
        let before = count().await;
        let token = held.token();
        held.release().await.unwrap();
        let next = grants.recv().await.expect("a waiter failed");
        assert!(next.token() > token);
        // The losers looked again, and wait again.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let written = count().await - before;
        assert_eq!(
            written, 1,
            "round {round}: {written} rows written for one grant"
        );
        held = next;
    }
    held.release().await.unwrap();
    let left = format!("SELECT count(*) FROM {table}");
    assert_eq!(
        client.query_one(&left, &[]).await.unwrap().get::<_, i64>(0),
        0
    );
    drop(holder);
    client.batch_execute(&drop_all).await.unwrap();
}

/// A newcomer that takes a released key before the woken waiter does
/// (here a row written by hand, as the library's statements would): the
/// waiter, which wrote nothing on waking, marks the newcomer's row, so that
/// its release notifies rather than leave the waiter to its recheck.
#[tokio::test]
async fn a_waiter_marks_the_row_of_a_newcomer_that_won_the_race() {
    let k = key("newcomer", "k");
    let client = raw().await;
    let waiter = direct().await;
    common::eventually("the listener hears", || waiter.hears_releases()).await;
    let row = |owner: &str| {
        format!(
            "INSERT INTO {TABLE} (key, owner, expires_at) \
             VALUES ('{k}', '{owner}', clock_timestamp() + interval '60 seconds')"
        )
    };
    let wanted = format!("SELECT count(*) FROM {TABLE} WHERE key = '{k}' AND wanted");
    client.batch_execute(&row("first")).await.unwrap();
    let waiting = {
        let (w, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move { w.lock(k.as_str()).wait(Duration::from_secs(30)).await })
    };
    until_answers(
        &client,
        &wanted,
        1,
        "the waiter marked the first holder's row",
    )
    .await;
    // The first holder's release (which notifies: its row was marked) and
    // the newcomer's grant, in one transaction: no try of the waiter's
    // comes between them.
    client
        .batch_execute(&format!(
            "BEGIN; DELETE FROM {TABLE} WHERE key = '{k}'; {}; \
             SELECT pg_notify('{TABLE}', '{k}'); COMMIT",
            row("newcomer")
        ))
        .await
        .unwrap();
    until_answers(&client, &wanted, 1, "the waiter marked the newcomer's row").await;
    let heard = waiter.releases_heard();
    // The newcomer's release, as the library's: it notifies if marked.
    client
        .batch_execute(&format!(
            "DELETE FROM {TABLE} WHERE key = '{k}' AND owner = 'newcomer' \
             RETURNING CASE WHEN wanted THEN pg_notify('{TABLE}', key) END"
        ))
        .await
        .unwrap();
    let g = waiting.await.unwrap().unwrap();
    assert!(
        waiter.releases_heard() > heard,
        "woken by its recheck, not by the release"
    );
    g.release().await.unwrap();
    settle_free(&client, &k).await;
}

/// Through a pooler in transaction mode, a listener trusts only its own
/// test notification. Others' on the same channel (other replicas starting)
/// can reach it inside its `LISTEN`'s transaction: taken for its own, they
/// made it believe sessions were kept and prepare named statements, which
/// then failed on other server sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_listeners_own_test_notification_counts() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let k = key("foreign-probes", "k");
    let stop = Arc::new(AtomicBool::new(false));
    // Others' test notifications, as fast as one connection sends them: an
    // earlier version's (empty) and this one's form, with another nonce.
    let flood = {
        let (client, stop) = (raw().await, stop.clone());
        tokio::spawn(async move {
            let notify = format!("NOTIFY {TABLE}, ''; NOTIFY {TABLE}, '/probe/0'");
            while !stop.load(Ordering::Relaxed) {
                client.batch_execute(&notify).await.unwrap();
            }
        })
    };
    // Three rounds of eight: under this flood a foreign notification
    // reaches a listener in some of its `LISTEN`s, so that the old
    // protocol fails here all but surely.
    for round in 0..3 {
        let mut backends = Vec::new();
        for _ in 0..8 {
            backends.push(connect(&bouncer_url(), options()).await);
        }
        // Each listener's own test notification has had its second.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for (i, b) in backends.iter().enumerate() {
            assert!(
                !b.hears_releases(),
                "round {round}: listener {i} took another's test notification for its own"
            );
            b.lock(k.as_str()).await.unwrap().release().await.unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    flood.await.unwrap();
    settle_free(&raw().await, &k).await;
}
