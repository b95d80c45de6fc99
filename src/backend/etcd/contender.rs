//! One contender key: created under the lock's prefix, waiting for the keys
//! before it to go, re-checked, held as a lease, deleted.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse,
};

use super::session::{etcd_error, retry, retry_while, uncertain, Session};
use crate::backend::engine::lease::{Protocol, Released};
use crate::error::LockError;
use crate::mode::Wait;
use crate::sync::lock;

/// How a reader's key value starts. Any other value (`etcdctl lock` writes
/// an empty one) is an exclusive or write contender.
const READER: &[u8] = b"read";

/// Whether a contender key's value marks a reader.
pub(super) fn is_reader(value: &[u8]) -> bool {
    value.starts_with(READER)
}

/// A contender key name of this lease, `<prefix><lease>-<n>` with the lowest
/// `n` not in use, so that names are reused: etcd keeps every key name it
/// has seen in its index until the history is compacted, and the queue
/// reads scan the prefix.
///
/// In use from before the key is created until its delete has been
/// answered (or its lease ended): a name is never put again while a delete
/// of the previous key of that name may still be in flight.
pub(super) struct Slot {
    session: Arc<Session>,
    pub(super) name: String,
}

impl Session {
    pub(super) fn slot(self: &Arc<Self>, prefix: &str) -> Slot {
        let mut in_use = lock(&self.slots);
        let name = (0u32..)
            .map(|n| format!("{prefix}{:x}-{n}", self.lease))
            .find(|name| !in_use.contains(name))
            .unwrap_or_default();
        in_use.insert(name.clone());
        Slot {
            session: self.clone(),
            name,
        }
    }

    /// A key of this lease that no contender of this process owns: the
    /// create of a cancelled or uncertain attempt that applied after its
    /// delete. Left there, it would block the lock while the lease lives.
    fn is_stray(&self, kv: &KeyValue) -> bool {
        kv.lease() == self.lease
            && kv
                .key_str()
                .is_ok_and(|name| !lock(&self.slots).contains(name))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.session.slots).remove(&self.name);
    }
}

/// A contender key this process created (or is creating). Dropped before it
/// is held or deleted, it deletes itself in the background, after its
/// create has been answered.
pub(super) struct Contender {
    session: Arc<Session>,
    /// Taken when the key becomes a held lock.
    slot: Option<Slot>,
    /// The key's create revision, once the create answered.
    pub(super) revision: i64,
    /// The create while it runs. Dropped before its answer, the contender
    /// hands it to a task that awaits the answer before the delete: a
    /// delete sent earlier could be applied first (one client's requests
    /// travel on concurrent HTTP/2 streams, maybe to different members),
    /// leaving the key on the live lease.
    /// (In a mutex only so that the contender is `Sync`; reached through
    /// `&mut`, never locked.)
    creating: std::sync::Mutex<Option<CreateFuture>>,
    /// Held, deleted, or never created: nothing left to clean up.
    done: bool,
}

type CreateFuture = Pin<Box<dyn Future<Output = Result<Created, LockError>> + Send>>;

/// The answer to the create.
enum Created {
    /// Our key's revision and the queue read with it.
    Ours { revision: i64, queue: Vec<KeyValue> },
    /// A key of another lease has our key's name.
    Taken,
}

/// What the queue before a contender says.
enum Ahead {
    /// Nothing blocks it: the lock is granted.
    Nothing,
    /// Wait for the deletion of this key (of this create revision: a key
    /// of the same name made later, as Go's mutex names its key after its
    /// lease alone, is another contender, behind us).
    Key(Vec<u8>, i64),
    /// A key of our own lease that no contender owns: delete it.
    Stray(Vec<u8>, i64),
}

