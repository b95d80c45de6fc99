//! The Redis keys of one lock and the commands on them.

use std::time::Duration;

use redis::aio::ConnectionLike;

use super::call::{Call, Lua, Suffixed};
use super::scripts::{scripts, QUEUE_TTL};
pub(crate) use crate::backend::engine::owner::Tokens;
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;

/// Pause between tries of a release that got no answer.
const RELEASE_RETRY: Duration = Duration::from_millis(100);

/// Whether a failed release may not have run (the connection dropped, the
/// answer timed out): then it is worth sending again.
pub(crate) fn uncertain(e: &redis::RedisError) -> bool {
    !matches!(e.retry_method(), redis::RetryMethod::NoRetry)
}

/// The Redis keys of one lock: its name (`redis_name`) and a suffix each,
/// joined as they are sent (one allocation per lock, not one per key).
#[derive(Clone)]
pub(crate) struct Layout {
    kind: Kind,
    /// `prefix{key}`, which every key of the lock begins with.
    base: String,
    /// On a Cluster, the key of its slot the acquire scripts keep the
    /// slot's epoch in (see [`epoch_cache`]).
    epoch_cache: Option<String>,
    /// Whether it has a queue of waiters (an exclusive lock): its keys are
    /// named from `base` in the scripts (see `scripts::enqueue`).
    queued: bool,
    /// Whether a release may grant the lock to a waiter of this backend
    /// directly (see `scripts::hand_on`).
    grants: bool,
    /// How releases are published: `PUBLISH`, or on a cluster `SPUBLISH`.
    publish: &'static str,
    /// Restart quarantine: the marker key, the quarantine key, its length.
    quarantine: Option<(String, String, u64)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Exclusive,
    Read,
    Write,
    Semaphore(u32),
}

impl Kind {
    /// The suffix of the string (exclusive, writer) or sorted set (reader,
    /// semaphore) that holds the lock.
    fn main(self) -> &'static str {
        match self {
            Kind::Exclusive => "",
            Kind::Read => ":r",
            Kind::Write => ":w",
            Kind::Semaphore(_) => ":s",
        }
    }

    /// The suffix of the readers' set of a writer, the writer of a reader.
    fn other(self) -> Option<&'static str> {
        match self {
            Kind::Read => Some(":w"),
            Kind::Write => Some(":r"),
            Kind::Exclusive | Kind::Semaphore(_) => None,
        }
    }
}

const FENCE: &str = ":fence";
const CHANNEL: &str = ":rel";

/// The lock's Redis name: `prefix{key}`, the key as the hash tag, so that
/// every key of one lock (its fence, channel, readers) is on one Cluster
/// slot, the key's.
///
/// A brace in the key would break or steer the tag (`}x` leaves it empty,
/// so a lock's keys hash apart and its script fails `CROSSSLOT`; `a}x`
/// takes the slot of `a`). In a key that has one, `{` is written `{(` and
/// `}` is written `{)`: the tag then holds no `}` and ends where it should,
/// and the mapping is one to one. A key without braces keeps its name as
/// it is, as `redis-py`'s `lock:{K}` names it; a key with one has a `{` in
/// its tag, which no key without braces has, so the two never meet.
pub(crate) fn redis_name(prefix: &str, key: &str) -> String {
    // Pushed, not `format!`ted: this runs for every lock.
    let mut name = String::with_capacity(prefix.len() + key.len() * 2 + 2);
    name.push_str(prefix);
    name.push('{');
    if !key.contains(['{', '}']) {
        name.push_str(key);
        name.push('}');
        return name;
    }
    for c in key.chars() {
        match c {
            '{' => name.push_str("{("),
            '}' => name.push_str("{)"),
            c => name.push(c),
        }
    }
    name.push('}');
    name
}

impl Layout {
    pub(crate) fn new(prefix: &str, key: &LockKey, mode: LockMode) -> Self {
        let kind = match mode {
            LockMode::Exclusive => Kind::Exclusive,
            LockMode::Read => Kind::Read,
            LockMode::Write => Kind::Write,
            LockMode::Semaphore { permits } => Kind::Semaphore(permits),
        };
        Layout {
            kind,
            base: redis_name(prefix, key.as_str()),
            epoch_cache: None,
            queued: kind == Kind::Exclusive,
            grants: false,
            publish: "PUBLISH",
            quarantine: None,
        }
    }

