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