impl Session {
    /// Creates a contender key under `prefix` and waits until nothing
    /// before it blocks a contender of its kind (a reader waits for writers
    /// only).
    ///
    /// Go's `concurrency.Mutex` (and so `etcdctl lock`) does the same on the
    /// same prefix: keys are served in create-revision order whoever made
    /// them, so both queue together.
    pub(super) async fn contend(
        self: &Arc<Self>,
        prefix: &str,
        value: Vec<u8>,
        wait: Wait,
    ) -> Result<Contender, LockError> {
        let reader = is_reader(&value);
        let mut contender = Contender {
            session: self.clone(),
            slot: Some(self.slot(prefix)),
            revision: 0,
            creating: Default::default(),
            done: false,
        };
        let mut ahead = contender.create(prefix, value).await?;
        // A writer's create read only the head of the queue; `ahead` finds
        // the key just before ours, so that one deletion wakes one waiter.
        let mut nearest = reader;
        let mut waited = false;
        let mut pause = Duration::ZERO;
        loop {
            match ahead {
                Ahead::Nothing => break,
                Ahead::Stray(key, revision) => contender.delete_stray(key, revision).await?,
                Ahead::Key(..) if wait == Wait::FailFast => {
                    contender.delete().await?;
                    return Err(LockError::Busy);
                }
                Ahead::Key(..) if !nearest => {}
                Ahead::Key(blocker, revision) => {
                    waited = true;
                    if self.deleted(&blocker, revision).await? {
                        pause = Duration::ZERO;
                    } else {
                        // The watch ended without news while the key is
                        // still there: do not spin on a failing watch.
                        pause = (pause * 2).clamp(Duration::from_millis(10), RETRY_CAP);
                        self.unless_ended(tokio::time::sleep(pause)).await?;
                    }
                }
            }
            ahead = contender.ahead(prefix, reader).await?;
            nearest = true;
        }
        if waited {
            contender.still_ours().await?;
        }
        Ok(contender)
    }

    /// Waits until `key`, as created at `revision`, is deleted (or is found
    /// gone). False when the watch ended without telling.
    ///
    /// The watch starts at the current revision, not at the blocker's: etcd
    /// serves a watch that starts in the past from a catch-up loop that
    /// runs every 100 ms, which would add that much to every handoff
    /// between processes. Once the watch is registered, one read tells
    /// whether the key went in between.
    async fn deleted(&self, key: &[u8], revision: i64) -> Result<bool, LockError> {
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
                    Ok(None) | Err(_) => return false,
                };
                let gone = answer.events().iter().any(|e| {
                    e.event_type() == EventType::Delete
                        || e.kv().is_some_and(|kv| kv.create_revision() != revision)
                });
                if gone {
                    return true;
                }
                if answer.canceled() {
                    return false;
                }
                if answer.created() && !registered {
                    registered = true;
                    let read = kv
                        .clone()
                        .get(key.to_vec(), Some(GetOptions::new().with_keys_only()))
                        .await;
                    match read {
                        Ok(read) => {
                            let there = read.kvs().first();
                            if there.is_none_or(|kv| kv.create_revision() != revision) {
                                return true;
                            }
                        }
                        Err(_) => return false,
                    }
                }
            }
        })
        .await
    }
}

/// The longest pause between two watches of a key that stays.
const RETRY_CAP: Duration = Duration::from_millis(500);

impl Contender {
    fn key(&self) -> &str {
        self.slot.as_ref().map_or("", |slot| &slot.name)
    }

    /// Creates the key and reads the queue in the same transaction.
    async fn create(&mut self, prefix: &str, value: Vec<u8>) -> Result<Ahead, LockError> {
        let reader = is_reader(&value);
        let future = Box::pin(create(
            self.session.clone(),
            self.key().to_owned(),
            value,
            prefix.to_owned(),
        ));
        let creating = self.creating.get_mut().unwrap_or_else(|e| e.into_inner());
        let created = creating.insert(future).await;
        *creating = None;
        match created? {
            Created::Ours { revision, queue } => {
                self.revision = revision;
                Ok(self.blocker(queue.iter().rev(), reader))
            }
            Created::Taken => {
                // Someone else's key under our name: never ours to delete.
                self.done = true;
                Err(LockError::backend(
                    "etcd",
                    format!("the lock key {} exists under another lease", self.key()),
                    None,
                ))
            }
        }
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

    /// The nearest key before ours that blocks us (or that is a stray of
    /// our lease), from `kvs` nearest first.
    fn blocker<'a>(&self, kvs: impl Iterator<Item = &'a KeyValue>, reader: bool) -> Ahead {
        for kv in kvs.filter(|kv| kv.create_revision() < self.revision) {
            let (key, revision) = (kv.key().to_vec(), kv.create_revision());
            if self.session.is_stray(kv) {
                return Ahead::Stray(key, revision);
            }
            if !reader || !is_reader(kv.value()) {
                return Ahead::Key(key, revision);
            }
        }
        Ahead::Nothing
    }

