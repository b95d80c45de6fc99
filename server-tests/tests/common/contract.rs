//! The conformance suite: what every backend promises, written once and
//! run against every store and connection mode.
//!
//! A store's test file describes how to open its backend in one mode (a
//! [`Subject`]) and instantiates the suite for it with
//! [`conformance!`](crate::common::contract::conformance), one `#[test]`
//! per contract test, each on the runtime it needs:
//!
//! ```ignore
//! mod plain {
//!     crate::common::contract::conformance!(super::Etcd { cohort: true });
//! }
//! ```
//!
//! A mode whose servers a test file starts for itself (a Sentinel group, a
//! cluster) calls [`every_contract_test`] once they are up. What is
//! particular to one store (its interop, its faults, what it keeps on the
//! server) stays in that store's file, beside its instantiations.
#![allow(async_fn_in_trait)] // called in place, never spawned

use std::time::Duration;

use tower_lock::Backend;

use super::fault_proxy::FaultProxy;
pub use super::operators::{
    a_broken_holder_is_fenced_out, another_process_lists_the_held_keys,
    another_process_sees_who_holds_a_key,
};

/// One store in one connection mode, as the conformance suite sees it.
///
/// Each test passes its own name: backends opened for different tests
/// never share a key (a root, a prefix or a namespace of their own).
pub trait Subject: Sync {
    type Backend: Backend + Clone + 'static;

    /// Opens a backend for `test` as another process would: its own
    /// connections and its own cohort, sharing only the server.
    async fn connect(&self, test: &str) -> Self::Backend;

    /// Opens a backend for `test` that reaches its server through a fault
    /// proxy (through one each, where it needs a majority of several),
    /// with a lease or session short enough that a holder cut off is told
    /// within a few seconds; `None` where there is no one link to cut.
    async fn connect_through_proxy(&self, test: &str) -> Option<(Vec<FaultProxy>, Self::Backend)>;

    /// Where `test`'s keys live: every key a contract test locks starts
    /// with it and a colon. Stores whose keys share one space on the
    /// server (PostgreSQL's advisory locks, MariaDB's named locks) make it
    /// unique to the subject and this process; the others keep each
    /// subject's keys apart with a root or a prefix of its own.
    fn namespace(&self, test: &str) -> String {
        test.to_owned()
    }

    /// Whether the server frees the locks of a holder it no longer hears
    /// from (a session or lease that ends) rather than keeping them until
    /// the connection closes, as PostgreSQL and MariaDB do; where not, the
    /// cut-off test heals the link once the holder is told, so that its
    /// close reaches the server.
    fn server_frees_a_silent_holder(&self) -> bool {
        true
    }

    /// Whether two processes contending for a key both get it, neither
    /// kept out: a cohort gives the lock back within its bound, and a
    /// server queue takes turns; waiters that only retry (Redlock without
    /// a cohort) promise no share.
    fn takes_turns_across_processes(&self) -> bool {
        true
    }

    /// Whether the store answers [`Backend::inspect`]: every store shipped
    /// does; a third-party one may keep the default, and the test then
    /// checks that it says so.
    fn inspects(&self) -> bool {
        true
    }

    /// Whether [`Backend::inspect`] shows a semaphore's holders, where the
    /// store has semaphores (PostgreSQL's advisory permits are locks on
    /// other hashes).
    fn inspects_semaphores(&self) -> bool {
        true
    }

    /// Whether the store answers [`Backend::list`] (`Backend::list`'s docs
    /// say which do not, and why); where not, the test checks that it
    /// says so.
    fn lists(&self) -> bool {
        true
    }

    /// What [`Backend::inspect`] shows in the identity of a holder this
    /// subject's backend opened for `test` (its label and process where
    /// the store carries them); `None` where it shows nothing of the kind.
    fn holder_identity(&self, test: &str) -> Option<String> {
        let _ = test;
        None
    }

    /// How [`Backend::break_lock`] frees a held key: with
    /// [`BreakScope::LocksOnly`](tower_lock::backend::BreakScope) where
    /// the lock alone can be freed; with `Sessions` where only ending the
    /// holder's session frees it (PostgreSQL advisory locks, MariaDB),
    /// and the test checks that `LocksOnly` is refused, saying so; `None`
    /// where the backend cannot break (in-process ones), and the test
    /// checks that it says so.
    fn breaks_with(&self) -> Option<tower_lock::backend::BreakScope> {
        Some(tower_lock::backend::BreakScope::LocksOnly)
    }

    /// Whether waiters in one process get a key in the order they asked:
    /// a cohort queues them so, and without one only a server queue fed
    /// in order does (the guarantees document says which).
    fn serves_one_process_in_order(&self) -> bool {
        true
    }