    /// Checks for a restarted server before granting: see
    /// [`RedisOptions::restart_quarantine`].
    pub(crate) fn with_quarantine(mut self, prefix: &str, longest: Option<Duration>) -> Self {
        self.quarantine = longest.map(|d| {
            (
                format!("{prefix}~alive"),
                format!("{prefix}~quarantine"),
                d.as_millis().max(1) as u64,
            )
        });
        self
    }

    /// On a Redis Cluster, releases are published on the channel's shard
    /// (`SPUBLISH`): only the nodes of its slot hear them, and a
    /// subscription leaves the node the slot moves away from.
    ///
    /// No queue there: a script's keys must all be on the node while its
    /// slot migrates, and a lock with no waiter has none of its queue's.
    /// The key its slot's epoch is kept in is named here, once per
    /// acquisition (`prefix` the backend's), not at every attempt.
    pub(crate) fn sharded(mut self, prefix: &str, sharded: bool) -> Self {
        if sharded {
            self.publish = "SPUBLISH";
            self.queued = false;
            self.epoch_cache = epoch_cache(prefix, &self.base);
        }
        self
    }

    /// Lets a release grant the lock to this acquisition directly when it
    /// waits in the queue, for [`granted_lease`] (see `scripts::hand_on`):
    /// only where the acquisition itself checks nothing a release cannot
    /// (no replicas to wait for, no master's epoch, no restart quarantine).
    pub(crate) fn direct_grants(mut self, on: bool) -> Self {
        self.grants = on && self.queued;
        self
    }

    /// Whether a release may grant this acquisition the lock directly.
    pub(crate) fn grants(&self) -> bool {
        self.grants
    }

    /// The channel its releases are published on.
    pub(crate) fn channel(&self) -> String {
        [&self.base, CHANNEL].concat()
    }

    /// The channel a waiter of the backend whose tokens begin with `own`
    /// hears its turn on: with a queue, that backend's own (a release
    /// names one waiter; see `scripts::hand_on`), else the lock's.
    pub(crate) fn waiter_channel(&self, own: &str) -> String {
        match self.queued {
            true => [&self.base, CHANNEL, ":", own].concat(),
            false => self.channel(),
        }
    }

    /// Whether the acquire script reserves a block of fencing tokens
    /// (exclusive and write locks, which a cohort passes on).
    pub(crate) fn reserves_block(&self) -> bool {
        self.is_string()
    }

    /// The lock's name, which its keys begin with (for logs).
    pub(crate) fn name(&self) -> &str {
        &self.base
    }

    /// Whether the lock is a string (else a member of a sorted set).
    fn is_string(&self) -> bool {
        matches!(self.kind, Kind::Exclusive | Kind::Write)
    }

    /// Whether the lock has a queue of waiters (exclusive locks).
    pub(crate) fn has_queue(&self) -> bool {
        self.queued
    }

