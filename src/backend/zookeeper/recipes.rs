//! Curator's recipes: the lock node queue and the semaphore.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use zookeeper_client as zk;

use super::node::Node;
use super::session::{retry, retry_while, uncertain, zk_error, Session};
use crate::error::LockError;
use crate::mode::Wait;

const LOCK_NAME: &str = "lock-";
/// A semaphore's children: the mutex that guards taking a lease, and the
/// leases (Curator's names).
pub(super) const LOCKS: &str = "locks";
pub(super) const LEASES: &str = "leases";
pub(super) const READ_NAME: &str = "__READ__";
pub(super) const WRITE_NAME: &str = "__WRIT__";
const LEASE_NAME: &str = "lease-";
/// Curator's protected-mode prefix: `_c_<uuid>-`.
const PROTECTED: &str = "_c_";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Role {
    Exclusive,
    Read,
    Write,
}

impl Role {
    /// The lock name in its nodes, as Curator writes it.
    fn node_name(self) -> &'static str {
        match self {
            Role::Exclusive => LOCK_NAME,
            Role::Read => READ_NAME,
            Role::Write => WRITE_NAME,
        }
    }
}

/// What a contender does after reading the children.
#[derive(Debug, PartialEq, Eq)]
enum Next<'a> {
    Granted,
    /// Watch this child, then look again.
    Watch(&'a str),
    /// Our node is not among the children.
    Gone,
}

/// The sequence number at the end of a lock node's name: its last ten (or,
/// past `i32::MAX`, nineteen) digits.
///
/// Only the digits count: a lock name such as `lock-` ends in a `-`, so a
/// sign cannot be told apart. (The server's counter would wrap to negative
/// after 2^31 nodes under one parent; a container parent is reaped long
/// before.)
pub(super) fn sequence(name: &str) -> Option<i64> {
    let digits = name.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits < 10 {
        return None;
    }
    name[name.len() - digits..].parse().ok()
}

/// Whether a node is a shared (read) contender: ours or Curator's
/// `__READ__`, kazoo's `__rlock__`. Anything else is exclusive.
pub(super) fn is_reader(name: &str) -> bool {
    name.contains(READ_NAME) || name.contains("__rlock__")
}

/// Decides from one listing. One pass, no sort: what matters is the nearest
/// blocking node before ours.
fn next_step<'a>(children: &'a [String], ours: &str, role: Role) -> Next<'a> {
    let Some(our_seq) = sequence(ours) else {
        return Next::Gone;
    };
    let mut found = false;
    let mut blocker: Option<(i64, &str)> = None;
    for child in children {
        if child == ours {
            found = true;
            continue;
        }
        let Some(seq) = sequence(child) else {
            continue;
        };
        if seq >= our_seq || (role == Role::Read && is_reader(child)) {
            continue;
        }
        if blocker.is_none_or(|(b, _)| seq > b) {
            blocker = Some((seq, child));
        }
    }
    match (found, blocker) {
        (false, _) => Next::Gone,
        (true, None) => Next::Granted,
        (true, Some((_, child))) => Next::Watch(child),
    }
}

const EPHEMERAL_SEQUENTIAL: zk::CreateOptions<'static> =
    zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
const CONTAINER: zk::CreateOptions<'static> =
    zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());

impl Session {
    /// Creates our node under `dir` and waits until `role` may hold it.
    pub(super) async fn lock_node(
        self: &Arc<Self>,
        dir: &str,
        role: Role,
        wait: Wait,
    ) -> Result<Node, LockError> {
        // From here on, dropping `node` (cancellation, error) deletes
        // whatever this call created.
        let (node, mut children) = self.create_node(dir, role.node_name(), true).await?;
        loop {
            let ours = node.name();
            let watch = match next_step(&children, ours, role) {
                Next::Granted => return Ok(node),
                Next::Gone => {
                    return Err(LockError::backend(
                        "zookeeper",
                        format!("our lock node {dir}/{ours} was deleted while waiting"),
                        None,
                    ))
                }
                Next::Watch(_) if wait == Wait::FailFast => {
                    node.delete().await?;
                    return Err(LockError::Busy);
                }
                Next::Watch(child) => format!("{dir}/{child}"),
            };
            // A holder on this very session, of an exclusive or write lock,
            // was granted with nothing before it, and nothing can be queued
            // before it later; between it and us nothing blocks (we watch the
            // nearest blocker). Its deletion therefore hands the lock to us:
            // no need to list again, which saves a round trip per local
            // handoff.
            let handoff = self.holds.get(&watch, |writer| *writer) == Some(true);
            let watched = retry_while(self, Session::usable, || {
                self.client.get_and_watch_data(&watch)
            })
            .await;
            match watched {
                Ok((_, _, watcher)) => {
                    let event = self.changed(watcher).await?;
                    if handoff && event.event_type == zk::EventType::NodeDeleted {
                        return Ok(node);
                    }
                }
                // Gone already: look again.
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(zk_error("watching the lock node ahead", e)),
            }
            children = self.list(dir).await?;
        }
    }

