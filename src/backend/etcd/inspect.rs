//! Who holds a key: the keys under its prefix in create order, for
//! [`Backend::inspect`](crate::Backend::inspect).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, SortOrder, SortTarget, Txn, TxnOp};

use super::contender::is_reader;
use super::session::etcd_error;
use super::{EtcdBackend, EtcdStore};
use crate::backend::identity::shown;
use crate::backend::{Broken, Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;
use crate::token::FencingToken;

impl EtcdStore {
    /// The holders are the first key, or the readers before the first
    /// writer (as the lock protocol serves them, whoever made the keys:
    /// `etcdctl lock` too), each with its token (from its create
    /// revision, as a grant computes it), mode, lease and the time its
    /// lease has left; the other keys wait.
    pub(super) async fn inspect_key(
        self: Arc<Self>,
        key: LockKey,
    ) -> Result<Inspection, LockError> {
        let session = self.session().await?;
        let (holding, waiters, _) = self.holding(&session.client, &key).await?;
        Ok(Inspection {
            key,
            holders: holding.into_iter().map(|h| h.holder).collect(),
            waiters: Some(waiters),
        })
    }

    /// Deletes the holders' keys in one transaction, if each still has
    /// the create revision read (else reads again). A token is fixed when
    /// its key is made, so the floor is the first token past the newest
    /// holder's key: above every token granted so far, and at most every
    /// queued or later key's. A holder is not told: its lease lives on,
    /// and its release finds its key gone.
    pub(super) async fn break_key(self: Arc<Self>, key: LockKey) -> Result<Broken, LockError> {
        let session = self.session().await?;
        let spacing = u64::from(EtcdBackend::TOKEN_SPACING);
        loop {
            let (holding, _, revision) = self.holding(&session.client, &key).await?;
            if holding.is_empty() {
                // Tokens made so far are below the next revision's.
                return Ok(Broken {
                    key,
                    holders: Vec::new(),
                    floor: FencingToken::new((revision as u64 + 1) * spacing),
                });
            }
            let txn = Txn::new()
                .when(
                    holding
                        .iter()
                        .map(|h| {
                            Compare::create_revision(h.name.clone(), CompareOp::Equal, h.created)
                        })
                        .collect::<Vec<_>>(),
                )
                .and_then(
                    holding
                        .iter()
                        .map(|h| TxnOp::delete(h.name.clone(), None))
                        .collect::<Vec<_>>(),
                );
            let answer = session
                .client
                .kv_client()
                .txn(txn)
                .await
                .map_err(|e| etcd_error("deleting lock keys", e))?;
            if answer.succeeded() {
                // A token is fixed when its key is made: a waiter queued
                // behind the holders has its own already, past theirs.
                let newest = holding.iter().map(|h| h.created).max().unwrap_or(0);
                return Ok(Broken {
                    key,
                    holders: holding.into_iter().map(|h| h.holder).collect(),
                    floor: FencingToken::new((newest as u64 + 1) * spacing),
                });
            }
        }
    }

    /// The holders are the first key, or the readers before the first
    /// writer; the others wait. Also the revision read at.
    async fn holding(
        &self,
        client: &etcd_client::Client,
        key: &LockKey,
    ) -> Result<(Vec<Holding>, u32, i64), LockError> {
        let prefix = format!("{}/", self.name(key));
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let answer = client
            .kv_client()
            .get(prefix.as_str(), Some(options))
            .await
            .map_err(|e| etcd_error("listing lock keys", e))?;
        let revision = answer.header().map_or(0, |h| h.revision());
        let kvs = answer.kvs();
        let holding = match kvs.first() {
            None => 0,
            Some(first) if !is_reader(first.value()) => 1,
            Some(_) => kvs.iter().take_while(|kv| is_reader(kv.value())).count(),
        };
        let mut lease = client.lease_client();
        let mut holders = Vec::with_capacity(holding);
        for kv in &kvs[..holding] {
            let token = kv.create_revision() as u64 * u64::from(EtcdBackend::TOKEN_SPACING);
            let mode = if is_reader(kv.value()) {
                LockMode::Read
            } else {
                LockMode::Exclusive
            };
            let mut holder = Holder::new(Some(FencingToken::new(token)))
                .mode(mode)
                .identity(who(kv.value(), kv.lease()));
            if kv.lease() != 0 {
                let ttl = lease
                    .time_to_live(kv.lease(), None)
                    .await
                    .map_err(|e| etcd_error("reading a lock's lease", e))?
                    .ttl();
                // -1: the lease has just expired.
                holder = holder.lease_left(Duration::from_secs(u64::try_from(ttl).unwrap_or(0)));
            }
            holders.push(Holding {
                name: kv.key().to_vec(),
                created: kv.create_revision(),
                holder,
            });
        }
        let waiters = u32::try_from(kvs.len() - holding).unwrap_or(u32::MAX);
        Ok((holders, waiters, revision))
    }
}

/// A key's holder: the identity this backend writes after the number in
/// the value (`[read ]<n> <identity>`), and the lease; other clients'
/// values (`etcdctl lock` writes none) show the lease alone.
fn who(value: &[u8], lease: i64) -> String {
    let lease = format!("lease {lease:x}");
    let text = std::str::from_utf8(value).unwrap_or_default();
    let text = text.strip_prefix("read ").unwrap_or(text);
    match text.split_once(' ') {
        Some((_, identity)) if !identity.trim().is_empty() => {
            format!("{} ({lease})", shown(identity.trim()))
        }
        _ => lease,
    }
}

/// A holder's key, its create revision, and what it shows.
struct Holding {
    name: Vec<u8>,
    created: i64,
    holder: Holder,
}

impl EtcdStore {
    /// The lock names with a key under them: someone holds each (the
    /// first key in create order).
    pub(super) async fn list_keys(
        self: Arc<Self>,
        prefix: String,
    ) -> Result<Vec<LockKey>, LockError> {
        let session = self.session().await?;
        let root = format!("{}/", self.root);
        let options = GetOptions::new().with_prefix().with_keys_only();
        let mut kv = session.client.kv_client();
        let answer = kv
            .get(format!("{root}{prefix}"), Some(options))
            .await
            .map_err(|e| etcd_error("listing lock keys", e))?;
        let mut keys: Vec<LockKey> = answer
            .kvs()
            .iter()
            .filter_map(|kv| {
                let name = kv.key_str().ok()?.strip_prefix(&root)?;
                LockKey::new(name.rsplit_once('/')?.0).ok()
            })
            .collect();
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }
}