    async fn delete_stray(&self, key: Vec<u8>, revision: i64) -> Result<(), LockError> {
        let key = String::from_utf8_lossy(&key).into_owned();
        tracing::warn!(
            key,
            "deleting an etcd lock key of this lease that no acquisition owns"
        );
        delete_if_created_at(&self.session, &key, revision).await
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
            async move {
                kv.get(self.key(), Some(GetOptions::new().with_keys_only()))
                    .await
            }
        })
        .await?;
        let ours = answer
            .kvs()
            .first()
            .is_some_and(|kv| kv.lease() == session.lease && kv.create_revision() == self.revision);
        if !ours || !session.usable() {
            return Err(LockError::Lost(format!(
                "the etcd lock key {} went with its lease while waiting",
                self.key()
            )));
        }
        Ok(())
    }

    /// Deletes the key now. Cancelled, the drop finishes the job.
    pub(super) async fn delete(mut self) -> Result<(), LockError> {
        delete_until_done(
            &self.session,
            self.key(),
            Some(self.revision),
            Until::Answered,
        )
        .await?;
        self.done = true;
        Ok(())
    }

    /// The granted key as a held lock: from here on the lease deletes it.
    pub(super) fn into_lock(mut self) -> EtcdLock {
        self.done = true;
        EtcdLock {
            session: self.session.clone(),
            slot: self
                .slot
                .take()
                .expect("a contender keeps its slot until held"),
            revision: self.revision,
        }
    }
}

/// The create transaction, sent again after failures without an answer:
/// puts the key if it does not exist, and reads the queue. Finding the key
/// with our value, an earlier attempt applied: the key is ours. Finding a
/// key of our lease with another value (left from an earlier use of the
/// name whose delete failed), deletes it and puts ours.
async fn create(
    session: Arc<Session>,
    key: String,
    value: Vec<u8>,
    prefix: String,
) -> Result<Created, LockError> {
    // The first writer, or for a reader every key: after the put, so they
    // include ours.
    let queue = || match is_reader(&value) {
        true => by_create(SortOrder::Ascend),
        false => by_create(SortOrder::Ascend).with_limit(1),
    };
    // Made for each attempt rather than cloned: the first, nearly always
    // the only one, then costs one build, not a build and a copy of every
    // key and value in it (some twenty allocations).
    let txn = || {
        let put = PutOptions::new().with_lease(session.lease);
        Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key.as_str(), value.clone(), Some(put)),
                TxnOp::get(prefix.as_str(), Some(queue())),
            ])
            .or_else([
                TxnOp::get(key.as_str(), None),
                TxnOp::get(prefix.as_str(), Some(queue())),
            ])
    };
    loop {
        let answer = retry(&session, "creating the lock key", || {
            // A client per attempt, cloned from the session's (each clone
            // of its channel allocates): not one kept here and cloned again.
            let (mut kv, txn) = (session.client.kv_client(), txn());
            async move { kv.txn(txn).await }
        })
        .await?;
        let store = answer.header().map_or(0, |h| h.revision());
        let mut responses = answer.op_responses().into_iter();
        let first = responses.next();
        let Some(TxnOpResponse::Get(mut queue)) = responses.next() else {
            return Err(unexpected());
        };
        let revision = match (answer.succeeded(), first) {
            (true, _) => store,
            (false, Some(TxnOpResponse::Get(own))) => match own.kvs().first() {
                // Deleted in between: put again.
                None => continue,
                Some(kv) if kv.lease() != session.lease => return Ok(Created::Taken),
                Some(kv) if kv.value() == value => kv.create_revision(),
                Some(kv) => {
                    delete_if_created_at(&session, &key, kv.create_revision()).await?;
                    continue;
                }
            },
            _ => return Err(unexpected()),
        };
        return Ok(Created::Ours {
            revision,
            queue: queue.take_kvs(),
        });
    }
}

/// Deletes `key` if it is still the key created at `revision`, not one put
/// under that name since.
async fn delete_if_created_at(
    session: &Session,
    key: &str,
    revision: i64,
) -> Result<(), LockError> {
    retry(session, "deleting a stray lock key", || {
        let (mut kv, txn) = (
            session.client.kv_client(),
            delete_if_created_at_txn(key, revision),
        );
        async move { kv.txn(txn).await }
    })
    .await
    .map(drop)
}

/// Deletes `key` only if it was created at `revision`.
fn delete_if_created_at_txn(key: &str, revision: i64) -> Txn {
    Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
        .and_then([TxnOp::delete(key, None)])
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
        let creating = self.creating.get_mut().unwrap_or_else(|e| e.into_inner());
        let (Some(slot), creating) = (self.slot.take(), creating.take()) else {
            return;
        };
        let session = self.session.clone();
        let Some(rt) = session.releases.runtime() else {
            tracing::warn!("etcd lock key dropped outside a Tokio runtime; it goes with the lease");
            return;
        };
        session.releases.clone().spawn(&rt, async move {
            // The create's answer first: a delete applied before the
            // create would leave the key behind.
            if let Some(creating) = creating {
                if let Ok(Created::Taken) = creating.await {
                    return;
                }
            }
            // The key's revision may be unknown (the create failed without
            // an answer): whatever holds the name is ours, as it is not
            // put again before this delete ends.
            if let Err(e) = delete_until_done(&session, &slot.name, None, Until::Gone(None)).await {
                tracing::warn!(key = slot.name, error = %e, "deleting an etcd lock key failed");
            }
            // Only now may the name be put again.
            drop(slot);
        });
    }
}

