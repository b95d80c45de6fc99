//! Taking turns: the lease table keeps no queue. A release that was marked
//! wanted notifies the waiters elsewhere, and they ask for the row again as
//! they hear it; this process's next acquire of the key, sent right behind
//! the release on the same connection, would land first nearly every time.
//! So the [`Cohort`](crate::backend::Cohort) holds it back
//! ([`LeaseHandle::hand_off`](crate::backend::LeaseHandle::hand_off)) for
//! as long as the others need to ask.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::futures::OwnedNotified;
use tokio::time::Instant;

use super::listen::Watch;
use super::LeaseTable;

/// The longest a hand-off waits for this process's listener to hear the
/// release (a listener that lost its connection may never).
const MOST_HEARD: Duration = Duration::from_millis(100);
/// The longest it waits once the release is heard.
const MOST_GRACE: Duration = Duration::from_millis(10);

/// A wait for a release's notification, armed before the release is sent.
pub(super) struct Armed {
    /// A clone of the watch's wake-up: dropped before the watch (fields
    /// drop in order), which then sees whether it was the key's last.
    heard: Pin<Box<OwnedNotified>>,
    /// Keeps the key's wake-up registered with the listener.
    _watch: Watch,
    sent: Instant,
}

impl LeaseTable {
    /// Armed just before a release of `key` is sent, where the listener
    /// hears releases (without notifications, the waiters elsewhere only
    /// look again now and then: nothing to time a turn by).
    pub(super) fn arm_hand_off(self: &Arc<Self>, key: &str) -> Option<Armed> {
        if !self.notifications() {
            return None;
        }
        let watch = self.watch(key);
        let mut heard = Box::pin(watch.notify.clone().notified_owned());
        heard.as_mut().enable();
        Some(Armed {
            heard,
            _watch: watch,
            sent: Instant::now(),
        })
    }
}

impl Armed {
    /// Ends when the waiters elsewhere have had time to ask for the row:
    /// they hear of the release about when this process's listener does,
    /// then their statement has to reach the server, wake, and land. The
    /// wait after hearing is twice the time from the release's send to
    /// this wait seeing its notification (at least a round trip and a
    /// commit; later, if the notification came before the answer). With
    /// once as long, two one-worker processes (the server test) followed a
    /// hold with another of their own about 28 % of the time, against 14
    /// to 30 % with twice and over half the time with none (measured when
    /// every lone release handed off; 22 to 24 % now that only a contended
    /// lock's does). Its end says
    /// nothing of who got the row: this process's next acquire then finds
    /// it taken, and waits its turn, or free.
    ///
    /// Not ended early by the next release heard, as Redis's is: one that
    /// notified nobody (the row's holder asked first, so nobody marked it)
    /// is not heard, and when that came first, most holds followed one of
    /// the same process (71 to 80 of 200 in the test).
    pub(super) async fn wait(self) {
        if tokio::time::timeout(MOST_HEARD, self.heard).await.is_ok() {
            tokio::time::sleep((self.sent.elapsed() * 2).min(MOST_GRACE)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::lock;
    use std::sync::atomic::Ordering;

    fn table() -> Arc<LeaseTable> {
        let config = tokio_postgres::Config::new();
        LeaseTable::new(
            config,
            None,
            "test".into(),
            Duration::from_secs(1),
            "t",
            "s",
        )
    }

    /// The wait is for the notification, then twice as long as it took.
    #[tokio::test(start_paused = true)]
    async fn waits_for_the_release_to_be_heard_then_as_long_again() {
        let table = table();
        table.notified.store(true, Ordering::Release);
        let armed = table.arm_hand_off("k").expect("armed while notified");
        let start = tokio::time::Instant::now();
        let wait = tokio::spawn(armed.wait());
        tokio::time::sleep(Duration::from_millis(4)).await;
        table.heard("k");
        wait.await.unwrap();
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(12) && took < Duration::from_millis(13),
            "{took:?}"
        );
        // The wake-up left with the wait.
        assert!(!lock(&table.waiters).contains_key("k"));
    }

    /// An armed wait dropped unawaited (a release that notified nobody,
    /// or whose hand-off was not asked for) leaves no wake-up behind.
    #[tokio::test]
    async fn a_wait_dropped_unawaited_leaves_the_key_unwatched() {
        let table = table();
        table.notified.store(true, Ordering::Release);
        drop(table.arm_hand_off("k").unwrap());
        assert!(lock(&table.waiters).is_empty());
        // Beside a waiter's wake-up of the same key, the waiter's stays.
        let waiter = table.watch("k");
        drop(table.arm_hand_off("k").unwrap());
        assert!(lock(&table.waiters).contains_key("k"));
        drop(waiter);
        assert!(lock(&table.waiters).is_empty());
    }

    /// Never heard: over after [`MOST_HEARD`], with no grace after.
    #[tokio::test(start_paused = true)]
    async fn a_release_never_heard_ends_the_wait_at_its_bound() {
        let table = table();
        table.notified.store(true, Ordering::Release);
        let start = tokio::time::Instant::now();
        table.arm_hand_off("k").unwrap().wait().await;
        assert_eq!(start.elapsed(), MOST_HEARD);
    }

    /// Heard at once, a slow notification still waits no more than the
    /// grace's bound; and where none arrive, nothing is armed.
    #[tokio::test(start_paused = true)]
    async fn the_grace_is_bounded_and_off_without_notifications() {
        let table = table();
        assert!(table.arm_hand_off("k").is_none());
        table.notified.store(true, Ordering::Release);
        let armed = table.arm_hand_off("k").unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        table.heard("k");
        let start = tokio::time::Instant::now();
        armed.wait().await;
        assert_eq!(start.elapsed(), MOST_GRACE);
    }
}