    /// Waits until `test` has left nothing on the server (no key, node or
    /// row, no lock taken or awaited), a few seconds at most, and panics
    /// naming what is left; `keys` are the keys the test locked.
    async fn assert_nothing_left(&self, test: &str, keys: &[String]);
}

/// A backend whose locks live in this process, and what it still keeps.
pub trait KeysKept {
    /// The keys it still keeps an entry for (held, waited for, or leaked).
    fn keys_kept(&self) -> usize;

    /// Whether it answers `inspect` (the toy backend keeps the default,
    /// not supported).
    fn inspects(&self) -> bool {
        true
    }
}

/// An in-process backend as a subject: every "process" of a test is a
/// handle on the one backend (clones share their locks), there is no
/// server to cut off, and nothing is left once it keeps no key.
pub struct InProcess<B>(pub B);

impl<B: Backend + Clone + KeysKept> Subject for InProcess<B> {
    type Backend = B;

    async fn connect(&self, _test: &str) -> B {
        self.0.clone()
    }

    async fn connect_through_proxy(&self, _test: &str) -> Option<(Vec<FaultProxy>, B)> {
        None
    }

    fn inspects(&self) -> bool {
        self.0.inspects()
    }

    fn lists(&self) -> bool {
        self.0.inspects()
    }

    fn breaks_with(&self) -> Option<tower_lock::backend::BreakScope> {
        None
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        let backend = self.0.clone();
        super::eventually(&format!("{test}: every key forgotten"), move || {
            backend.keys_kept() == 0
        })
        .await;
    }
}