    /// Curator's `InterProcessSemaphoreV2`: mutex, lease, wait, unlock.
    pub(super) async fn semaphore(
        self: &Arc<Self>,
        dir: &str,
        permits: u32,
        wait: Wait,
    ) -> Result<Node, LockError> {
        let mutex = self
            .lock_node(&format!("{dir}/{LOCKS}"), Role::Exclusive, wait)
            .await?;
        let leases = format!("{dir}/{LEASES}");
        let (lease, _) = self.create_node(&leases, LEASE_NAME, false).await?;
        loop {
            let (children, watcher) = retry(self, "listing the semaphore's leases", || {
                self.client.list_and_watch_children(&leases)
            })
            .await?;
            let held = children.iter().filter(|c| sequence(c).is_some()).count();
            if held <= permits as usize {
                break;
            }
            if wait == Wait::FailFast {
                lease.delete().await?;
                mutex.delete().await?;
                return Err(LockError::Busy);
            }
            self.changed(watcher).await?;
        }
        mutex.delete().await?;
        Ok(lease)
    }

    /// Creates one protected ephemeral sequential node under `dir`, making
    /// parents. With `list`, also returns `dir`'s children: listed back to
    /// back with the create (the server answers a session's requests in
    /// order, so the listing already holds the new node), or only ours
    /// when the parent was created with it.
    ///
    /// Under a parent not known to exist (see
    /// [`KnownDirs`](super::session::KnownDirs)), a lock node is created
    /// with its parent in one transaction ([`Session::create_with_parent`]):
    /// a key locked for the first time costs one round trip and one write,
    /// and needs no listing. Where the parent did exist, the transaction
    /// fails whole and the node's create follows; a semaphore's lease sends
    /// the parent's create just before its own instead.
    async fn create_node(
        self: &Arc<Self>,
        dir: &str,
        name: &str,
        list: bool,
    ) -> Result<(Node, Vec<String>), LockError> {
        let protected = format!("{PROTECTED}{}-", uuid::Uuid::new_v4());
        let prefix = format!("{dir}/{protected}{name}");
        let mut node = Node::new(self.clone(), dir.to_owned(), protected);
        let mut parent_exists = false;
        loop {
            let known = parent_exists || self.known_dirs.contains(dir);
            if !known && list {
                match self.create_with_parent(dir, &prefix).await {
                    Ok((path, czxid)) => {
                        self.known_dirs.insert(dir);
                        node.path = Some(path);
                        node.czxid = czxid;
                        let children = vec![node.name().to_owned()];
                        return Ok((node, children));
                    }
                    Err(zk::Error::NodeExists) => {
                        self.known_dirs.insert(dir);
                        parent_exists = true;
                    }
                    // A parent above it is missing.
                    Err(zk::Error::NoNode) => {
                        self.make_dir(dir).await?;
                        self.known_dirs.insert(dir);
                        parent_exists = true;
                    }
                    Err(e) if uncertain(&e) && self.usable() => {
                        // Protected mode: the transaction may have happened.
                        if node.find_own().await? {
                            self.known_dirs.insert(dir);
                            let children = self.list(dir).await?;
                            return Ok((node, children));
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) => return Err(zk_error("creating a lock node", e)),
                }
                continue;
            }
            // Sent back to back, answered in order: under a parent not
            // known to exist, the parent's create goes first, so the
            // node's finds it either way.
            let parent = (!known).then(|| self.client.create(dir, &[], &CONTAINER));
            let create = self
                .client
                .create(&prefix, &self.identity, &EPHEMERAL_SEQUENTIAL);
            let listing = list.then(|| self.client.list_children(dir));
            if let Some(parent) = parent {
                // Any other failure is the node's create's to report.
                if matches!(parent.await, Ok(_) | Err(zk::Error::NodeExists)) {
                    self.known_dirs.insert(dir);
                }
            }
            let created = create
                .await
                .map(|(stat, seq)| ((format!("{prefix}{seq}"), stat), listing));
            match created {
                Ok(((path, stat), listing)) => {
                    node.path = Some(path);
                    node.czxid = stat.czxid;
                    let children = match listing {
                        Some(listing) => match listing.await {
                            Ok(children) => children,
                            Err(_) => self.list(dir).await?,
                        },
                        None => Vec::new(),
                    };
                    return Ok((node, children));
                }
                Err(zk::Error::NoNode) => {
                    self.known_dirs.remove(dir);
                    parent_exists = false;
                    // Reaped since it was seen, or a parent above it is
                    // missing.
                    if !known {
                        self.make_dir(dir).await?;
                        self.known_dirs.insert(dir);
                    }
                }
                Err(e) if uncertain(&e) && self.usable() => {
                    // Protected mode: the create may have happened.
                    if node.find_own().await? {
                        let children = if list {
                            self.list(dir).await?
                        } else {
                            Vec::new()
                        };
                        return Ok((node, children));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(zk_error("creating a lock node", e)),
            }
        }
    }

    /// Creates `dir` (a container) and our node under it in one
    /// transaction; returns the node's path and creation zxid. Fails with
    /// `NodeExists` where `dir` exists, creating nothing.
    ///
    /// The zxid is read from an empty `setData` on `dir` in the same
    /// transaction: every change of one transaction carries its zxid, and
    /// ZooKeeper before 3.9 answers a create in a `multi` without the
    /// node's stat (ZOOKEEPER-4026).
    async fn create_with_parent(
        &self,
        dir: &str,
        prefix: &str,
    ) -> Result<(String, i64), zk::Error> {
        let mut both = self.client.new_multi_writer();
        both.add_create(dir, &[], &CONTAINER)?;
        both.add_create(prefix, &self.identity, &EPHEMERAL_SEQUENTIAL)?;
        both.add_set_data(dir, &[], Some(0))?;
        match both.commit().await.map_err(zk::Error::from)?.as_slice() {
            [_, zk::MultiWriteResult::Create { path, .. }, zk::MultiWriteResult::SetData { stat }] => {
                Ok((path.clone(), stat.mzxid))
            }
            other => Err(zk::Error::UnexpectedError(format!(
                "a create of a lock node with its parent answered {other:?}"
            ))),
        }
    }

    async fn list(&self, dir: &str) -> Result<Vec<String>, LockError> {
        retry(self, "listing lock nodes", || {
            self.client.list_children(dir)
        })
        .await
    }

    /// Creates `dir` and its missing parents as container nodes.
    async fn make_dir(&self, dir: &str) -> Result<(), LockError> {
        retry(self, "creating the lock's parent nodes", || {
            self.client.mkdir(dir, &CONTAINER)
        })
        .await
    }

    /// Waits for a watch to fire, or fails if the session ends first.
    /// Dropping the watcher (cancellation) removes the watch.
    async fn changed(
        self: &Arc<Self>,
        watcher: zk::OneshotWatcher,
    ) -> Result<zk::WatchedEvent, LockError> {
        let ended = self.ended_notify.notified();
        tokio::pin!(ended);
        // Registered before the check, so an end in between is not missed.
        ended.as_mut().enable();
        if !self.ended.load(Ordering::Acquire) {
            tokio::select! {
                event = watcher.changed() => return Ok(event),
                _ = ended => {}
            }
        }
        Err(LockError::backend(
            "zookeeper",
            "the ZooKeeper session ended while waiting",
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn sequences_parse_from_every_client() {
        assert_eq!(sequence("_c_1b-lock-0000000042"), Some(42));
        assert_eq!(sequence("_c_1b-__READ__0000000007"), Some(7));
        assert_eq!(sequence("5f3a__lock__0000000003"), Some(3));
        assert_eq!(sequence("locks"), None);
        assert_eq!(sequence("lock-12"), None);
        assert_eq!(sequence("_c_1b-lock-2147483648000"), Some(2147483648000));
    }

    #[test]
    fn exclusive_waits_for_its_immediate_predecessor() {
        let c = names(&[
            "_c_a-lock-0000000003",
            "_c_b-lock-0000000001",
            "_c_c-lock-0000000002",
        ]);
        assert_eq!(
            next_step(&c, "_c_b-lock-0000000001", Role::Exclusive),
            Next::Granted
        );
        assert_eq!(
            next_step(&c, "_c_a-lock-0000000003", Role::Exclusive),
            Next::Watch("_c_c-lock-0000000002")
        );
        assert_eq!(
            next_step(&c, "_c_z-lock-0000000009", Role::Exclusive),
            Next::Gone
        );
    }

    #[test]
    fn readers_share_and_wait_only_for_the_nearest_writer() {
        let c = names(&[
            "_c_a-__READ__0000000001",
            "_c_b-__WRIT__0000000002",
            "_c_c-__READ__0000000003",
            "k__rlock__0000000004",
            "_c_d-__READ__0000000005",
            "_c_e-__WRIT__0000000006",
        ]);
        assert_eq!(
            next_step(&c, "_c_a-__READ__0000000001", Role::Read),
            Next::Granted
        );
        assert_eq!(
            next_step(&c, "_c_d-__READ__0000000005", Role::Read),
            Next::Watch("_c_b-__WRIT__0000000002")
        );
        assert_eq!(
            next_step(&c, "_c_b-__WRIT__0000000002", Role::Write),
            Next::Watch("_c_a-__READ__0000000001")
        );
        assert_eq!(
            next_step(&c, "_c_e-__WRIT__0000000006", Role::Write),
            Next::Watch("_c_d-__READ__0000000005")
        );
    }
}
