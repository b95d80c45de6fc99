//! One contender key: created under the lock's prefix, waiting for the keys
//! before it to go, re-checked, held as a lease, deleted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse,
};

use super::session::{etcd_error, lock, retry, retry_while, Session};
use crate::backend::lease::{Protocol, Released};
use crate::error::LockError;
use crate::mode::Wait;

/// The value of a reader's key. Any other value (`etcdctl lock` writes an
/// empty one) is an exclusive or write contender.
pub(super) const READER: &[u8] = b"read";

/// A contender key this process created (or is creating). Dropped before it
/// is held or deleted, it deletes itself in the background.
pub(super) struct Contender {
    session: Arc<Session>,
    pub(super) key: String,
    /// The key's create revision, once the create answered.
    pub(super) revision: i64,
    /// Held, deleted, or never created: nothing left to clean up.
    done: bool,
}

/// What the queue before a contender says.
enum Ahead {
    /// Nothing blocks it: the lock is granted.
    Nothing,
    /// Wait for this key's deletion.
    Key(Vec<u8>),
}

impl Session {
    /// Creates our key `key` under `prefix` and waits until nothing before
    /// it blocks a contender of its kind (a reader waits for writers only).
    ///
    /// Go's `concurrency.Mutex` (and so `etcdctl lock`) does the same on the
    /// same prefix: keys are served in create-revision order whoever made
    /// them, so both queue together.
    pub(super) async fn contend(
        self: &Arc<Self>,
        prefix: &str,
        key: String,
        reader: bool,
        wait: Wait,
    ) -> Result<Contender, LockError> {
        let mut contender = Contender {
            session: self.clone(),
            key,
            revision: 0,
            done: false,
        };
        let mut ahead = contender.create(prefix, reader).await?;
        let mut waited = false;
        if matches!(ahead, Ahead::Key(..)) {
            if wait == Wait::FailFast {
                contender.delete().await?;
                return Err(LockError::Busy);
            }
            // A writer's create read only the head of the queue: find the
            // key just before ours, so that one deletion wakes one waiter.
            if !reader {
                ahead = contender.ahead(prefix, reader).await?;
            }
        }
        while let Ahead::Key(blocker) = ahead {
            waited = true;
            self.deleted(&blocker).await?;
            ahead = contender.ahead(prefix, reader).await?;
        }
        if waited {
            contender.still_ours().await?;
        }
        Ok(contender)
    }

    /// Waits until `key` is deleted (or is found gone).
    ///
    /// The watch starts at the current revision, not at `seen`: etcd serves
    /// a watch that starts in the past from a catch-up loop that runs every
    /// 100 ms, which would add that much to every handoff between
    /// processes. Once the watch is registered, one read tells whether the
    /// key went in between.
    async fn deleted(&self, key: &[u8]) -> Result<(), LockError> {
        let watch = self.client.watch_client();
        let mut stream = retry(self, "watching the key ahead", || {
            let mut watch = watch.clone();
            async move { watch.watch(key.to_vec(), None).await }
        })
        .await?;
        let kv = self.client.kv_client();
        self.unless_ended(async {
            let mut registered = false;
            loop {
                let answer = match stream.message().await {
                    Ok(Some(answer)) => answer,
                    // The stream broke: look again.
                    Ok(None) | Err(_) => return,
                };
                let gone = answer
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete);
                if gone || answer.canceled() {
                    return;
                }
                if answer.created() && !registered {
                    registered = true;
                    let read = kv
                        .clone()
                        .get(key.to_vec(), Some(GetOptions::new().with_count_only()))
                        .await;
                    // Gone already, or unknown: look again.
                    if read.map_or(true, |r| r.count() == 0) {
                        return;
                    }
                }
            }
        })
        .await
    }
}