    /// One attempt to take the lock for `token` on `conn`; the key's fencing
    /// counter is raised to at least `floor` plus the server's clock in µs.
    /// Busy, an exclusive lock's attempt joins its queue as `queue` says,
    /// at `score` (0: the server's clock in µs; see `scripts::enqueue`).
    pub(crate) async fn try_acquire<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
        lease: Duration,
        tokens: u32,
        floor: Floor,
        (queue, score): (Queue, u64),
    ) -> Result<Attempt, LockError> {
        let s = scripts();
        let script = match self.kind {
            Kind::Exclusive if self.queued && self.grants && queue != Queue::Never => {
                &s.acquire_queued_granting
            }
            Kind::Exclusive if self.queued => &s.acquire_queued,
            Kind::Exclusive => &s.acquire_exclusive,
            Kind::Read => &s.acquire_read,
            Kind::Write => &s.acquire_write,
            Kind::Semaphore(_) => &s.acquire_semaphore,
        };
        let other = self.kind.other();
        let quarantine = self.quarantine.as_ref();
        let epoch_cache = match floor {
            Floor::ClusterEpoch => self.epoch_cache.as_ref(),
            Floor::Fixed(_) => None,
        };
        let mut call = script.call(
            2 + usize::from(other.is_some())
                + usize::from(epoch_cache.is_some())
                + 2 * usize::from(quarantine.is_some()),
        );
        call.key_suffixed(&self.base, self.kind.main());
        if let Some(other) = other {
            call.key_suffixed(&self.base, other);
        }
        call.key_suffixed(&self.base, FENCE);
        // Past the script's own keys: the epoch's cache, then the
        // quarantine's (see `scripts::fence`).
        if let Some(cache) = epoch_cache {
            call.key(cache);
        }
        if let Some((alive, quarantine, _)) = quarantine {
            call.key(alive).key(quarantine);
        }
        call.arg(token).arg(lease.as_millis() as u64);
        // Exclusive and write locks take the tokens to reserve next, then
        // arguments they may be given none of when they are what the
        // script takes their absence for (most attempts: no floor, join
        // the queue if busy, at the server's clock): each one costs the
        // server a Redis object, a Lua string and a slot in ARGV. Not with
        // a quarantine, whose length comes last.
        let defaults = quarantine.is_none()
            && matches!(floor, Floor::Fixed(0))
            && (!self.queued || (queue == Queue::OnBusy && score == 0));
        let floor_arg = |call: &mut Call<'_>| {
            match floor {
                Floor::Fixed(floor) => call.arg(floor),
                Floor::ClusterEpoch if epoch_cache.is_some() => call.arg("cluster-cached"),
                Floor::ClusterEpoch => call.arg("cluster"),
            };
        };
        match self.kind {
            Kind::Semaphore(permits) => {
                floor_arg(&mut call);
                call.arg(permits);
            }
            Kind::Read => floor_arg(&mut call),
            Kind::Exclusive | Kind::Write => {
                call.arg(tokens.max(1));
                if !defaults {
                    floor_arg(&mut call);
                    if self.queued && self.kind == Kind::Exclusive {
                        call.arg(queue as u8).arg(score);
                    }
                }
            }
        }
        if let Some((_, _, ms)) = quarantine {
            call.arg(*ms);
        }
        // The last token when all that were asked for were reserved, else
        // `{1, last token, tokens reserved}`; or `{0, holder's ttl}`, with
        // the fencing counter on a queue's.
        let answer: redis::Value = call
            .invoke(conn)
            .await
            .map_err(|e| redis_error("acquiring a lock", e))?;
        let asked = tokens.max(1);
        if let redis::Value::Int(last @ 1..) = answer {
            return Ok(Attempt::Granted {
                last: last as u64,
                reserved: asked,
            });
        }
        // A new counter's first token: the clock's text, as the script
        // wrote it (not turned into a number there: a `strtod` in the
        // server, some 2,000 instructions).
        if let redis::Value::BulkString(digits) = &answer {
            if let Some(last @ 1..) = std::str::from_utf8(digits)
                .ok()
                .and_then(|d| d.parse().ok())
            {
                return Ok(Attempt::Granted {
                    last,
                    reserved: asked,
                });
            }
        }
        let numbers: Option<Vec<i64>> = match &answer {
            redis::Value::Array(_) => redis::from_redis_value_ref(&answer).ok(),
            _ => None,
        };
        Ok(match numbers.as_deref() {
            Some(&[1, last, reserved]) if last > 0 && reserved >= 1 => Attempt::Granted {
                last: last as u64,
                reserved: u32::try_from(reserved).unwrap_or(u32::MAX).min(asked),
            },
            Some(&[0, ttl]) => Attempt::Busy { ttl, fence: 0 },
            Some(&[0, ttl, fence]) => Attempt::Busy {
                ttl,
                fence: u64::try_from(fence).unwrap_or(0),
            },
            _ => {
                return Err(LockError::backend(
                    "redis",
                    format!("unexpected answer to the acquire script: {answer:?}"),
                    None,
                ))
            }
        })
    }

    /// Extends `token`'s lease; false if the lock is no longer its.
    pub(crate) async fn extend<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
        lease: Duration,
    ) -> Result<bool, LockError> {
        let s = scripts();
        let script = if self.is_string() {
            &s.extend_string
        } else {
            &s.extend_member
        };
        let extended: i64 = script
            .call(2)
            .key_suffixed(&self.base, self.kind.main())
            .key_suffixed(&self.base, FENCE)
            .arg(token)
            .arg(lease.as_millis() as u64)
            .invoke(conn)
            .await
            .map_err(|e| redis_error("renewing a lease", e))?;
        Ok(extended == 1)
    }

    /// Releases `token`'s hold (if it still has one) and publishes it;
    /// returns how many subscribers heard it.
    pub(crate) async fn release<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
    ) -> redis::RedisResult<u64> {
        let released: i64 = self.announcing(token).invoke(conn).await?;
        // 0: not ours; else one more than the subscribers that heard.
        Ok(released.saturating_sub(1).max(0) as u64)
    }

    /// Undoes `token`'s grant of an exclusive lock (if it still holds it)
    /// that is not to be kept, putting the waiter back in the queue at
    /// `score` before the next is named (see `scripts::RELEASE_STRING`).
    pub(crate) async fn undo<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
        score: u64,
    ) -> redis::RedisResult<()> {
        debug_assert!(
            self.queued,
            "only an exclusive lock is undone into its queue"
        );
        let _: i64 = self.announcing(token).arg(score).invoke(conn).await?;
        Ok(())
    }

    /// Takes `token` out of the lock's queue (a waiter that gave up); if a
    /// release named it and the lock is still free, names the next one.
    pub(crate) async fn leave_queue<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: &str,
    ) -> redis::RedisResult<()> {
        if !self.queued {
            return Ok(());
        }
        let _: i64 = self
            .queued_call(&scripts().leave_queue, token)
            .invoke(conn)
            .await?;
        Ok(())
    }

    /// The release of `token`'s hold, which may announce the lock free:
    /// `RELEASE_QUEUED` for a lock with a queue, else `RELEASE_STRING` or
    /// `RELEASE_MEMBER` with the channel and how to publish.
    fn announcing(&self, token: &str) -> Call<'static> {
        let s = scripts();
        if self.queued {
            return self.queued_call(&s.release_queued, token);
        }
        let script = match self.is_string() {
            true => &s.release_string,
            false => &s.release_member,
        };
        let mut call = script.call(1);
        call.key_suffixed(&self.base, self.kind.main())
            .arg(token)
            .arg(Suffixed(&self.base, CHANNEL))
            .arg(self.publish);
        call
    }

    /// A call of `script` on a lock with a queue for `token`: KEYS lock
    /// (the script names its queue), ARGV token (`RELEASE_QUEUED`,
    /// `leave_queue`).
    fn queued_call<'a>(&self, script: &'a Lua, token: &str) -> Call<'a> {
        debug_assert!(self.queued, "a lock without a queue");
        let mut call = script.call(1);
        call.key(&self.base).arg(token);
        call
    }

    /// [Releases](Self::release) through `conn()`, returning how many
    /// subscribers heard the release message. With a `deadline` (when the
    /// lease would have ended anyway), again on a reconnected connection
    /// while the release fails without an answer from the server (a dropped
    /// connection, a timeout): compare-and-delete by a unique token is safe
    /// to repeat.
    pub(crate) async fn release_until<C: ConnectionLike + Send>(
        &self,
        conn: impl Fn() -> C,
        token: &str,
        deadline: Option<std::time::Instant>,
    ) -> redis::RedisResult<u64> {
        until_answered(deadline, || {
            let mut conn = conn();
            async move { self.release(&mut conn, token).await }
        })
        .await
    }

    /// [Leaves the queue](Self::leave_queue) through `conn()`, and with a
    /// `deadline` (when a direct grant to `token` would have ended) again
    /// while it gets no answer, as [`release_until`](Self::release_until)
    /// does: the script frees only `token`'s own hold, and is safe to repeat.
    pub(crate) async fn leave_queue_until<C: ConnectionLike + Send>(
        &self,
        conn: impl Fn() -> C,
        token: &str,
        deadline: Option<std::time::Instant>,
    ) -> redis::RedisResult<()> {
        until_answered(deadline, || {
            let mut conn = conn();
            async move { self.leave_queue(&mut conn, token).await }
        })
        .await
    }
}

