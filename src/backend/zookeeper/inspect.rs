//! Who holds a key: the contenders under its lock node, in sequence order,
//! for [`Backend::inspect`](crate::Backend::inspect).

use std::sync::Arc;

use super::recipes::{is_reader, sequence, READ_NAME, WRITE_NAME};
use super::session::zk_error;
use super::{ZookeeperBackend, ZookeeperStore};
use crate::backend::{Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;
use crate::token::FencingToken;

impl ZookeeperStore {
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
        let session = self.session().await?;
        let dir = self.dir(&key);
        let children = match session.client.list_children(&dir).await {
            Ok(children) => children,
            Err(zookeeper_client::Error::NoNode) => return Ok(Inspection::free(key, Some(0))),
            Err(e) => return Err(zk_error("listing lock nodes", e)),
        };
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
            let token = stat.czxid as u64 * u64::from(ZookeeperBackend::TOKEN_SPACING);
            let mode = if name.contains(READ_NAME) || name.contains("__rlock__") {
                LockMode::Read
            } else if name.contains(WRITE_NAME) {
                LockMode::Write
            } else {
                LockMode::Exclusive
            };
            let mut who = format!("session 0x{:x}", stat.ephemeral_owner);
            if let Ok(text) = std::str::from_utf8(&data) {
                if !text.trim().is_empty() {
                    who = format!("{} ({who})", text.trim());
                }
            }
            holders.push(
                Holder::new(Some(FencingToken::new(token)))
                    .mode(mode)
                    .identity(who),
            );
        }
        let waiters = u32::try_from(contenders.len() - holding).unwrap_or(u32::MAX);
        Ok(Inspection {
            key,
            holders,
            waiters: Some(waiters),
        })
    }
}

impl ZookeeperStore {
    /// The lock nodes under the root with a contender under them: someone
    /// holds each (the first in sequence order). One listing per lock node.
    pub(super) async fn list_keys(
        self: Arc<Self>,
        prefix: String,
    ) -> Result<Vec<LockKey>, LockError> {
        let session = self.session().await?;
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

/// The key a lock node is named after: its name with `%XX` decoded (see
/// `node_name`); `None` for a node that names no valid key.
fn key_of_node(name: &str) -> Option<LockKey> {
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
        assert_eq!(key_of_node("cut%4"), None);
    }
}
