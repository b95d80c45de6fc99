//! [`Holds`]: the locks one session holds (a ZooKeeper session, an etcd
//! lease, a PostgreSQL or MariaDB connection), each told when the session
//! ends. The one registry every session-based store keeps: a session names
//! no lock type, so a store's session and lock files do not name each
//! other.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, Weak};

use crate::backend::HasLostState;
use crate::sync::lock;

/// The locks held on one session, by a key of the store's choosing (a node
/// path, a lock key, a number), with what the store keeps beside each.
pub(crate) struct Holds<K, V = ()> {
    state: Mutex<State<K, V>>,
}

struct State<K, V> {
    /// Why the session ended, once it has.
    ended: Option<String>,
    held: HashMap<K, (Weak<dyn HasLostState>, V)>,
}

impl<K: Eq + Hash, V> Holds<K, V> {
    pub(crate) fn new() -> Self {
        Holds {
            state: Mutex::new(State {
                ended: None,
                held: HashMap::new(),
            }),
        }
    }

    /// Lists `hold` under `key` until it is removed. On a session that has
    /// already ended it is told at once instead: a session may end between
    /// the grant and this call.
    pub(crate) fn insert<H: HasLostState>(&self, key: K, hold: &Arc<H>, extra: V) {
        let mut state = lock(&self.state);
        match &state.ended {
            Some(reason) => {
                let reason = reason.clone();
                drop(state);
                hold.lost_state().fire(reason);
            }
            None => {
                let weak: Weak<dyn HasLostState> = Arc::downgrade(hold) as Weak<H>;
                state.held.insert(key, (weak, extra));
            }
        }
    }

    /// Forgets the lock under `key`: it is being released.
    pub(crate) fn remove<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        lock(&self.state).held.remove(key);
    }

    /// Whether the session holds no lock now.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.state).held.is_empty()
    }

    /// What the store keeps beside the lock under `key`, if it is held.
    #[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
    pub(crate) fn get<Q, R>(&self, key: &Q, read: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        lock(&self.state)
            .held
            .get(key)
            .map(|(_, extra)| read(extra))
    }

    /// Ends the session: every lock it holds is told `reason`, and so is
    /// any listed later. Returns how many were told now; nothing the
    /// second time.
    pub(crate) fn end(&self, reason: &str) -> usize {
        let held: Vec<_> = {
            let mut state = lock(&self.state);
            if state.ended.is_some() {
                return 0;
            }
            state.ended = Some(reason.to_owned());
            state.held.drain().map(|(_, (hold, _))| hold).collect()
        };
        let told = held.len();
        for hold in held.iter().filter_map(Weak::upgrade) {
            hold.lost_state().fire(reason.to_owned());
        }
        told
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LostState;

    struct Lock(LostState);

    impl HasLostState for Lock {
        fn lost_state(&self) -> &LostState {
            &self.0
        }
    }

    fn lost(lock: &Lock) -> bool {
        lock.0.is_fired()
    }

    #[test]
    fn end_tells_every_lock_held_then_and_later() {
        let holds: Holds<&str> = Holds::new();
        let (a, b, gone) = (
            Arc::new(Lock(LostState::new())),
            Arc::new(Lock(LostState::new())),
            Arc::new(Lock(LostState::new())),
        );
        holds.insert("a", &a, ());
        holds.insert("gone", &gone, ());
        holds.remove("gone");
        assert!(!holds.is_empty());
        assert_eq!(holds.end("the session ended"), 1);
        assert!(lost(&a) && !lost(&gone));
        assert!(holds.is_empty());
        // Granted just before the end, listed just after: told at once.
        holds.insert("b", &b, ());
        assert!(lost(&b));
        assert!(holds.is_empty());
        assert_eq!(holds.end("again"), 0);
    }

    #[test]
    fn keeps_what_the_store_puts_beside_a_lock() {
        let holds: Holds<String, bool> = Holds::new();
        let a = Arc::new(Lock(LostState::new()));
        holds.insert("/locks/a/node-1".to_owned(), &a, true);
        assert_eq!(holds.get("/locks/a/node-1", |writer| *writer), Some(true));
        assert_eq!(holds.get("/locks/a/node-2", |writer| *writer), None);
    }
}
