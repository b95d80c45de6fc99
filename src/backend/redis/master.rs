//! Following the master through failovers, with Redis Sentinel.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Weak;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{
    AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind,
    RedisConnectionInfo, Value,
};
use tokio::sync::mpsc;

use super::connection::Connection;
use super::layout::redis_error;
use super::pubsub::Watches;
use super::urls::SentinelUrl;
use crate::error::LockError;

/// The channel on which Sentinels announce a new master.
const SWITCH_MASTER: &str = "+switch-master";
/// The longest pause before asking the Sentinels again after they could
/// not be reached.
const RETRY_CAP: Duration = Duration::from_secs(1);
/// How long one Sentinel may take to connect or answer.
const SENTINEL_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the Sentinel subscription is pinged: a Sentinel that stopped
/// answering (paused, cut off) would never pass on a master switch.
const SUBSCRIPTION_PING: Duration = Duration::from_secs(1);
/// Asks made on failed commands come at least this far apart once they
/// keep coming (doubling from `FIRST_GAP` up to `GAP_CAP`), so that a
/// master that fails every command does not send every client to the
/// Sentinels on every command.
const FIRST_GAP: Duration = Duration::from_millis(25);
/// Within the default response timeout, which bounds how long a lock
/// waits for the master to be confirmed (an ask itself waits up to a
/// second for a Sentinel that does not answer).
const GAP_CAP: Duration = Duration::from_millis(250);
/// Asks this far apart reset the gap.
const CALM: Duration = Duration::from_secs(5);

/// Finds the master, connects to it, and keeps following it.
pub(super) struct Master {
    sentinels: Vec<ConnectionInfo>,
    name: String,
    /// Database, credentials and protocol for the master.
    redis: RedisConnectionInfo,
    config: ConnectionManagerConfig,
    /// The master's address as last connected to, and its config epoch.
    address: String,
    epoch: u64,
}

/// What one Sentinel says of the master: its address and the config epoch
/// of that configuration.
struct Named {
    host: String,
    port: u16,
    epoch: u64,
    /// The Sentinels agree it is down (`o_down`): a failover is under way.
    down: bool,
    /// This Sentinel leads a failover of it: from the promotion until the
    /// switch it names the old address under the new epoch.
    failing_over: bool,
}