/// Sends `command()` again, `RELEASE_RETRY` apart, while it fails without
/// an answer (see [`uncertain`]) and `deadline` is not near.
async fn until_answered<T, F: std::future::Future<Output = redis::RedisResult<T>>>(
    deadline: Option<std::time::Instant>,
    mut command: impl FnMut() -> F,
) -> redis::RedisResult<T> {
    loop {
        match command().await {
            Err(e)
                if uncertain(&e)
                    && deadline.is_some_and(|d| std::time::Instant::now() + RELEASE_RETRY < d) =>
            {
                tracing::debug!(error = %e, "retrying a redis release");
                tokio::time::sleep(RELEASE_RETRY).await;
            }
            result => return result,
        }
    }
}

pub(crate) fn redis_error(doing: &str, e: redis::RedisError) -> LockError {
    LockError::backend("redis", doing.to_owned(), Some(Box::new(e) as _))
}

/// What a fencing counter never falls behind, besides the server's clock
/// in µs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Floor {
    /// A number the client gives: 0, or a Sentinel config epoch times
    /// `EPOCH_STRIDE`.
    Fixed(u64),
    /// The config epoch of the cluster node that runs the script, times
    /// `EPOCH_STRIDE`.
    ClusterEpoch,
}

/// Where the acquire scripts on a Cluster keep the epoch of the lock's
/// slot (see `scripts::fence`) for the lock named `name` under `prefix`:
/// a key on its slot, `prefix{{~n}:epoch`, `n`
/// the least number whose tag `{~n` has that slot. No lock's key has that
/// tag: `redis_name` writes a `{` in a tag only before `(` or `)`. `None`
/// when the prefix holds a brace (the tag is then the prefix's): the
/// scripts then read the epoch every time.
fn epoch_cache(prefix: &str, name: &str) -> Option<String> {
    if prefix.contains(['{', '}']) {
        return None;
    }
    let slot = slot_of(name);
    let mut n = itoa::Buffer::new();
    let cache = [prefix, "{{~", n.format(tag_of(slot)), "}:epoch"].concat();
    debug_assert_eq!(slot_of(&cache), slot);
    Some(cache)
}

