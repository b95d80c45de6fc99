//! The lease table's listener: release notifications, the test
//! notification that tells whether they arrive (and whether the statement
//! URL's sessions are kept), and the waiters' wake-ups.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::super::session::pg_error;
use super::{connect, LeaseTable, Stmt, MAX_RECHECK, POLL_RECHECK};
use crate::error::LockError;
use crate::sync::lock;

/// How a test notification's payload begins. Each carries a nonce:
/// through a pooler in transaction mode, another backend's (or an earlier
/// listener's) can reach a listener inside its `LISTEN`'s transaction, and
/// taken for its own, would make it believe the pooler's sessions are
/// kept.
const PROBE: &str = "/probe/";
/// How long the listener waits for its own test notification.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long after a test notification that did not arrive the listener
/// tries again.
const PROBE_AGAIN: Duration = Duration::from_secs(30);

impl LeaseTable {
    /// The local waiters' wake-up for `key`.
    pub(super) fn watch(self: &Arc<Self>, key: &str) -> Watch {
        let mut waiters = lock(&self.waiters);
        let notify = match waiters.get(key).and_then(Weak::upgrade) {
            Some(n) => n,
            None => {
                let n = Arc::new(Notify::new());
                waiters.insert(key.to_owned(), Arc::downgrade(&n));
                n
            }
        };
        Watch {
            table: self.clone(),
            key: key.to_owned(),
            notify,
        }
    }

    /// A notification: `key` was released (or swept), or a test
    /// notification: this listener's own, or another's (of another
    /// backend, or one before this listener's: only the latest counts).
    pub(super) fn heard(&self, key: &str) {
        // Another's test notification goes on as a key, which no waiter
        // has: so no key, however made, is ever taken for a probe.
        if key.starts_with(PROBE) && *lock(&self.probe_payload) == key {
            self.probe.notify_waiters();
            return;
        }
        // Under the lock: no `Arc` of a watch outlives it here, so a
        // `Watch` dropped meanwhile sees it is the last and leaves the map.
        let waiters = lock(&self.waiters);
        if let Some(n) = waiters.get(key).and_then(Weak::upgrade) {
            n.notify_waiters();
            self.heard.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Listens on `listener`, and says whether a test notification sent on
    /// the statement connection arrives there.
    async fn probe(&self, listener: &Client) -> Result<bool, LockError> {
        let payload = format!("{PROBE}{}", self.owners.next());
        lock(&self.probe_payload).clone_from(&payload);
        let probe = self.probe.notified();
        tokio::pin!(probe);
        probe.as_mut().enable();
        listener
            .batch_execute(&self.sql.listen)
            .await
            .map_err(|e| pg_error("listening for releases", e))?;
        self.query(
            "",
            Stmt::Probe,
            &[(&payload, Type::TEXT)],
            "sending a test notification",
        )
        .await?;
        Ok(tokio::time::timeout(PROBE_TIMEOUT, probe).await.is_ok())
    }

    /// Wakes every waiter: a release may have gone unheard.
    pub(super) fn wake_all(&self) {
        // Under the lock, as in `heard`.
        let waiters = lock(&self.waiters);
        for n in waiters.values().filter_map(Weak::upgrade) {
            n.notify_waiters();
        }
    }
}

/// Keeps a connection listening for release notifications, and says
/// whether they arrive: a pooler in transaction mode between the listener
/// and the server runs `LISTEN` on a session the listener does not keep,
/// and then waiters look again every [`POLL_RECHECK`] instead.
pub(super) async fn listen(table: Weak<LeaseTable>) {
    let mut pause = Duration::from_millis(50);
    let mut warned = false;
    loop {
        let Some(t) = table.upgrade() else { return };
        let (config, target, timeout) =
            (t.listen_config.clone(), t.target.clone(), t.connect_timeout);
        drop(t);
        let (client, driver) = match connect(&config, &target, timeout, Some(table.clone())).await {
            Ok(opened) => opened,
            Err(e) => {
                tracing::debug!(error = %e, "the PostgreSQL listener could not connect");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_RECHECK);
                continue;
            }
        };
        let Some(t) = table.upgrade() else { return };
        match t.probe(&client).await {
            Ok(true) => {}
            Ok(false) => {
                if !warned {
                    tracing::warn!(
                        target = t.target,
                        "PostgreSQL notifications do not arrive (a pooler in transaction \
                         mode? see PostgresOptions::listen_url): lock waiters look again \
                         every {} ms",
                        POLL_RECHECK.as_millis()
                    );
                    warned = true;
                }
                // Straight to a slow server, this ends the `LISTEN`. Behind
                // a pooler it runs on whichever session the pooler picks:
                // the one that ran the `LISTEN` may keep listening until
                // the pooler closes it (the pooler drops what it hears
                // while no client is linked, and the statement
                // connections ignore notifications). Try again later (a
                // slow server may only have been late).
                let _ = client.batch_execute("UNLISTEN *").await;
                drop((t, client));
                tokio::time::sleep(PROBE_AGAIN).await;
                continue;
            }
            Err(e) => {
                tracing::debug!(error = %e, "the PostgreSQL listener failed");
                drop(t);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_RECHECK);
                continue;
            }
        }
        pause = Duration::from_millis(50);
        t.notified.store(true, Ordering::Release);
        if t.listens_there {
            t.sessions_kept.store(true, Ordering::Release);
        }
        // Released while not listening: every waiter looks again.
        t.wake_all();
        drop(t);
        // Until the connection ends (this task is stopped with the
        // backend).
        let _ = driver.await;
        drop(client);
        if let Some(t) = table.upgrade() {
            t.notified.store(false, Ordering::Release);
            t.wake_all();
        }
    }
}

/// A waiter's wake-up, shared by the local waiters of one key.
pub(super) struct Watch {
    table: Arc<LeaseTable>,
    key: String,
    pub(super) notify: Arc<Notify>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut waiters = lock(&self.table.waiters);
        // Clones are made under this lock, or are a hand-off's, dropped
        // before its own watch (`hand_off::Armed`): the last one leaves.
        if Arc::strong_count(&self.notify) == 1 {
            waiters.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload that begins as a test notification does but is not this
    /// listener's own latest is looked up as a key: no key can take that
    /// shape today (`/` is refused in keys and namespaces alike), but the
    /// listener does not lean on the key rules to never swallow a release.
    #[tokio::test]
    async fn a_payload_not_this_listeners_test_notification_is_a_key() {
        let config = tokio_postgres::Config::new();
        let table = LeaseTable::new(config, None, "test".into(), MAX_RECHECK, "t", "s");
        lock(&table.probe_payload).clone_from(&format!("{PROBE}0123"));
        let key = format!("{PROBE}x:k");
        let watch = table.watch(&key);
        let woken = watch.notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        table.heard(&key);
        assert_eq!(table.releases_heard(), 1);
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .expect("the key's waiter was woken");
    }
}
