//! What Redlock's operators see: a lock's holders, the locks held, and
//! breaking one; each asks every instance and needs a majority's answers.

use std::future::Future;

use redis::aio::ConnectionManager;

use super::RedlockStore;
use crate::backend::redis::inspect;
use crate::backend::{Broken, Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::token::FencingToken;

impl RedlockStore {
    /// Runs `op` on every instance with the key prefix; the answers of
    /// those that answered, if a majority did. `doing` names it in errors.
    async fn on_a_majority<T, F, Fut>(&self, doing: &str, op: F) -> Result<Vec<T>, LockError>
    where
        F: Fn(ConnectionManager, String) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let mut answered = Vec::with_capacity(self.nodes.len());
        let mut failed = None;
        for answer in self.on_all(|conn| op(conn, self.prefix.clone())).await {
            match answer {
                Ok(answer) => answered.push(answer),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        if answered.len() >= self.quorum() {
            return Ok(answered);
        }
        let (n, of) = (answered.len(), self.nodes.len());
        // The first failure is the source.
        let source = failed.map(|e| Box::new(e) as _);
        let message = format!("{doing}: only {n} of {of} instances answered");
        Err(LockError::backend("redlock", message, source))
    }

    /// The holders seen on at least `least` instances, once each, with the
    /// least time left among them and on how many instances they are.
    fn tally(&self, answered: Vec<Vec<Holder>>, least: usize) -> Vec<Holder> {
        let mut seen: Vec<(Holder, usize)> = Vec::new();
        for holder in answered.into_iter().flatten() {
            match seen
                .iter_mut()
                .find(|(h, _)| h.identity == holder.identity && h.mode == holder.mode)
            {
                Some((h, n)) => {
                    *n += 1;
                    h.lease_left = h.lease_left.min(holder.lease_left);
                }
                None => seen.push((holder, 1)),
            }
        }
        let n = self.nodes.len();
        seen.into_iter()
            .filter(|(_, on)| *on >= least)
            .map(|(h, on)| {
                let who = h.identity.clone().unwrap_or_default();
                h.identity(format!("{who} on {on} of {n} instances"))
            })
            .collect()
    }

    /// Each instance's holders; a holder shows when a majority has its
    /// owner, with the least time left among them (the one that bounds the
    /// lock). No token, no waiters, as on one server.
    pub(super) async fn inspect_key(&self, key: LockKey) -> Result<Inspection, LockError> {
        let answered = self
            .on_a_majority("inspecting a lock", |mut conn, prefix| {
                let key = key.clone();
                async move { inspect::holders(&mut conn, &prefix, &key).await }
            })
            .await?;
        let holders = self.tally(answered, self.quorum());
        Ok(Inspection {
            key,
            holders,
            waiters: None,
        })
    }

    /// The keys a majority of the instances has a lock key for.
    pub(super) async fn list_keys(&self, prefix: String) -> Result<Vec<LockKey>, LockError> {
        let answered = self
            .on_a_majority("listing locks", |mut conn, lock_prefix| {
                let prefix = prefix.clone();
                async move { inspect::held_keys(&mut conn, &lock_prefix, &prefix).await }
            })
            .await?;
        let mut all: Vec<LockKey> = answered.into_iter().flatten().collect();
        all.sort_unstable();
        let mut keys = Vec::new();
        for group in all.chunk_by(|a, b| a == b) {
            if group.len() >= self.quorum() {
                keys.push(group[0].clone());
            }
        }
        Ok(keys)
    }

    /// Breaks the lock on every instance; a majority must answer. The
    /// floor is the highest of their raised counters: above the tokens
    /// handed out before as far as Redlock's tokens rise at all (see
    /// [Fencing tokens](self#fencing-tokens)).
    pub(super) async fn break_key(&self, key: LockKey) -> Result<Broken, LockError> {
        // Two rounds. Every counter is raised first, freeing nothing, and
        // the highest is the floor; only then is the lock freed, every
        // counter raised to at least the floor. Freed in one round, a
        // waiter could take a majority from the instances broken first,
        // with tokens under the counter of one broken last.
        let floor = self
            .on_a_majority("breaking a lock", |mut conn, prefix| {
                let key = key.clone();
                async move { inspect::raise_fence(&mut conn, &prefix, &key).await }
            })
            .await?
            .into_iter()
            .max()
            .unwrap_or(0);
        let answered = self
            .on_a_majority("breaking a lock", |mut conn, prefix| {
                let key = key.clone();
                async move {
                    let (publish, queued) = ("PUBLISH", true);
                    inspect::break_on(&mut conn, &prefix, &key, "0", publish, queued, floor).await
                }
            })
            .await?;
        let holders = self.tally(answered.into_iter().map(|(h, _)| h).collect(), 1);
        Ok(Broken {
            key,
            holders,
            floor: FencingToken::new(floor),
        })
    }
}
