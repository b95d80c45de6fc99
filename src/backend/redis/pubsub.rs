//! Release messages: one subscription per key's channel while anyone
//! waits on it, shared by the backend's waiters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::{PushInfo, PushKind, Value};
use std::pin::Pin;

use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;

use super::connection::{Connection, Link};
use crate::sync::lock;

/// What a hand-off waits on ([`Watches::hand_off_wait`]).
pub(super) enum HandOffWait {
    /// Hand-offs on the channel are off.
    Off,
    /// Not subscribed: subscribe ([`Watches::watch`]) and ask again.
    Unsubscribed,
    /// Ends at the next release by another backend.
    Armed(Pin<Box<OwnedNotified>>),
}

/// Idle subscriptions are dropped after this long.
const SUBSCRIPTION_LINGER: Duration = Duration::from_secs(10);

/// Waiters' interest in release channels, shared with the push handler.
#[derive(Default)]
pub(super) struct Watches {
    channels: Mutex<HashMap<String, Channel>>,
    /// What this backend's owner tokens begin with: a release message
    /// carrying one is its own.
    own: String,
    /// Woken on a lost connection: renewals check their lease at once.
    pub(super) reconnected: Arc<Notify>,
}

struct Channel {
    /// Woken by every message and lost subscription: see `for_us`.
    notify: Arc<Notify>,
    /// Messages (and lost subscriptions) on the channel so far.
    messages: u64,
    /// The count of `messages` at the last one this backend's waiters must
    /// act on: a release that named none of them elsewhere (it named one
    /// of theirs, or nobody), or a lost subscription. A message naming a
    /// waiter of another backend comes to the one queued behind it, which
    /// looks once that waiter's turn is over.
    for_us: u64,
    /// Subscriptions the server ended, so far.
    ended: u64,
    /// Told of releases by other backends (other processes) only.
    others: Arc<Notify>,
    /// Whether a release heard by other subscribers is handed off to them
    /// (see [`Watches::hand_off_wait`]): off once a hand-off went
    /// unanswered, on again when another backend's release is heard.
    hand_offs: bool,
    /// The waiters here that a release may grant the lock directly, by
    /// token, with the last grant each heard of.
    grantees: HashMap<String, Option<Grant>>,
    users: usize,
    subscribed: bool,
    idle_since: Option<tokio::time::Instant>,
}

impl Watches {
    /// For a backend whose owner tokens begin with `own`.
    pub(super) fn new(own: String) -> Self {
        Watches {
            own,
            ..Watches::default()
        }
    }

    /// Handles a RESP3 push from the connection.
    pub(super) fn on_push(&self, info: PushInfo) {
        match info.kind {
            // `SMessage`: a sharded channel's, on a cluster.
            PushKind::Message | PushKind::SMessage => {
                let (Some(Value::BulkString(channel)), message) =
                    (info.data.first(), info.data.get(1))
                else {
                    return;
                };
                let mut channels = lock(&self.channels);
                if let Some(c) = std::str::from_utf8(channel)
                    .ok()
                    .and_then(|c| channels.get_mut(c))
                {
                    let own = self.own.as_bytes();
                    let message = match message {
                        Some(Value::BulkString(m)) => &m[..],
                        _ => &[],
                    };
                    // `releasing-token[ successor-token[ last reserved]]`:
                    // a backend's tokens begin with its prefix.
                    let successor = message
                        .iter()
                        .position(|&b| b == b' ')
                        .map(|i| &message[i + 1..]);
                    if let Some((named, grant)) = successor.and_then(Grant::parse) {
                        if let Some(heard) = c.grantees.get_mut(named) {
                            *heard = Some(grant);
                        }
                    }
                    c.messages += 1;
                    if successor.is_none_or(|s| s.starts_with(own)) {
                        c.for_us = c.messages;
                    }
                    c.notify.notify_waiters();
                    if !message.starts_with(own) {
                        c.others.notify_waiters();
                        c.hand_offs = true;
                    }
                }
            }
            // On a cluster, the server ends a sharded subscription when
            // its slot moves away (and on our own `SUNSUBSCRIBE`): its
            // waiters subscribe again on their next look, and look now,
            // since a message may have been missed.
            // And a plain subscription's end, in the order the server sent
            // it: the sweep's UNSUBSCRIBE of a channel watched again since.
            PushKind::SUnsubscribe | PushKind::Unsubscribe => {
                if let Some(Value::BulkString(channel)) = info.data.first() {
                    let mut channels = lock(&self.channels);
                    if let Some(c) = std::str::from_utf8(channel)
                        .ok()
                        .and_then(|c| channels.get_mut(c))
                    {
                        c.subscribed = false;
                        c.ended += 1;
                        c.wake();
                    }
                }
            }
            PushKind::Disconnection => self.disconnected(),
            _ => {}
        }
    }

    /// Messages may have been missed: every waiter looks again, and every
    /// holder checks its lease.
    fn disconnected(&self) {
        self.wake_waiters();
        self.renew_now();
    }