impl Master {
    /// Asks the Sentinels for the master and connects to it.
    pub(super) async fn connect(
        url: &SentinelUrl,
        config: ConnectionManagerConfig,
    ) -> Result<(Master, ConnectionManager), LockError> {
        let sentinels = url
            .sentinels
            .iter()
            .map(|h| format!("redis://{h}").into_connection_info())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| redis_error("reading the Sentinel addresses", e))?;
        let mut master = Master {
            sentinels,
            name: url.master.clone(),
            redis: url.redis.clone(),
            config,
            address: String::new(),
            epoch: 0,
        };
        let conn = master
            .find(false)
            .await?
            .ok_or_else(|| LockError::backend("redis", "the Sentinels named no master", None))?;
        Ok((master, conn))
    }

    /// The config epoch under which the Sentinels named the master last
    /// connected to (or confirmed).
    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Asks every Sentinel at once; a majority of those listed must give an
    /// answer to trust, and the one with the highest config epoch wins. A
    /// Sentinel that has not yet heard of a failover names the old master
    /// under an older epoch, and the old master (paused, or cut off) may
    /// still call itself master: the first answer, or a `ROLE` check alone,
    /// could lead back to it, and so could one Sentinel cut off from the
    /// others, alone or beside a failover's leader (whose answer is left
    /// out).
    async fn ask(&self) -> Result<Named, LockError> {
        let mut asking = tokio::task::JoinSet::new();
        for info in &self.sentinels {
            let (info, name) = (info.clone(), self.name.clone());
            asking.spawn(async move {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(SENTINEL_TIMEOUT))
                    .set_response_timeout(Some(SENTINEL_TIMEOUT));
                let mut conn = redis::Client::open(info)?
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                let fields: HashMap<String, String> = redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(&name)
                    .query_async(&mut conn)
                    .await?;
                let field = |k: &str| fields.get(k).cloned().unwrap_or_default();
                Ok::<_, redis::RedisError>(Named {
                    host: field("ip"),
                    port: field("port").parse().unwrap_or(0),
                    epoch: field("config-epoch").parse().unwrap_or(0),
                    down: field("flags").contains("o_down"),
                    failing_over: field("flags").contains("failover_in_progress"),
                })
            });
        }
        let majority = self.sentinels.len() / 2 + 1;
        let mut answers = Vec::new();
        let mut last_error = None;
        // Every answer, each within `SENTINEL_TIMEOUT`: the one Sentinel
        // that knows of the latest failover may answer last.
        while let Some(answer) = asking.join_next().await {
            match answer {
                Ok(Ok(named)) if named.port != 0 => answers.push(named),
                Ok(Err(e)) => last_error = Some(e),
                _ => {}
            }
        }
        // The leader of a failover names the old master under the new epoch
        // until it switches: not an answer to trust.
        let answered = answers.len();
        answers.retain(|n| !n.failing_over);
        if answered > 0 && answers.len() < majority {
            let leading = answered - answers.len();
            let leading = match leading {
                0 => String::new(),
                n => format!(" ({n} more leading a failover)"),
            };
            return Err(LockError::backend(
                "redis",
                format!(
                    "{} of {} Sentinels named the master {:?}{leading}, and a majority \
                     ({majority}) must: a Sentinel cut off from the others may name a \
                     master they have replaced",
                    answers.len(),
                    self.sentinels.len(),
                    self.name
                ),
                last_error.map(|e| Box::new(e) as crate::error::BoxError),
            ));
        }
        let newest = answers.iter().map(|n| n.epoch).max();
        let newest: Vec<Named> = answers
            .into_iter()
            .filter(|n| Some(n.epoch) == newest)
            .collect();
        // A master the Sentinels agree is down is not confirmed: it may be
        // paused and about to be replaced, and run what it queued once it
        // resumes.
        if newest.iter().any(|n| n.down) {
            return Err(LockError::backend(
                "redis",
                format!("the Sentinels find the master {:?} down", self.name),
                None,
            ));
        }
        if newest
            .iter()
            .any(|n| (&n.host, n.port) != (&newest[0].host, newest[0].port))
        {
            return Err(LockError::backend(
                "redis",
                format!(
                    "the Sentinels name two masters {:?} under one epoch (a failover is ending)",
                    self.name
                ),
                None,
            ));
        }
        let best = newest.into_iter().next();
        best.ok_or_else(|| match last_error {
            Some(e) => redis_error(
                &format!("asking the Sentinels for the master {:?}", self.name),
                e,
            ),
            None => LockError::backend(
                "redis",
                format!("no Sentinel knows the master {:?}", self.name),
                None,
            ),
        })
    }

    /// Connects to the master the Sentinels name, if it is not the one
    /// connected to already.
    ///
    /// With `again`, connects anew even to the same address: after the
    /// connection broke, the `ConnectionManager` would reconnect to that
    /// address whatever runs there now, such as a restarted, empty server
    /// that calls itself master until the Sentinels convert it.
    async fn find(&mut self, again: bool) -> Result<Option<ConnectionManager>, LockError> {
        let named = self.ask().await?;
        if named.epoch < self.epoch {
            return Err(LockError::backend(
                "redis",
                "the Sentinels that answered have not heard of the last failover",
                None,
            ));
        }
        let address = if named.host.contains(':') {
            format!("[{}]:{}", named.host, named.port)
        } else {
            format!("{}:{}", named.host, named.port)
        };
        if address == self.address && !again {
            self.epoch = named.epoch;
            return Ok(None);
        }
        let info = format!("redis://{address}")
            .into_connection_info()
            .map_err(|e| redis_error("reading the master's address", e))?
            .set_redis_settings(self.redis.clone());
        let mut conn = redis::Client::open(info)
            .map_err(|e| redis_error("reading the master's address", e))?
            .get_connection_manager_with_config(self.config.clone())
            .await
            .map_err(|e| redis_error(&format!("connecting to the master at {address}"), e))?;
        // Not yet promoted (the Sentinels are mid-failover): ask again later.
        let role: Vec<Value> = redis::cmd("ROLE")
            .query_async(&mut conn)
            .await
            .map_err(|e| redis_error(&format!("asking {address} for its role"), e))?;
        if !matches!(role.first(), Some(Value::BulkString(r)) if r == b"master") {
            return Err(LockError::backend(
                "redis",
                format!("{address}, named master by the Sentinels, is not (yet) a master"),
                None,
            ));
        }
        if !self.address.is_empty() && address != self.address {
            tracing::warn!(
                master = self.name,
                from = self.address,
                to = address,
                "Redis master moved: locks not replicated before the failover are lost"
            );
        }
        self.address = address;
        self.epoch = named.epoch;
        Ok(Some(conn))
    }

    /// A connection to one of the Sentinels, tried in turn from the
    /// `from`th, subscribed to master switches, whose messages and
    /// disconnection come on `pushes`; and which Sentinel it is.
    async fn subscribe(
        &self,
        pushes: mpsc::UnboundedSender<PushInfo>,
        from: usize,
    ) -> Option<(usize, redis::aio::MultiplexedConnection)> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(SENTINEL_TIMEOUT))
            .set_response_timeout(Some(SENTINEL_TIMEOUT))
            .set_push_sender(pushes);
        let n = self.sentinels.len();
        for i in (from..from + n).map(|i| i % n) {
            let info = self.sentinels[i].clone().set_redis_settings(
                RedisConnectionInfo::default().set_protocol(ProtocolVersion::RESP3),
            );
            let Ok(client) = redis::Client::open(info) else {
                continue;
            };
            let Ok(mut conn) = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
            else {
                continue;
            };
            if conn.subscribe(SWITCH_MASTER).await.is_ok() {
                return Some((i, conn));
            }
        }
        None
    }

    /// Whether a push announces a new master for this name.
    fn switched(&self, push: &PushInfo) -> bool {
        let payload = match (&push.kind, push.data.as_slice()) {
            (PushKind::Message, [_, Value::BulkString(payload)]) => payload,
            _ => return false,
        };
        // "<name> <old ip> <old port> <new ip> <new port>"
        payload.split(|b| *b == b' ').next() == Some(self.name.as_bytes())
    }
}