/// The Cluster slot of a Redis key name: CRC16 (XMODEM) of its hash tag,
/// or of the whole name without one, as the servers and the `redis` crate
/// compute it.
fn slot_of(name: &str) -> u16 {
    let bytes = name.as_bytes();
    let tag = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    crc16::State::<crc16::XMODEM>::calculate(tag) % SLOTS
}

const SLOTS: u16 = 16384;

/// The least `n` whose tag `{~n` hashes to `slot`, for every slot: some
/// 170,000 hashes, once per process, for 64 KiB.
fn tag_of(slot: u16) -> u32 {
    static TAGS: std::sync::OnceLock<Box<[u32]>> = std::sync::OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; usize::from(SLOTS)];
        let mut left = usize::from(SLOTS);
        let mut n = 0u32;
        while left > 0 {
            let mut digits = itoa::Buffer::new();
            let slot = usize::from(slot_of(&["{~", digits.format(n)].concat()));
            if tags[slot] == u32::MAX {
                tags[slot] = n;
                left -= 1;
            }
            n += 1;
        }
        tags.into_boxed_slice()
    });
    tags[usize::from(slot)]
}

/// The lease a release grants a waiter directly: the waiter's own, up to
/// its place's life (`QUEUE_TTL`). A waiter that died with its place still
/// alive holds the lock back no longer than that; one alive renews it to
/// its whole lease if its section runs that long.
pub(crate) fn granted_lease(lease: Duration) -> Duration {
    lease.min(QUEUE_TTL)
}

