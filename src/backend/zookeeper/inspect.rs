//! Who holds a key: the contenders under its lock node, in sequence order,
//! for [`Backend::inspect`](crate::Backend::inspect).

use std::sync::Arc;

use super::recipes::{is_reader, sequence, LEASES, LOCKS, READ_NAME, WRITE_NAME};
use super::session::{zk_error, Session};
use super::{ZookeeperBackend, ZookeeperStore};
use crate::backend::identity::shown;
use crate::backend::{Broken, Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;
use crate::token::FencingToken;

impl ZookeeperStore {
    /// The session, its server caught up with the leader first: reads on a
    /// follower may lag the writes of other sessions (another process's
    /// lock, or this process's through another backend), and inspection is
    /// asked about locks already granted.
    async fn synced(&self) -> Result<Arc<Session>, LockError> {
        let session = self.session().await?;
        session
            .client
            .sync("/")
            .await
            .map_err(|e| zk_error("catching up with the ZooKeeper leader", e))?;
        Ok(session)
    }

    /// The holders are the first contender, or the readers before the
    /// first writer, each with its token (from its node's creation zxid,
    /// as a grant computes it), mode and session, and the node's data when
    /// another client wrote some (Curator writes its address, kazoo its
    /// identifier); the others wait. No lease: a node lives as long as its
    /// session. A semaphore's leases are not shown.
    pub(super) async fn inspect_key(
        self: Arc<Self>,
        key: LockKey,
    ) -> Result<Inspection, LockError> {
        let session = self.synced().await?;
        let dir = self.dir(&key);
        let (holders, waiters) = self.holding(&session, &dir).await?;
        Ok(Inspection {
            key,
            holders: holders.into_iter().map(|(_, h)| h).collect(),
            waiters: Some(waiters),
        })
    }

    /// Deletes the holders' nodes. A token is fixed when its node is
    /// made, so a waiter queued behind them already has its own: the floor
    /// is the first token past the newest holder's node, above every token
    /// granted so far and at most every queued or later node's. With no
    /// holder (and so no node), it is past the last change of the
    /// directory's children (or, with it gone, the root's), which every
    /// node made under it preceded. A holder is not told: its session lives
    /// on, and its release finds its node gone.
    ///
    /// A semaphore is not broken: the lease a waiter makes while it holds
    /// the semaphore's mutex cannot be told from a holder's.
    pub(super) async fn break_key(self: Arc<Self>, key: LockKey) -> Result<Broken, LockError> {
        use zookeeper_client::Error as E;
        let session = self.synced().await?;
        let dir = self.dir(&key);
        let (holding, floor) = loop {
            let children = match session.client.list_children(&dir).await {
                Ok(children) if children.iter().any(|c| c == LEASES) => {
                    return Err(LockError::Unsupported(
                        "breaking a ZooKeeper semaphore is not supported: a waiter's pending \
                         lease cannot be told from a holder's"
                            .into(),
                    ))
                }
                Ok(children) => children,
                Err(E::NoNode) => Vec::new(),
                Err(e) => return Err(zk_error("listing lock nodes", e)),
            };
            let (holding, waiting) = self.holding_among(&session, &dir, children).await?;
            let newest = holding.iter().filter_map(|(_, h)| h.token).max();
            match newest {
                Some(token) => break (holding, past(token)),
                // The holder went between the listing and its read: the
                // next is granted, or about to be. Look again.
                None if waiting > 0 => continue,
                None => {
                    let changed = match session.client.check_stat(&dir).await {
                        Ok(Some(stat)) => stat.pzxid,
                        Ok(None) | Err(E::NoNode) => {
                            match session.client.check_stat(&self.root).await {
                                Ok(Some(stat)) => stat.pzxid,
                                Ok(None) | Err(E::NoNode) => 0,
                                Err(e) => return Err(zk_error("reading the lock root", e)),
                            }
                        }
                        Err(e) => return Err(zk_error("reading a lock node", e)),
                    };
                    break (Vec::new(), token_of(changed + 1));
                }
            }
        };
        let mut holders = Vec::with_capacity(holding.len());
        for (path, holder) in holding {
            match session.client.delete(&path, None).await {
                Ok(()) => holders.push(holder),
                // Released since the listing.
                Err(E::NoNode) => {}
                Err(e) => {
                    return Err(zk_error(
                        &format!("deleting a lock node (the floor was {floor}; break again)"),
                        e,
                    ))
                }
            }
        }
        Ok(Broken {
            key,
            holders,
            floor,
        })
    }

    /// The holders' nodes under `dir` with what they show, and how many
    /// wait.
    async fn holding(
        &self,
        session: &Session,
        dir: &str,
    ) -> Result<(Vec<(String, Holder)>, u32), LockError> {
        let children = match session.client.list_children(dir).await {
            Ok(children) => children,
            Err(zookeeper_client::Error::NoNode) => return Ok((Vec::new(), 0)),
            Err(e) => return Err(zk_error("listing lock nodes", e)),
        };
        if children.iter().any(|c| c == LEASES) {
            return self.semaphore_holding(session, dir).await;
        }
        self.holding_among(session, dir, children).await
    }

    /// [`holding`](Self::holding) of a lock (not a semaphore) whose
    /// children `dir` has been listed.
    async fn holding_among(
        &self,
        session: &Session,
        dir: &str,
        children: Vec<String>,
    ) -> Result<(Vec<(String, Holder)>, u32), LockError> {
        let mut contenders: Vec<(i64, String)> = children
            .into_iter()
            .filter_map(|name| Some((sequence(&name)?, name)))
            .collect();
        contenders.sort_unstable();
        let holding = match contenders.first() {
            None => 0,
            Some((_, first)) if !is_reader(first) => 1,
            Some(_) => contenders.iter().take_while(|(_, n)| is_reader(n)).count(),
        };
        let mut holders = Vec::with_capacity(holding);
        for (_, name) in &contenders[..holding] {
            let path = format!("{dir}/{name}");
            let (data, stat) = match session.client.get_data(&path).await {
                Ok(found) => found,
                // Released since the listing.
                Err(zookeeper_client::Error::NoNode) => continue,
                Err(e) => return Err(zk_error("reading a lock node", e)),
            };
            let token = token_of(stat.czxid);
            let mode = if name.contains(READ_NAME) || name.contains("__rlock__") {
                LockMode::Read
            } else if name.contains(WRITE_NAME) {
                LockMode::Write
            } else {
                LockMode::Exclusive
            };
            holders.push((
                path,
                Holder::new(Some(token))
                    .mode(mode)
                    .identity(who(&data, &stat)),
            ));
        }
        let waiters = u32::try_from(contenders.len() - holding).unwrap_or(u32::MAX);
        Ok((holders, waiters))
    }
}

impl ZookeeperStore {
    /// A semaphore (Curator's `InterProcessSemaphoreV2`): its holders are
    /// the nodes under `leases`, each with its token (as a grant computes
    /// it) and session; its waiters, the nodes queued for the `locks`
    /// mutex that guards taking a lease.
    async fn semaphore_holding(
        &self,
        session: &Session,
        dir: &str,
    ) -> Result<(Vec<(String, Holder)>, u32), LockError> {
        let leases_dir = format!("{dir}/{LEASES}");
        let mut holders = Vec::new();
        for name in self.sequenced(session, &leases_dir).await? {
            let path = format!("{leases_dir}/{name}");
            match session.client.get_data(&path).await {
                Ok((data, stat)) => holders.push((
                    path,
                    Holder::new(Some(token_of(stat.czxid))).identity(who(&data, &stat)),
                )),
                // Released since the listing.
                Err(zookeeper_client::Error::NoNode) => {}
                Err(e) => return Err(zk_error("reading a lease node", e)),
            }
        }
        let waiting = self
            .sequenced(session, &format!("{dir}/{LOCKS}"))
            .await?
            .len();
        Ok((holders, u32::try_from(waiting).unwrap_or(u32::MAX)))
    }

    /// The names of the sequential nodes under `dir`; none if it is gone.
    async fn sequenced(&self, session: &Session, dir: &str) -> Result<Vec<String>, LockError> {
        match session.client.list_children(dir).await {
            Ok(children) => Ok(children
                .into_iter()
                .filter(|c| sequence(c).is_some())
                .collect()),
            Err(zookeeper_client::Error::NoNode) => Ok(Vec::new()),
            Err(e) => Err(zk_error("listing lock nodes", e)),
        }
    }

    /// The lock nodes under the root with a contender under them: someone
    /// holds each (the first in sequence order). One listing per lock node.
    pub(super) async fn list_keys(
        self: Arc<Self>,
        prefix: String,
    ) -> Result<Vec<LockKey>, LockError> {
        let session = self.synced().await?;
        let names = match session.client.list_children(&self.root).await {
            Ok(names) => names,
            Err(zookeeper_client::Error::NoNode) => return Ok(Vec::new()),
            Err(e) => return Err(zk_error("listing lock nodes", e)),
        };
        let mut keys = Vec::new();
        for name in names {
            let Some(key) = key_of_node(&name).filter(|k| k.as_str().starts_with(&prefix)) else {
                continue;
            };
            match session
                .client
                .list_children(&format!("{}/{name}", self.root))
                .await
            {
                Ok(children) if children.iter().any(|c| sequence(c).is_some()) => keys.push(key),
                Ok(_) | Err(zookeeper_client::Error::NoNode) => {}
                Err(e) => return Err(zk_error("listing lock nodes", e)),
            }
        }
        keys.sort_unstable();
        Ok(keys)
    }
}

/// A node's holder: its data where some client wrote text (this backend
/// its label, process id and host; Curator its address; kazoo its
/// identifier), and its session.
fn who(data: &[u8], stat: &zookeeper_client::Stat) -> String {
    let session = format!("session 0x{:x}", stat.ephemeral_owner);
    match std::str::from_utf8(data).map(str::trim) {
        Ok(text) if !text.is_empty() => format!("{} ({session})", shown(text)),
        _ => session,
    }
}

/// The first token of the node after the one `token` was granted for.
fn past(token: FencingToken) -> FencingToken {
    let spacing = u64::from(ZookeeperBackend::TOKEN_SPACING);
    FencingToken::new((token.get() / spacing + 1) * spacing)
}

/// A grant's token, from its node's creation zxid.
fn token_of(czxid: i64) -> FencingToken {
    FencingToken::new(czxid as u64 * u64::from(ZookeeperBackend::TOKEN_SPACING))
}

/// The key a lock node is named after: its name with `%XX` decoded (see
/// `node_name`); `None` for a node that names no valid key, or not as this
/// backend would name it (`%41` for `A`, which lives at `A`).
fn key_of_node(name: &str) -> Option<LockKey> {
    let key = decode_node(name)?;
    (super::url::node_name(&key) == name).then_some(key)
}

fn decode_node(name: &str) -> Option<LockKey> {
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    LockKey::new(&String::from_utf8(out).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_decode_to_their_keys() {
        for key in ["sku:42", "a%b", "caf\u{e9} 50%", "x.y"] {
            let key = LockKey::new(key).unwrap();
            let name = super::super::url::node_name(&key);
            assert_eq!(key_of_node(&name), Some(key.clone()), "{name}");
        }
        assert_eq!(key_of_node("bad%zz"), None);
        assert_eq!(key_of_node("%41"), None, "not how `A` is named");
        assert_eq!(key_of_node("cut%4"), None);
    }
}