    /// Every waiter looks again.
    fn wake_waiters(&self) {
        for c in lock(&self.channels).values_mut() {
            c.wake();
        }
    }

    /// Every holder renews at once (its lease may be gone with the server).
    pub(super) fn renew_now(&self) {
        self.reconnected.notify_waiters();
    }

    /// Whether any channel is watched or lingers.
    pub(super) fn any(&self) -> bool {
        !lock(&self.channels).is_empty()
    }

    /// Whether this connection is subscribed to `channel` (a waiter's
    /// subscription lingers a while after the wait).
    pub(super) fn subscribed(&self, channel: &str) -> bool {
        lock(&self.channels)
            .get(channel)
            .is_some_and(|c| c.subscribed)
    }

    /// For a release of this backend's that other subscribers of `channel`
    /// heard: a wait, armed now, for another backend's next release there,
    /// if this connection is subscribed to hear it and hand-offs on the
    /// channel are on. A subscriber elsewhere may be no waiter (a
    /// subscription lingers after its wait): [`Watches::unanswered`] turns
    /// hand-offs off until another backend's release is heard.
    pub(super) fn hand_off_wait(&self, channel: &str) -> HandOffWait {
        let channels = lock(&self.channels);
        match channels.get(channel) {
            Some(c) if !c.hand_offs => HandOffWait::Off,
            Some(c) if c.subscribed => {
                let mut released = Box::pin(c.others.clone().notified_owned());
                released.as_mut().enable();
                HandOffWait::Armed(released)
            }
            _ => HandOffWait::Unsubscribed,
        }
    }

    /// A hand-off on `channel` went unanswered: no more until another
    /// backend's release is heard there.
    pub(super) fn unanswered(&self, channel: &str) {
        if let Some(c) = lock(&self.channels).get_mut(channel) {
            c.hand_offs = false;
        }
    }

    /// Registers interest in `channel`, subscribing on `conn` if nobody
    /// else is.
    /// `grantee`, the token of a waiter that a release may grant the lock
    /// directly: its grants are kept for [`Watch::grant`].
    pub(super) async fn watch(
        self: &Arc<Self>,
        conn: &Connection,
        channel: &str,
        grantee: Option<&str>,
    ) -> Watch {
        let notify = {
            let mut channels = lock(&self.channels);
            let c = channels
                .entry(channel.to_owned())
                .or_insert_with(|| Channel {
                    notify: Arc::new(Notify::new()),
                    messages: 0,
                    for_us: 0,
                    ended: 0,
                    others: Arc::new(Notify::new()),
                    hand_offs: true,
                    grantees: HashMap::new(),
                    users: 0,
                    subscribed: false,
                    idle_since: None,
                });
            c.users += 1;
            c.idle_since = None;
            if let Some(token) = grantee {
                c.grantees.insert(token.to_owned(), None);
            }
            c.notify.clone()
        };
        let watch = Watch {
            watches: self.clone(),
            channel: channel.to_owned(),
            notify,
            grantee: grantee.map(str::to_owned),
        };
        watch.subscribe(conn).await;
        watch
    }
}

impl Channel {
    /// Every waiter looks again (messages may have been missed).
    fn wake(&mut self) {
        self.messages += 1;
        self.for_us = self.messages;
        self.notify.notify_waiters();
    }
}

/// A wait on a channel, armed: see [`Watch::arm`].
pub(super) struct Armed {
    /// Ends at the channel's next message or lost subscription.
    pub(super) released: Pin<Box<OwnedNotified>>,
    /// The channel's count of messages when it was armed.
    seen: u64,
}

/// A direct grant a release message carried: the lock is the named
/// waiter's, with the fencing tokens up to `last`, `reserved` of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Grant {
    pub(super) last: u64,
    pub(super) reserved: u32,
}

impl Grant {
    /// `named last reserved`: the named token and its grant; None for a
    /// message that names a waiter without granting it the lock.
    fn parse(successor: &[u8]) -> Option<(&str, Grant)> {
        let text = std::str::from_utf8(successor).ok()?;
        let mut parts = text.split(' ');
        let (named, last, reserved) = (parts.next()?, parts.next()?, parts.next()?);
        let grant = Grant {
            last: last.parse().ok()?,
            reserved: reserved.parse().ok()?,
        };
        (parts.next().is_none() && grant.last > 0 && grant.reserved > 0).then_some((named, grant))
    }
}

impl Watch {
    /// The last direct grant this waiter heard of (see `scripts::hand_on`),
    /// if it is a grantee.
    pub(super) fn grant(&self) -> Option<Grant> {
        let token = self.grantee.as_deref()?;
        let channels = lock(&self.watches.channels);
        channels.get(&self.channel)?.grantees.get(token).copied()?
    }

    /// Forgets the last direct grant heard: see [`Watch::grant`].
    pub(super) fn forget_grant(&self) {
        let Some(token) = self.grantee.as_deref() else {
            return;
        };
        if let Some(heard) = lock(&self.watches.channels)
            .get_mut(&self.channel)
            .and_then(|c| c.grantees.get_mut(token))
        {
            *heard = None;
        }
    }