/// Whether an attempt on an exclusive lock joins its queue when busy.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Queue {
    /// Never (a fail-fast attempt).
    Never = 0,
    /// Joins it if busy: a waiter's first attempt.
    OnBusy = 1,
    /// In it already (or named by a release): keeps its place if busy,
    /// leaves it if granted.
    Queued = 2,
}

/// The answer of an acquire script.
pub(crate) enum Attempt {
    /// The last fencing token reserved, and how many were (fewer than
    /// asked when the counter would run ahead of the clock).
    Granted { last: u64, reserved: u32 },
    /// Held: the holder's remaining lease in ms (negative: none known),
    /// and where a direct grant may reach the waiter what no fencing token
    /// drawn after this answer is below (else 0): a direct grant at or
    /// below it is taken as older.
    Busy { ttl: i64, fence: u64 },
}

#[cfg(test)]
mod name_tests {
    use redis::{Arg, ToRedisArgs};

    use super::super::call::Suffixed;
    use super::redis_name;

    /// The arguments `args` write, as text.
    fn written(args: &[&dyn Fn(&mut redis::Cmd)]) -> Vec<String> {
        let mut cmd = redis::Cmd::new();
        for write in args {
            write(&mut cmd);
        }
        cmd.args_iter()
            .map(|a| match a {
                Arg::Simple(a) => String::from_utf8(a.to_vec()).unwrap(),
                _ => unreachable!("no cursor written"),
            })
            .collect()
    }

    #[test]
    fn a_suffixed_name_is_one_argument() {
        let long = "k".repeat(300);
        let args = written(&[
            &|c| Suffixed("lock:{a}", ":fence").write_redis_args(c),
            &|c| Suffixed(&long, ":queue").write_redis_args(c),
        ]);
        assert_eq!(
            args,
            ["lock:{a}:fence".to_owned(), format!("{long}:queue"),]
        );
    }

    /// The epoch's cache is on the slot of the lock it serves, as the
    /// `redis` crate routes them, and on no lock's key; every slot has one.
    #[test]
    fn the_epoch_cache_of_a_lock_is_on_its_slot() {
        use redis::cluster_routing::Slot;
        for key in ["a", "k", "order:42", "}x", "{", "sku-99", "~1", "{~1"] {
            let name = redis_name("lock:", key);
            let cache = super::epoch_cache("lock:", &name).unwrap();
            assert_eq!(Slot::for_key(&cache), Slot::for_key(&name), "{key}");
            assert_eq!(Slot::new(super::slot_of(&name)), Some(Slot::for_key(&name)));
            assert!(
                cache.starts_with("lock:{{~") && cache.ends_with("}:epoch"),
                "{cache}"
            );
        }
        let tags: std::collections::HashSet<u32> = (0..super::SLOTS).map(super::tag_of).collect();
        assert_eq!(tags.len(), usize::from(super::SLOTS), "one tag per slot");
        assert_eq!(super::epoch_cache("x{y}:", "x{y}:{k}"), None);
    }

    #[test]
    fn keys_without_braces_keep_their_names_and_braces_cannot_break_the_tag() {
        assert_eq!(redis_name("lock:", "order:42"), "lock:{order:42}");
        assert_eq!(redis_name("lock:", "}x"), "lock:{{)x}");
        assert_eq!(redis_name("lock:", "a}x"), "lock:{a{)x}");
        assert_eq!(redis_name("lock:", "{x"), "lock:{{(x}");
        let keys = [
            "a", "}", "{", "{)", "{(", "a}x", "a{)x", "a%7Dx", "}}", "{}",
        ];
        let mut names: Vec<String> = keys.iter().map(|k| redis_name("p", k)).collect();
        for name in &names {
            // The tag: from the first `{` to the first `}` after it.
            let tag = &name[name.find('{').unwrap() + 1..];
            let tag = &tag[..tag.find('}').unwrap()];
            assert!(!tag.is_empty(), "{name}");
            assert_eq!(
                name.len(),
                name.find('{').unwrap() + tag.len() + 2,
                "{name}"
            );
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), keys.len(), "two keys share a name");
    }
}