/// Who waits for a delete of a lock key, and so how long it goes on.
#[derive(Clone, Copy)]
enum Until {
    /// A caller waits for the answer: sent again after failures that may
    /// not have been applied, while the lease lasts; a refusal is returned
    /// (and the background goes on, [`Until::Gone`]).
    Answered,
    /// In the background: sent again after failures that may not have been
    /// applied while the lease may hold the key (and once it has ended,
    /// until the deadline, if given). A key left in place keeps the lock
    /// from every contender until the lease ends, so a refusal (too many
    /// requests) is asked again too, for one lease TTL: one that lasts
    /// longer will not pass, and the task ends, so that dropping the
    /// backend still revokes the lease and frees the key.
    Gone(Option<Instant>),
}

/// Deletes `key` (with `created_at`, only the key created at that revision:
/// an attempt that timed out may still be applied after a later one was
/// answered and the name put again, and must not delete the new key).
async fn delete_until_done(
    session: &Session,
    key: &str,
    created_at: Option<i64>,
    until: Until,
) -> Result<(), LockError> {
    let call = || {
        // Made anew for each attempt, as in `create`.
        let txn = created_at.map(|revision| delete_if_created_at_txn(key, revision));
        let mut kv = session.client.kv_client();
        async move {
            match txn {
                Some(txn) => kv.txn(txn).await.map(drop),
                None => kv.delete(key, None).await.map(drop),
            }
        }
    };
    let live = |s: &Session| !s.ended.load(Ordering::Acquire);
    let result = match until {
        Until::Answered => retry_while(session, live, call).await,
        Until::Gone(deadline) => {
            let go_on = || live(session) || deadline.is_some_and(|d| Instant::now() < d);
            let refused_since = std::cell::Cell::new(None);
            let ttl = session.ttl;
            let again = move |e: &etcd_client::Error| {
                if uncertain(e) {
                    return true;
                }
                let since = match refused_since.get() {
                    Some(since) => since,
                    None => {
                        tracing::warn!(key, error = %e, "etcd refused to delete a lock key; asking again for a lease TTL");
                        let now = Instant::now();
                        refused_since.set(Some(now));
                        now
                    }
                };
                since.elapsed() < ttl
            };
            crate::backend::engine::retry::retry_uncertain(again, go_on, call).await
        }
    };
    result.map_err(|e| etcd_error("deleting the lock key", e))
}

/// A held lock key. Its lease is the session's, kept alive by it;
/// releasing deletes the key.
pub(super) struct EtcdLock {
    pub(super) session: Arc<Session>,
    /// Freed when the lock is dropped, which is after its release has
    /// been answered or given up.
    slot: Slot,
    /// The key's create revision: the release deletes only that key.
    revision: i64,
}

impl EtcdLock {
    pub(super) fn key(&self) -> &str {
        &self.slot.name
    }

    /// Forgets the key in the session's list of holds: it is being deleted.
    fn unlist(&self) {
        self.session.holds.remove(self.key());
    }
}

impl Protocol for EtcdLock {
    const BACKEND: &'static str = "etcd";
    const EXPIRED: &'static str = "the etcd lease is no longer known alive (no answer in time)";

    fn describe(&self) -> &str {
        self.key()
    }

    /// Never called: the lock is not renewed, its lease is kept alive for
    /// all of a backend's locks.
    async fn renew(&self, _lease: std::time::Duration) -> Result<(), String> {
        Ok(())
    }

    /// One delete, sent when first polled; sent again, after a short
    /// backoff, when it may not have been applied (a member is down and the
    /// client has not yet moved to another), until the lease ends. A
    /// refusal is returned, and the background asks again.
    async fn release(&self) -> Released {
        self.unlist();
        let key = self.key();
        match delete_until_done(&self.session, key, Some(self.revision), Until::Answered).await {
            Ok(()) => Released {
                result: Ok(()),
                again: false,
            },
            Err(e) => Released {
                // Refused, or it may not have run: go on in the background.
                result: Err(e),
                again: true,
            },
        }
    }

    /// Deletes until done (through refusals for a lease TTL), or the lease
    /// has ended and `deadline` passed.
    async fn release_until(&self, deadline: Instant) -> Result<(), LockError> {
        self.unlist();
        let until = Until::Gone(Some(deadline));
        delete_until_done(&self.session, self.key(), Some(self.revision), until).await
    }
}