    /// A wait for the channel's next message (or lost subscription), armed
    /// now: a message from here on ends it.
    pub(super) fn arm(&self) -> Armed {
        // Enabled and counted under the lock the push handler counts and
        // notifies under: a message comes either before both or after both.
        let channels = lock(&self.watches.channels);
        let mut released = Box::pin(self.notify.clone().notified_owned());
        released.as_mut().enable();
        let seen = channels.get(&self.channel).map_or(0, |c| c.messages);
        Armed { released, seen }
    }

    /// Whether a message since `armed` calls on this backend's waiters to
    /// look now (see `Channel::for_us`); if not, `armed` waits for the next
    /// one, re-armed under the same lock, so that none comes in between.
    pub(super) fn for_us_or_rearm(&self, armed: &mut Armed) -> bool {
        let channels = lock(&self.watches.channels);
        let Some(c) = channels.get(&self.channel) else {
            return true;
        };
        if c.for_us > armed.seen {
            return true;
        }
        armed.released = Box::pin(self.notify.clone().notified_owned());
        armed.released.as_mut().enable();
        armed.seen = c.messages;
        false
    }

    /// Subscribes on `conn` unless subscribed already (by this waiter or
    /// another): at the start of a wait, and again on every look while
    /// the server has ended the subscription. Subscribed, a flag check.
    pub(super) async fn subscribe(&self, conn: &Connection) {
        let ended = match lock(&self.watches.channels).get(&self.channel) {
            Some(c) if c.subscribed => return,
            Some(c) => c.ended,
            None => 0,
        };
        match conn.get().subscribe(&self.channel).await {
            Ok(()) => {
                // Not if the server ended a subscription meanwhile: it may
                // have been this one (the sweep's UNSUBSCRIBE sent after
                // it); the next look subscribes again.
                if let Some(c) = lock(&self.watches.channels).get_mut(&self.channel) {
                    c.subscribed = c.ended == ended;
                }
            }
            // Without the subscription the waiter still re-checks at the
            // holder's remaining lease.
            Err(e) => {
                let channel = self.channel.as_str();
                tracing::warn!(channel, error = %e, "could not subscribe to lock releases")
            }
        }
    }
}

impl Watches {
    /// The commands now go to `conn` (a new master): subscribes there to
    /// every channel in use, and wakes every waiter, since messages may
    /// have been missed. (Holders were told to renew when the connection
    /// moved, before any lock is taken on the new master.)
    pub(super) async fn moved(&self, conn: &Link) {
        let channels: Vec<String> = lock(&self.channels).keys().cloned().collect();
        for channel in channels {
            let subscribed = conn.clone().subscribe(&channel).await.is_ok();
            if let Some(c) = lock(&self.channels).get_mut(&channel) {
                c.subscribed = subscribed;
            }
        }
        self.wake_waiters();
    }
}

/// Unsubscribes from channels nobody has waited on for a while. Stops when
/// the backend is dropped.
pub(super) async fn sweep_subscriptions(watches_weak: Weak<Watches>, conn: Weak<Connection>) {
    loop {
        tokio::time::sleep(SUBSCRIPTION_LINGER).await;
        let Some(watches) = watches_weak.upgrade() else {
            return;
        };
        let now = tokio::time::Instant::now();
        let idle: Vec<String> = {
            let mut channels = lock(&watches.channels);
            let idle: Vec<String> = channels
                .iter()
                .filter(|(_, c)| {
                    c.users == 0 && c.idle_since.is_some_and(|t| now - t >= SUBSCRIPTION_LINGER)
                })
                .map(|(name, _)| name.clone())
                .collect();
            for name in &idle {
                channels.remove(name);
            }
            idle
        };
        drop(watches);
        let Some(mut conn) = conn.upgrade().map(|c| c.get()) else {
            return;
        };
        for name in &idle {
            let _ = conn.unsubscribe(name).await;
        }
        // A channel watched again meanwhile may have sent its SUBSCRIBE
        // before this UNSUBSCRIBE: its waiters subscribe again and look.
        let Some(watches) = watches_weak.upgrade() else {
            return;
        };
        let mut channels = lock(&watches.channels);
        for name in &idle {
            if let Some(c) = channels.get_mut(name) {
                c.subscribed = false;
                c.wake();
            }
        }
    }
}

/// A waiter's interest in a release channel.
pub(super) struct Watch {
    watches: Arc<Watches>,
    channel: String,
    pub(super) notify: Arc<Notify>,
    /// The waiter's token, if a release may grant it the lock directly.
    grantee: Option<String>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(c) = lock(&self.watches.channels).get_mut(&self.channel) {
            if let Some(token) = &self.grantee {
                c.grantees.remove(token);
            }
            c.users -= 1;
            if c.users == 0 {
                c.idle_since = Some(tokio::time::Instant::now());
            }
        }
    }
}