/// A runtime of the kind a contract test needs.
pub(crate) fn runtime(multi_thread: bool) -> tokio::runtime::Runtime {
    let mut builder = if multi_thread {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder.enable_all().build().unwrap()
}

/// After a contract test, while its backends still run (a lock left on a
/// live session shows): another process takes each of `keys` within five
/// seconds (releases may still be on their way), and the store shows
/// nothing left of `test`.
pub(crate) async fn assert_left_free<S: Subject>(subject: &S, test: &str, keys: &[String]) {
    use tower_lock::{BackendExt, LockError};
    let fresh = subject.connect(test).await;
    for key in keys {
        let mut last = None;
        for _ in 0..250 {
            match fresh.lock(key.as_str()).fail_fast().await {
                Ok(guard) => {
                    guard.release().await.unwrap();
                    last = None;
                    break;
                }
                Err(e @ LockError::Busy) => last = Some(e),
                Err(e) => panic!("locking {key} after the test: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(last.is_none(), "{key} still held 5 s after the test");
    }
    fresh.flush().await;
    subject.assert_nothing_left(test, keys).await;
}

/// The key `name` in `test`'s namespace.
pub(crate) fn key<S: Subject>(subject: &S, test: &str, name: &str) -> String {
    format!("{}:{name}", subject.namespace(test))
}

/// Eight tasks on two backends (two processes) lock one key ten times
/// each: one holder at a time, every token above the one before.
pub fn excludes_across_processes_with_rising_tokens<S: Subject>(subject: &S) {
    const TEST: &str = "contention";
    runtime(true).block_on(async {
        let (a, b) = (subject.connect(TEST).await, subject.connect(TEST).await);
        let hot = key(subject, TEST, "hot");
        super::excludes_with_increasing_tokens(&[a.clone(), b.clone()], &hot, 8, 10).await;
        assert_left_free(subject, TEST, &[hot]).await;
    })
}

/// Two processes, four workers each, lock one key in a loop: one holder
/// at a time, tokens rising, and (where the mode promises it) cohorting
/// inside a process keeps neither out.
pub fn processes_take_turns<S: Subject>(subject: &S) {
    const TEST: &str = "turns";
    runtime(true).block_on(async {
        let (a, b) = (subject.connect(TEST).await, subject.connect(TEST).await);
        let k = key(subject, TEST, "k");
        let counts = super::take_turns(&a, &b, &k, Duration::from_millis(1500)).await;
        println!("{}: held by each side: {counts:?}", a.name());
        if subject.takes_turns_across_processes() {
            super::assert_neither_starved(counts);
        } else {
            println!("held by each side: {counts:?} (no share promised)");
        }
        a.flush().await;
        b.flush().await;
        assert_left_free(subject, TEST, &[k]).await;
    })
}

/// Admission control is counted in the process, so it holds on every
/// store: with one request waiting and a cap of one, the next is refused
/// at once; the waiter is then served, and nothing is left behind.
pub fn the_waiter_past_the_cap_is_refused<S: Subject>(subject: &S) {
    const TEST: &str = "cap";
    runtime(true).block_on(async {
        let a = subject.connect(TEST).await;
        let locker = tower_lock::Locker::new(a.clone())
            .max_waiters(1)
            .wait(Duration::from_secs(30));
        let k = key(subject, TEST, "k");
        let held = locker.lock(&k).await.unwrap();
        let (asked, counted) = tokio::sync::oneshot::channel();
        let waiter = tokio::spawn({
            let (locker, k) = (locker.clone(), k.clone());
            async move {
                // Counted (or refused) as the acquisition is made.
                let acquisition = std::future::IntoFuture::into_future(locker.lock(&k));
                let _ = asked.send(());
                acquisition.await.map(|g| g.token())
            }
        });
        counted.await.unwrap();
        match locker.lock(&k).await {
            Err(tower_lock::LockError::Refused { waiting: 1, .. }) => {}
            other => panic!("{}: expected a refusal, got {other:?}", a.name()),
        }
        let token = held.token();
        drop(held);
        let next = waiter
            .await
            .unwrap()
            .expect("the admitted waiter is served");
        assert!(next > token, "{}: tokens rise", a.name());
        a.flush().await;
        assert_left_free(subject, TEST, &[k]).await;
    })
}

/// A request re-enters its own lock, through its locker and a clone of
/// the backend.
pub fn a_request_reenters_its_own_lock<S: Subject>(subject: &S) {
    const TEST: &str = "reentry";
    runtime(false).block_on(async {
        let a = subject.connect(TEST).await;
        let namespace = subject.namespace(TEST);
        super::reenters_under_the_layer(a.clone(), &namespace).await;
        let keys = [key(subject, TEST, "A1"), key(subject, TEST, "other")];
        assert_left_free(subject, TEST, &keys).await;
    })
}

/// A response, an error, a panic, a client gone and a cancelled wait each
/// release the request's lock at once.
pub fn every_end_of_a_request_releases_its_lock<S: Subject>(subject: &S) {
    const TEST: &str = "released";
    runtime(false).block_on(async {
        let (a, other) = (subject.connect(TEST).await, subject.connect(TEST).await);
        let namespace = subject.namespace(TEST);
        super::released_under_the_layer(a.clone(), other.clone(), &namespace).await;
        let keys = ["A-ok", "A-error", "A-panic", "A-gone", "A-wait"];
        let keys: Vec<String> = keys.iter().map(|k| key(subject, TEST, k)).collect();
        assert_left_free(subject, TEST, &keys).await;
    })
}

/// Twenty waiters in one process get the key in the order they asked,
/// where the mode promises it; each once, in some order, where not.
pub fn waiters_in_one_process_in_arrival_order<S: Subject>(subject: &S) {
    const TEST: &str = "fifo";
    let ordered = subject.serves_one_process_in_order();
    // One thread: each waiter queues before the next is spawned.
    runtime(false).block_on(async {
        let a = subject.connect(TEST).await;
        let k = key(subject, TEST, "k");
        super::waiters_in_one_process_in_arrival_order(a.clone(), &k, ordered).await;
        assert_left_free(subject, TEST, &[k]).await;
    })
}

/// Every operation dropped after each of its polls frees no other
/// holder's lock and leaves nothing behind.
pub fn every_operation_cut_at_every_await<S: Subject>(subject: &S) {
    const TEST: &str = "cut";
    runtime(true).block_on(async {
        let (a, other) = (subject.connect(TEST).await, subject.connect(TEST).await);
        let name = format!("{} ({})", a.name(), std::any::type_name::<S>());
        let k = key(subject, TEST, "k");
        super::cancel::every_cut(&name, &a, &other, &k).await;
        a.flush().await;
        other.flush().await;
        let keys: Vec<String> = [
            "release",
            "wait",
            "failfast",
            "flush",
            "nested",
            "nested-own",
            "thread",
        ]
        .iter()
        .map(|op| format!("{k}-{op}"))
        .chain((0..3).map(|i| format!("{k}-all-{i}")))
        .collect();
        assert_left_free(subject, TEST, &keys).await;
    })
}

/// A holder whose requests stop reaching the server is told its lock is
/// lost before another process is granted it.
pub fn a_holder_cut_off_is_told_before_another_is_granted<S: Subject>(subject: &S) {
    const TEST: &str = "cut-off";
    runtime(true).block_on(async {
        let Some((proxies, cut)) = subject.connect_through_proxy(TEST).await else {
            println!("{}: no server to cut off", std::any::type_name::<S>());
            return;
        };
        let other = subject.connect(TEST).await;
        let k = key(subject, TEST, "k");
        // Where the lease is the request's (Redis), a short one; the
        // stores whose lease is their session's take it from the subject.
        let held = tower_lock::BackendExt::lock(&cut, k.as_str())
            .lease(Duration::from_secs(2))
            .await
            .unwrap();
        let (told, granted) = super::cut_off_holder_is_told_first(
            &held,
            &proxies,
            &other,
            &k,
            !subject.server_frees_a_silent_holder(),
        )
        .await;
        println!("cut off: told after {told} ms, the other granted after {granted} ms");
        drop(held);
        other.flush().await;
        assert_left_free(subject, TEST, &[k]).await;
    })
}

/// Starts the servers a test keeps for itself (a cluster) on a runtime of
/// their own, then calls `run` with them and cohorting on, then off: it
/// runs [`every_contract_test`] on its subject for them.
pub fn on_servers_of_its_own<T>(
    servers: impl std::future::Future<Output = T>,
    run: impl Fn(&T, bool),
) {
    let servers = runtime(true).block_on(servers);
    for cohort in [true, false] {
        run(&servers, cohort);
    }
}

/// A mode's cohort options: the default, or off.
pub fn cohort(on: bool) -> tower_lock::backend::CohortOptions {
    if on {
        Default::default()
    } else {
        tower_lock::backend::CohortOptions::off()
    }
}

/// Asks `left` what is left on the servers until it finds nothing, five
/// seconds at most (releases may be on their way); panics naming it.
pub async fn until_nothing_left<F>(what: &str, mut left: impl FnMut() -> F)
where
    F: std::future::Future<Output = Vec<String>>,
{
    let mut found = Vec::new();
    for _ in 0..250 {
        found = left().await;
        if found.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what} left behind: {found:?}");
}

/// Every contract test above, one after another: for a mode whose servers
/// its test starts for itself.
pub fn every_contract_test<S: Subject>(subject: &S) {
    excludes_across_processes_with_rising_tokens(subject);
    processes_take_turns(subject);
    a_request_reenters_its_own_lock(subject);
    every_end_of_a_request_releases_its_lock(subject);
    waiters_in_one_process_in_arrival_order(subject);
    every_operation_cut_at_every_await(subject);
    a_holder_cut_off_is_told_before_another_is_granted(subject);
    the_waiter_past_the_cap_is_refused(subject);
    another_process_sees_who_holds_a_key(subject);
    another_process_lists_the_held_keys(subject);
    a_broken_holder_is_fenced_out(subject);
}

/// The suite for one subject (an expression whose type is a [`Subject`]):
/// one `#[test]` per contract test, in the module it is written in.
#[allow(unused_macros)] // a file with only a cluster instantiation
macro_rules! conformance {
    ($subject:expr) => {
        #[test]
        fn excludes_across_processes_with_rising_tokens() {
            $crate::common::contract::excludes_across_processes_with_rising_tokens(&$subject);
        }
        #[test]
        fn processes_take_turns() {
            $crate::common::contract::processes_take_turns(&$subject);
        }
        #[test]
        fn the_waiter_past_the_cap_is_refused() {
            $crate::common::contract::the_waiter_past_the_cap_is_refused(&$subject);
        }
        #[test]
        fn another_process_sees_who_holds_a_key() {
            $crate::common::contract::another_process_sees_who_holds_a_key(&$subject);
        }
        #[test]
        fn another_process_lists_the_held_keys() {
            $crate::common::contract::another_process_lists_the_held_keys(&$subject);
        }
        #[test]
        fn a_broken_holder_is_fenced_out() {
            $crate::common::contract::a_broken_holder_is_fenced_out(&$subject);
        }
        #[test]
        fn a_request_reenters_its_own_lock() {
            $crate::common::contract::a_request_reenters_its_own_lock(&$subject);
        }
        #[test]
        fn every_end_of_a_request_releases_its_lock() {
            $crate::common::contract::every_end_of_a_request_releases_its_lock(&$subject);
        }
        #[test]
        fn waiters_in_one_process_in_arrival_order() {
            $crate::common::contract::waiters_in_one_process_in_arrival_order(&$subject);
        }
        #[test]
        fn every_operation_cut_at_every_await() {
            $crate::common::contract::every_operation_cut_at_every_await(&$subject);
        }
        #[test]
        fn a_holder_cut_off_is_told_before_another_is_granted() {
            $crate::common::contract::a_holder_cut_off_is_told_before_another_is_granted(&$subject);
        }
    };
}
#[allow(unused_imports)]
pub(crate) use conformance;