/// Follows the master: asks the Sentinels again when one announces a
/// switch, when a command failed (paced, see [`Pace`]), and after
/// (re)subscribing; moves the connection, and once the new master is
/// confirmed the release subscriptions, to a new master. Pings the
/// Sentinel it listens to, and listens to another when that one stops
/// answering. Stops when the backend is dropped.
pub(super) async fn follow(mut master: Master, conn: Weak<Connection>, watches: Weak<Watches>) {
    let Some(doubt) = conn.upgrade().map(|c| c.doubt.clone()) else {
        return;
    };
    let mut pause = Duration::from_millis(50);
    let mut pace = Pace::default();
    // An ask owed to failed commands, not before this instant.
    let mut paced: Option<tokio::time::Instant> = None;
    // The connection's breaks and moves when the master was last confirmed.
    // From 0: a break between connecting and this task is not missed.
    let mut seen = 0;
    // The connection moved, and the release subscriptions have not yet.
    let mut watches_behind = false;
    // The Sentinel to try first for the next subscription.
    let mut listen_from = 0;
    loop {
        let (tx, mut pushes) = mpsc::unbounded_channel();
        let subscription = master.subscribe(tx, listen_from).await;
        let listened = subscription.as_ref().map(|(i, _)| *i);
        let subscription = subscription.map(|(_, conn)| conn);
        let mut ping = tokio::time::interval(SUBSCRIPTION_PING);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ping.reset();
        // A ping in flight, polled beside everything else: a Sentinel that
        // does not answer holds up nothing.
        let mut pinging: Option<Pin<Box<dyn Future<Output = bool> + Send>>> = None;
        // Without a Sentinel to listen to, when to try again (fixed here:
        // the other branches fire often while commands fail).
        let resubscribe_at = tokio::time::Instant::now() + RETRY_CAP;
        // A switch may have been missed while not subscribed.
        let mut ask = true;
        loop {
            if ask {
                let (Some(conn), Some(watches)) = (conn.upgrade(), watches.upgrade()) else {
                    return;
                };
                pace.asked();
                paced = None;
                match master.find(doubt.breaks() != seen).await {
                    Ok(found) => {
                        match found {
                            Some(new) => {
                                seen = conn.replace(new, master.epoch());
                                // At once, not after the subscriptions
                                // move: a holder whose lock the old master
                                // took with it is told as soon as can be.
                                watches.renew_now();
                                watches_behind = true;
                            }
                            None => conn.raise_epoch(master.epoch()),
                        }
                        pause = Duration::from_millis(50);
                        // Broken again meanwhile: not confirmed, ask again.
                        if doubt.breaks() != seen {
                            continue;
                        }
                        doubt.confirm();
                        // Locks are taken meanwhile: `moved` wakes every
                        // waiter to look again once subscribed.
                        if watches_behind {
                            watches.moved(&conn.get()).await;
                            watches_behind = false;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "asking the Sentinels failed");
                        drop((conn, watches));
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(RETRY_CAP);
                        continue;
                    }
                }
            }
            if conn.strong_count() == 0 {
                return;
            }
            // Every branch decides whether to ask again.
            tokio::select! {
                push = pushes.recv(), if subscription.is_some() => match push {
                    Some(push) if push.kind == PushKind::Disconnection => break,
                    // No lock on the old master while the new one is sought.
                    Some(push) if master.switched(&push) => {
                        doubt.suspect();
                        ask = true;
                    }
                    Some(_) => ask = false,
                    None => break,
                },
                // Paced, but never in the way of a switch announced meanwhile.
                // A wake left from before the last confirmation (acquisitions
                // nudge while they wait) asks nothing.
                _ = doubt.ask.notified(), if paced.is_none() => {
                    ask = false;
                    if doubt.is_unconfirmed() {
                        match pace.next() {
                            None => ask = true,
                            Some(at) => paced = Some(at),
                        }
                    }
                }
                _ = sleep_until_some(paced) => ask = true,
                _ = ping.tick(), if pinging.is_none() => {
                    ask = false;
                    if let Some(sub) = &subscription {
                        let mut sub = sub.clone();
                        pinging = Some(Box::pin(async move {
                            redis::cmd("PING").query_async::<()>(&mut sub).await.is_ok()
                        }));
                    }
                }
                answered = async { pinging.as_mut().expect("guarded").await }, if pinging.is_some() => {
                    pinging = None;
                    ask = false;
                    if !answered {
                        tracing::debug!("the Sentinel listened to stopped answering");
                        listen_from = listened.map_or(0, |i| i + 1);
                        break;
                    }
                }
                // No Sentinel to listen to: try to subscribe again soon.
                _ = tokio::time::sleep_until(resubscribe_at), if subscription.is_none() => break,
            }
        }
        drop(subscription);
    }
}

/// Spaces the asks made because commands failed: when they come within
/// [`CALM`] of each other the gap doubles from [`FIRST_GAP`] up to
/// [`GAP_CAP`]. A master switch announced by a Sentinel is asked about at
/// once.
#[derive(Default)]
struct Pace {
    last: Option<tokio::time::Instant>,
    gap: Duration,
}

impl Pace {
    fn asked(&mut self) {
        self.last = Some(tokio::time::Instant::now());
    }

    /// When the next ask may be made, if not now.
    fn next(&mut self) -> Option<tokio::time::Instant> {
        let last = self.last?;
        if last.elapsed() >= CALM {
            self.gap = Duration::ZERO;
            return None;
        }
        let at = last + self.gap;
        self.gap = (self.gap * 2).clamp(FIRST_GAP, GAP_CAP);
        (at > tokio::time::Instant::now()).then_some(at)
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
