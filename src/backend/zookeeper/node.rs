//! A lock node: created, deleted (again through connection loss), and held
//! as a lease.

use std::sync::Arc;
use std::time::Instant;

use zookeeper_client as zk;

use super::session::{alive, retry_while, uncertain, zk_error, Session};
use crate::backend::engine::lease::{Protocol, Released};
use crate::error::LockError;

/// A lock node this process created (or is creating). Dropped without
/// [`delete`](Node::delete), it deletes itself in the background, retrying
/// until the server confirms or the session is gone.
pub(super) struct Node {
    session: Arc<Session>,
    dir: String,
    /// `_c_<uuid>-`: finds the node when the create's answer was lost.
    protected: String,
    /// Known once the create answered.
    pub(super) path: Option<String>,
    pub(super) czxid: i64,
    /// Deleted (or found never created): nothing left to clean up.
    done: bool,
}

impl Node {
    pub(super) fn new(session: Arc<Session>, dir: String, protected: String) -> Node {
        Node {
            session,
            dir,
            protected,
            path: None,
            czxid: 0,
            done: false,
        }
    }

    pub(super) fn name(&self) -> &str {
        let path = self.path.as_deref().unwrap_or_default();
        &path[path.rfind('/').map_or(0, |i| i + 1)..]
    }

    /// Looks for our node after a lost create answer; fills in its path and
    /// zxid if the create happened.
    pub(super) async fn find_own(&mut self) -> Result<bool, LockError> {
        let listed = retry_while(&self.session, alive, || {
            self.session.client.list_children(&self.dir)
        })
        .await;
        let children = match listed {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(false),
            Err(e) => return Err(zk_error("listing lock nodes", e)),
        };
        let Some(child) = children.iter().find(|c| c.starts_with(&self.protected)) else {
            return Ok(false);
        };
        let path = format!("{}/{child}", self.dir);
        let stat = retry_while(&self.session, alive, || {
            self.session.client.check_stat(&path)
        })
        .await
        .map_err(|e| zk_error("reading our lock node", e))?;
        match stat {
            Some(stat) => {
                self.czxid = stat.czxid;
                self.path = Some(path);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Deletes the node now. Cancelled, the drop finishes the job.
    pub(super) async fn delete(mut self) -> Result<(), LockError> {
        if let Some(path) = &self.path {
            delete_until_done(&self.session, path).await?;
        }
        self.done = true;
        Ok(())
    }

    /// The granted node as a held lock: from here on the lease deletes it.
    pub(super) fn into_lock(mut self) -> ZkLock {
        self.done = true;
        ZkLock {
            session: self.session.clone(),
            path: self.path.take().unwrap_or_default(),
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let session = self.session.clone();
        let path = self.path.take();
        let dir = std::mem::take(&mut self.dir);
        let protected = std::mem::take(&mut self.protected);
        let Some(rt) = self.session.releases.runtime() else {
            tracing::warn!(
                "zookeeper lock node dropped outside a Tokio runtime; it goes with the session"
            );
            return;
        };
        session.releases.clone().spawn(&rt, async move {
            let path = match path {
                Some(path) => path,
                // A create may be in flight or done: find it by its prefix.
                None => {
                    let mut node = Node::new(session.clone(), dir, protected);
                    let found = node.find_own().await;
                    node.done = true;
                    match (found, node.path.take()) {
                        (Ok(true), Some(path)) => path,
                        _ => return,
                    }
                }
            };
            if let Err(e) = delete_until_done(&session, &path).await {
                tracing::warn!(path, error = %e, "deleting a zookeeper lock node failed");
            }
        });
    }
}

/// Deletes `path`, retrying through connection loss. Done when the node is
/// gone, or the session (and with it the ephemeral node) is.
async fn delete_until_done(session: &Session, path: &str) -> Result<(), LockError> {
    let deleted = retry_while(session, alive, || session.client.delete(path, None)).await;
    deleted_or_gone(deleted)
}

/// A delete's outcome: the node or its session is gone, or a real error.
fn deleted_or_gone(result: Result<(), zk::Error>) -> Result<(), LockError> {
    match result {
        Ok(())
        | Err(
            zk::Error::NoNode
            | zk::Error::SessionExpired
            | zk::Error::ClientClosed
            | zk::Error::AuthFailed,
        ) => Ok(()),
        // After retrying, an uncertain failure means the session ended:
        // the ephemeral node went with it.
        Err(e) if uncertain(&e) => Ok(()),
        Err(e) => Err(zk_error("deleting the lock node", e)),
    }
}

/// A held lock node. Its lease lives as long as the session, which keeps
/// itself alive; releasing deletes the node.
pub(super) struct ZkLock {
    pub(super) session: Arc<Session>,
    pub(super) path: String,
}

impl ZkLock {
    /// Forgets the node in the session's list of holds: it is being deleted.
    fn unlist(&self) {
        self.session.holds.remove(&self.path);
    }
}

impl Protocol for ZkLock {
    const BACKEND: &'static str = "zookeeper";
    const EXPIRED: &'static str =
        "the ZooKeeper session is no longer known alive (no answer in time)";

    fn describe(&self) -> &str {
        &self.path
    }

    /// Never called: a ZooKeeper lock is not renewed, its session keeps
    /// itself alive.
    async fn renew(&self, _lease: std::time::Duration) -> Result<(), String> {
        Ok(())
    }

    /// One `delete`, sent when first polled; the server applies it before
    /// anything this session sends later.
    async fn release(&self) -> Released {
        self.unlist();
        match self.session.client.delete(&self.path, None).await {
            Err(e) if uncertain(&e) => Released {
                // It may not have run: go on trying in the background.
                result: Err(zk_error("deleting the lock node", e)),
                again: true,
            },
            other => Released {
                result: deleted_or_gone(other),
                again: false,
            },
        }
    }

    /// Deletes until done or the session (and with it the node) is gone;
    /// the deadline does not apply.
    async fn release_until(&self, _deadline: Instant) -> Result<(), LockError> {
        self.unlist();
        delete_until_done(&self.session, &self.path).await
    }
}