impl Contender {
    /// Creates the key (idempotently: sent again after a lost answer, it
    /// finds the key it made) and reads the queue in the same transaction.
    async fn create(&mut self, prefix: &str, reader: bool) -> Result<Ahead, LockError> {
        let session = self.session.clone();
        let value = if reader { READER } else { b"" };
        // The first writer, or for a reader every key: after the put, so
        // they include ours.
        let queue = if reader {
            by_create(SortOrder::Ascend)
        } else {
            by_create(SortOrder::Ascend).with_limit(1)
        };
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(
                    self.key.as_str(),
                    value,
                    Some(PutOptions::new().with_lease(session.lease)),
                ),
                TxnOp::get(prefix, Some(queue.clone())),
            ])
            .or_else([
                TxnOp::get(self.key.as_str(), None),
                TxnOp::get(prefix, Some(queue)),
            ]);
        let kv = session.client.kv_client();
        let answer = retry(&session, "creating the lock key", || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await?;
        let store = answer.header().map_or(0, |h| h.revision());
        let mut responses = answer.op_responses().into_iter();
        let first = responses.next();
        self.revision = match (answer.succeeded(), first) {
            (true, _) => store,
            (false, Some(TxnOpResponse::Get(own))) => match own.kvs().first() {
                Some(kv) if kv.lease() == session.lease => kv.create_revision(),
                _ => {
                    // Someone else's key under our name: never ours to delete.
                    self.done = true;
                    return Err(LockError::backend(
                        "etcd",
                        format!("the lock key {} exists under another lease", self.key),
                        None,
                    ));
                }
            },
            _ => return Err(unexpected()),
        };
        let Some(TxnOpResponse::Get(queue)) = responses.next() else {
            return Err(unexpected());
        };
        Ok(self.blocker(queue.kvs().iter().rev(), reader))
    }

    /// Reads the queue before our key again.
    async fn ahead(&self, prefix: &str, reader: bool) -> Result<Ahead, LockError> {
        let mut options = by_create(SortOrder::Descend).with_max_create_revision(self.revision - 1);
        if !reader {
            options = options.with_limit(1);
        }
        let kv = self.session.client.kv_client();
        let answer = retry(&self.session, "reading the lock queue", || {
            let (mut kv, options) = (kv.clone(), options.clone());
            async move { kv.get(prefix, Some(options)).await }
        })
        .await?;
        Ok(self.blocker(answer.kvs().iter(), reader))
    }

    /// The nearest key before ours that blocks us, from `kvs` nearest
    /// first.
    fn blocker<'a>(&self, kvs: impl Iterator<Item = &'a KeyValue>, reader: bool) -> Ahead {
        kvs.filter(|kv| kv.create_revision() < self.revision)
            .find(|kv| !reader || kv.value() != READER)
            .map_or(Ahead::Nothing, |kv| Ahead::Key(kv.key().to_vec()))
    }

    /// After a wait: our key must still be there, under our lease, and the
    /// lease known alive. etcd's own lock once granted after the lease had
    /// expired (Jepsen's etcd 3.4.3 analysis, etcd issue 11456); a
    /// linearizable read of the key rules that out.
    async fn still_ours(&self) -> Result<(), LockError> {
        let session = &self.session;
        let kv = session.client.kv_client();
        let answer = retry(session, "reading our lock key", || {
            let mut kv = kv.clone();
            async move { kv.get(self.key.as_str(), None).await }
        })
        .await?;
        let ours = answer
            .kvs()
            .first()
            .is_some_and(|kv| kv.lease() == session.lease && kv.create_revision() == self.revision);
        if !ours || !session.usable() {
            return Err(LockError::Lost(format!(
                "the etcd lock key {} went with its lease while waiting",
                self.key
            )));
        }
        Ok(())
    }

    /// Deletes the key now. Cancelled, the drop finishes the job.
    pub(super) async fn delete(mut self) -> Result<(), LockError> {
        delete_until_done(&self.session, &self.key, None).await?;
        self.done = true;
        Ok(())
    }

    /// The granted key as a held lock: from here on the lease deletes it.
    pub(super) fn into_lock(mut self) -> EtcdLock {
        self.done = true;
        EtcdLock {
            session: self.session.clone(),
            key: std::mem::take(&mut self.key),
        }
    }
}

fn by_create(order: SortOrder) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, order)
}

fn unexpected() -> LockError {
    LockError::backend("etcd", "unexpected answer to the lock transaction", None)
}

impl Drop for Contender {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let session = self.session.clone();
        let key = std::mem::take(&mut self.key);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("etcd lock key dropped outside a Tokio runtime; it goes with the lease");
            return;
        };
        session.releases.clone().spawn(&rt, async move {
            if let Err(e) = delete_until_done(&session, &key, None).await {
                tracing::warn!(key, error = %e, "deleting an etcd lock key failed");
            }
        });
    }
}

/// Deletes `key`, retrying through uncertain failures while the lease may
/// still hold it (until `deadline`, if given, once the lease has ended).
async fn delete_until_done(
    session: &Session,
    key: &str,
    deadline: Option<Instant>,
) -> Result<(), LockError> {
    let kv = session.client.kv_client();
    let go_on = |s: &Session| {
        !s.ended.load(Ordering::Acquire) || deadline.is_some_and(|d| Instant::now() < d)
    };
    retry_while(session, go_on, || {
        let mut kv = kv.clone();
        async move { kv.delete(key, None).await }
    })
    .await
    .map(drop)
    .map_err(|e| etcd_error("deleting the lock key", e))
}

/// A held lock key. Its lease is the session's, kept alive by it;
/// releasing deletes the key.
pub(super) struct EtcdLock {
    pub(super) session: Arc<Session>,
    pub(super) key: String,
}

impl EtcdLock {
    /// Forgets the key in the session's list of holds: it is being deleted.
    fn unlist(&self) {
        lock(&self.session.holds).remove(&self.key);
    }
}

impl Protocol for EtcdLock {
    const BACKEND: &'static str = "etcd";
    const EXPIRED: &'static str = "the etcd lease is no longer known alive (no answer in time)";

    fn describe(&self) -> &str {
        &self.key
    }

    /// Never called: the lock is not renewed, its lease is kept alive for
    /// all of a backend's locks.
    async fn renew(&self, _lease: std::time::Duration) -> Result<(), String> {
        Ok(())
    }

    /// One delete, sent when first polled; sent again at once when it
    /// could not be delivered (a member is down and the client has not yet
    /// moved to another), until the lease ends.
    async fn release(&self) -> Released {
        self.unlist();
        match delete_until_done(&self.session, &self.key, None).await {
            Ok(()) => Released {
                result: Ok(()),
                again: false,
            },
            Err(e) => Released {
                // It may not have run: go on trying in the background.
                result: Err(e),
                again: true,
            },
        }
    }

    /// Deletes until done, or the lease has ended and `deadline` passed.
    async fn release_until(&self, deadline: Instant) -> Result<(), LockError> {
        self.unlist();
        delete_until_done(&self.session, &self.key, Some(deadline)).await
    }
}
