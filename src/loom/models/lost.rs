//! The lost signal: `fire` sets the flag, then takes the wakers under the
//! lock; `poll_lost` checks the flag, and again under the lock before it
//! pushes its waker. Any interleaving must wake the waiter or let it see
//! the flag.

use super::{model, poll_once};
use crate::lost::LostTrigger;
use std::task::Poll;

/// A holder awaiting `lost()` while another thread fires: it always
/// completes (no wake-up lost between its check and its subscription), and
/// then reads the reason the fire gave.
pub fn a_fire_racing_a_subscribing_waiter_always_wakes_it() {
    model(|| {
        let trigger = LostTrigger::new();
        let signal = trigger.signal();
        let firing = loom::thread::spawn(move || trigger.fire("the lease ran out"));
        loom::future::block_on(signal.lost());
        assert!(signal.is_lost());
        assert_eq!(signal.reason(), Some("the lease ran out"));
        firing.join().unwrap();
    });
}

/// Two fires racing each other and a waiter: one reason wins and every
/// reader sees that one; the waiter completes.
pub fn racing_fires_keep_one_reason() {
    model(|| {
        let trigger = LostTrigger::new();
        let (signal, other) = (trigger.signal(), trigger.clone());
        let first = loom::thread::spawn(move || trigger.fire("first"));
        let second = loom::thread::spawn(move || other.fire("second"));
        loom::future::block_on(signal.lost());
        let reason = signal.reason().map(str::to_owned);
        first.join().unwrap();
        second.join().unwrap();
        assert!(matches!(reason.as_deref(), Some("first" | "second")));
        assert_eq!(signal.reason(), reason.as_deref(), "the reason changed");
    });
}

/// A check that found the lock held, and a wait polled once and dropped
/// (a `select!` that went the other way), racing a fire: nothing panics,
/// and a later check sees the loss.
pub fn a_dropped_wait_racing_a_fire_loses_nothing() {
    model(|| {
        let trigger = LostTrigger::new();
        let signal = trigger.signal();
        let firing = loom::thread::spawn(move || trigger.fire("gone"));
        let early = signal.is_lost();
        let mut lost = signal.lost();
        let polled = poll_once(&mut lost);
        drop(lost);
        firing.join().unwrap();
        assert!(signal.is_lost());
        // What the holder saw before the join can only be "not yet" or "lost".
        assert!(!early || polled == Poll::Ready(()));
    });
}
