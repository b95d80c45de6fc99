//! The Lua scripts: acquire, release and extend for each layout.

use std::io::Write;
use std::sync::OnceLock;
use std::time::Duration;

use redis::aio::ConnectionLike;

use redis::{
    Arg, Cmd, ErrorKind, FromRedisValue, RedisResult, RedisWrite, Script, ServerErrorKind,
    ToRedisArgs,
};

/// How long a fencing counter outlives the last acquisition of its key.
pub(crate) const FENCE_TTL: Duration = Duration::from_secs(24 * 3600);

/// Lua helpers, each prepended only to the scripts that use it: Redis
/// creates a script's functions on every call.
pub(super) const NOW_MS: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(x) return string.format('%.0f', x) end
"#;

/// Under Sentinel and Cluster, a key's fencing counter never falls behind
/// the master's config epoch times this (2^36 µs, some 19 hours) plus the
/// server's clock: while a replaced master still serves until it learns of
/// its replacement, both grant, each from a counter that follows its clock,
/// and the newer master's tokens must be above the older one's, not among
/// them. Applied by the script, so that every client of a master shares
/// one counter whatever epoch it knows.
pub(super) const EPOCH_STRIDE: u64 = 1 << 36;
/// The highest floor the script may add to the clock: Lua's numbers are
/// exact below 2^53, and the clock in µs stays below 2^52 until 2112.
pub(super) const MAX_FLOOR: u64 = 1 << 52;

/// The floor a fencing counter never falls behind (besides the clock),
/// computed before the script writes anything: `arg` is a number, or
/// `cluster` for this node's config epoch (its master's, on a replica) from
/// `CLUSTER INFO`, which a failover raises above every other node's,
/// times `EPOCH_STRIDE`.
///
/// `fence` reserves up to `n` fencing tokens and returns the last and how
/// many it reserved. The counter never falls behind `floor` plus the
/// server's clock in microseconds: a counter lost (expired, a restart
/// without persistence, a failover to a replica without its last
/// increments) starts again above anything it reached, and a floor raised
/// with each failover puts a newer master's tokens above an older one's.
///
/// That holds only while the counter does not run ahead of that clock, so
/// a grant reserves no more tokens than the clock has moved past the
/// counter, and at least one: a key would need more than a million grants
/// a second (no Redis serves that many on one key) to run ahead. Lua
/// numbers are doubles: exact below 2^53.
pub(super) fn fence() -> String {
    format!(
        r#"
local function floor_of(arg)
  if arg ~= 'cluster' then return tonumber(arg) end
  local epoch = tonumber(string.match(redis.call('CLUSTER', 'INFO'), 'cluster_my_epoch:(%d+)'))
  if not epoch or epoch * {stride} > {max} then
    error({{err = 'ERR the config epoch ' .. tostring(epoch) .. ' is not a number up to {most}, the highest fencing tokens can carry'}})
  end
  return epoch * {stride}
end
local function fence(key, ttl, n, floor)
  local prev = tonumber(redis.call('GET', key) or '0')
  local t = redis.call('TIME')
  local least = floor + tonumber(t[1]) * 1000000 + tonumber(t[2])
  if prev + n > least then
    n = math.max(1, least - prev)
  end
  local f = math.max(prev + n, least)
  redis.call('SET', key, string.format('%.0f', f), 'PX', ttl)
  return f, n
end
"#,
        stride = EPOCH_STRIDE,
        max = MAX_FLOOR,
        most = MAX_FLOOR / EPOCH_STRIDE,
    )
}

/// Adds a member to a sorted set of holders scored by expiry, and keeps the
/// set alive as long as its longest holder. Needs `NOW_MS`.
const HOLD_IN_SET: &str = r#"
local function hold_in_set(key, token, lease, now)
  redis.call('ZADD', key, int(now + tonumber(lease)), token)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, last[2])
end
"#;

/// The restart quarantine, when the caller passes its keys after the
/// script's own `n` keys (marker, quarantine) and its length as the last
/// argument: the remaining quarantine in ms, or nil to go on.
const QUARANTINE: &str = r#"
local function quarantined(n)
  if #KEYS <= n then return nil end
  local left = redis.call('PTTL', KEYS[n + 2])
  if left > 0 then return left end
  if redis.call('EXISTS', KEYS[n + 1]) == 0 then
    -- An empty server: whoever held a lock here may still think so.
    redis.call('SET', KEYS[n + 1], '1')
    redis.call('SET', KEYS[n + 2], '1', 'PX', ARGV[#ARGV])
    return tonumber(ARGV[#ARGV])
  end
  return nil
end
"#;

/// How long a waiter named by a release (the first in the key's queue)
/// has the free lock to itself: it may have given up or died meanwhile,
/// and then everyone may try again.
pub(super) const NEXT_TTL: Duration = Duration::from_millis(100);

/// How long a waiter's place in the key's queue lasts unless it looks
/// again, which a waiter does at least every second.
pub(super) const QUEUE_TTL: Duration = Duration::from_secs(3);

/// The queue of an exclusive lock: its waiters in the order they first
/// found it busy (a sorted set scored by the server's clock in µs, or by
/// the score the waiter chose: Redlock's waiters give every instance the
/// same, so that all queue them in one order), when each one's place runs
/// out (a sorted set scored in ms), the waiter a release named, and the
/// terms on which a release may grant a waiter the lock directly (a hash:
/// `lease-ms tokens`, see `HAND_ON`).
///
/// `enqueue` gives `token` a place, or keeps its place alive; a `score` of
/// 0 is the server's clock (`t`, the server's `TIME`, or read here);
/// `terms` of '' leave none. Needs the `int` of `NOW_MS`; loaded by
/// `lazily`.
const ENQUEUE: &str = r#"
local function enqueue(queue, places, grants, token, ttl, score, terms, t)
  t = t or redis.call('TIME')
  if score == 0 then score = tonumber(t[1]) * 1000000 + tonumber(t[2]) end
  redis.call('ZADD', queue, 'NX', int(score), token)
  redis.call('ZADD', places, int(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl), token)
  redis.call('PEXPIRE', queue, ttl)
  redis.call('PEXPIRE', places, ttl)
  if terms ~= '' then
    redis.call('HSET', grants, token, terms)
    redis.call('PEXPIRE', grants, ttl)
  end
end
"#;

/// `name_next` pops the first waiter whose place has not run out and
/// returns its token and its terms for a direct grant, if it left any
/// (nil when nobody waits). `hand_on` gives it its turn and tells its
/// process, on the lock's channel followed by `:` and the waiter token's
/// first 16 characters, which name its backend (`Tokens::prefix`): a
/// release wakes that process, not every one with a waiter.
///
/// With `grant` (the lock's key, its fence key and the fence's ttl ms) and
/// terms left by the waiter, the turn is the lock itself: held by the
/// waiter's token for the lease of its terms, its fencing tokens drawn
/// here, and carried in the message (`releaser named last reserved`), so
/// that the waiter holds the lock as it hears it, with no acquire of its
/// own. Else the named waiter has the free lock to itself for `ttl` ms,
/// in which it comes to take it (`releaser named`).
///
/// Named only, it also tells the process of the waiter behind, which
/// looks once the named one's turn is over, in case it did not come (a
/// process gone, a message missed); granted, the lock ends with its lease
/// if the waiter never hears (the one behind looks by the holder's time
/// left, as it does behind any holder). It returns how many heard the
/// named one's message, or nil when nobody waits. Needs `NOW_MS` and
/// `fence`; loaded by `lazily`, `hand_on()` returns it.
pub(super) const HAND_ON: &str = r#"
local function name_next(queue, places, grants)
  local now = nil
  while true do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then return nil end
    now = now or now_ms()
    local place = redis.call('ZSCORE', places, head)
    redis.call('ZREM', queue, head)
    redis.call('ZREM', places, head)
    local terms = redis.call('HGET', grants, head)
    if terms then redis.call('HDEL', grants, head) end
    if place and tonumber(place) > now then return head, terms end
  end
end
local function waiter_channel(channel, token)
  return channel .. ':' .. string.sub(token, 1, 16)
end
local function hand_on(queue, places, successor, grants, ttl, channel, publish, releaser, grant)
  local named, terms = name_next(queue, places, grants)
  if not named then return nil end
  local message = releaser .. ' ' .. named
  local lease, n = nil, nil
  if grant and terms then lease, n = string.match(terms, '^(%d+) (%d+)$') end
  if lease then
    redis.call('SET', grant[1], named, 'PX', lease)
    local last, reserved = fence(grant[2], grant[3], tonumber(n), 0)
    message = message .. ' ' .. int(last) .. ' ' .. int(reserved)
  else
    redis.call('SET', successor, named, 'PX', ttl)
  end
  local heard = redis.pcall(publish, waiter_channel(channel, named), message)
  local behind = not lease and redis.call('ZRANGE', queue, 0, 0)[1]
  if behind and string.sub(behind, 1, 16) ~= string.sub(named, 1, 16) then
    redis.pcall(publish, waiter_channel(channel, behind), message)
  end
  if type(heard) ~= 'number' then heard = 0 end
  return heard
end
"#;

/// KEYS: lock, fence. ARGV: token, lease ms, fence ttl ms, fence floor,
/// tokens to reserve.
///
/// Every acquire script grants again to a token that already holds the
/// lock: a call the client sent twice (the cluster client re-sends one
/// whose connection broke before the answer) must not find itself busy.
const ACQUIRE_EXCLUSIVE: &str = r#"
local floor = floor_of(ARGV[4])
local q = quarantined(2)
if q then return {0, q} end
local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, fence(KEYS[2], ARGV[3], tonumber(ARGV[5]), floor)}
end
return {0, redis.call('PTTL', KEYS[1])}
"#;

/// `ACQUIRE_EXCLUSIVE` with the lock's queue. KEYS: lock, fence, queue,
/// places, successor, grants. ARGV: token, lease ms, fence ttl ms, fence
/// floor, tokens to reserve, queue (`0`: never, `1`: join it if busy, `2`:
/// in it already), place ttl ms, place score (`0`: the server's clock in
/// µs), terms for a direct grant (`lease-ms tokens`, or '' for none).
///
/// A free lock whose release named a successor is that successor's alone
/// until its turn runs out (`NEXT_TTL`), so that no one, the process that
/// released included, overtakes the queue. Busy, with terms, it answers
/// the holder's time left and a number no fencing token drawn after this
/// answer is below: the fencing counter, or the server's clock in µs if
/// higher (a counter lost starts again above the clock, see `fence`). A
/// direct grant the waiter hears of with a token at or below it was made
/// before this answer, and is no longer the waiter's to trust. Without
/// terms (no direct grant can reach the waiter) it answers the time left
/// alone.
const ACQUIRE_QUEUED: &str = r#"
local floor = floor_of(ARGV[4])
local q = quarantined(6)
if q then return {0, q} end
local held = redis.call('GET', KEYS[1])
local successor = false
local busy = nil
if held == false then
  successor = redis.call('GET', KEYS[5])
  if successor and successor ~= ARGV[1] then busy = redis.call('PTTL', KEYS[5]) end
elseif held ~= ARGV[1] then
  busy = redis.call('PTTL', KEYS[1])
end
if busy then
  local t = nil
  if ARGV[9] ~= '' then t = redis.call('TIME') end
  if ARGV[6] ~= '0' then enqueue()(KEYS[3], KEYS[4], KEYS[6], ARGV[1], tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9], t) end
  if not t then return {0, busy} end
  local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
  return {0, busy, math.max(counter, tonumber(t[1]) * 1000000 + tonumber(t[2]))}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if successor then redis.call('DEL', KEYS[5]) end
if ARGV[6] == '2' then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[6], ARGV[1])
end
return {1, fence(KEYS[2], ARGV[3], tonumber(ARGV[5]), floor)}
"#;

/// KEYS: readers, writer, fence. ARGV: token, lease ms, fence ttl ms, fence
/// floor.
const ACQUIRE_READ: &str = r#"
local floor = floor_of(ARGV[4])
local q = quarantined(3)
if q then return {0, q} end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, redis.call('PTTL', KEYS[2])}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return {1, fence(KEYS[3], ARGV[3], 1, floor)}
"#;

/// KEYS: writer, readers, fence. ARGV: token, lease ms, fence ttl ms, fence
/// floor, tokens to reserve.
const ACQUIRE_WRITE: &str = r#"
local floor = floor_of(ARGV[4])
local q = quarantined(3)
if q then return {0, q} end
local held = redis.call('GET', KEYS[1])
if held ~= false and held ~= ARGV[1] then
  return {0, redis.call('PTTL', KEYS[1])}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if first[1] then
  return {0, tonumber(first[2]) - now}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, fence(KEYS[3], ARGV[3], tonumber(ARGV[5]), floor)}
"#;

/// KEYS: holders, fence. ARGV: token, lease ms, fence ttl ms, fence floor,
/// permits.
const ACQUIRE_SEMAPHORE: &str = r#"
local floor = floor_of(ARGV[4])
local q = quarantined(2)
if q then return {0, q} end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not mine and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[5]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, tonumber(first[2]) - now}
end
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return {1, fence(KEYS[2], ARGV[3], 1, floor)}
"#;

/// KEYS: lock, and for an exclusive lock its queue, places, successor,
/// grants and fence. ARGV: token, channel, `PUBLISH` (or, on a cluster,
/// `SPUBLISH`: a message for the channel's slot only, Redis 7.0+; a server
/// without it sends none, and waiters look again within a second),
/// successor ttl ms, fence ttl ms, and to undo a grant that is not to be
/// kept (a Redlock round short of a majority) the waiter's place score and
/// place ttl ms: it goes back in the queue at its place before the next
/// is named, so that the instance names the waiter first by score, as
/// those where it was not granted do. redis-py's release, plus the
/// message.
///
/// The message is the releasing token, so that a backend tells its own
/// releases from others', and the successor's after a space when the
/// queue named one (with its fencing tokens when it was granted the lock
/// directly, see `HAND_ON`): it then goes to the successor's process
/// alone. A lock with a queue publishes nothing when nobody waits in it:
/// its waiters listen on their own processes' channels, which only a turn
/// is sent on. Returns 0 when the lock was not ours, else 1 plus the
/// number of subscribers that received the message.
const RELEASE_STRING: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if #KEYS >= 6 then
    if ARGV[6] then enqueue()(KEYS[2], KEYS[3], KEYS[5], ARGV[1], tonumber(ARGV[7]), tonumber(ARGV[6]), '') end
    if redis.call('EXISTS', KEYS[2]) == 0 then return 1 end
    local heard = hand_on()(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[4], ARGV[2], ARGV[3], ARGV[1], {KEYS[1], KEYS[6], ARGV[5]})
    return 1 + (heard or 0)
  end
  local heard = redis.pcall(ARGV[3], ARGV[2], ARGV[1])
  if type(heard) ~= 'number' then heard = 0 end
  return 1 + heard
end
return 0
"#;

/// KEYS and ARGV as `RELEASE_STRING` takes them for an exclusive lock,
/// without the undo's.
///
/// A waiter that gave up leaves the queue; if a release had named it and
/// the lock is still free, or granted it the lock directly (the waiter
/// left before it heard, or without being told), the next waiter is
/// given its turn instead.
const LEAVE_QUEUE: &str = r#"
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
local free = false
if redis.call('GET', KEYS[4]) == ARGV[1] then
  redis.call('DEL', KEYS[4])
  free = redis.call('EXISTS', KEYS[1]) == 0
elseif redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  free = true
end
if free then
  hand_on()(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[4], ARGV[2], ARGV[3], ARGV[1], {KEYS[1], KEYS[6], ARGV[5]})
end
return 1
"#;

/// KEYS: holders. ARGV: token, channel, `PUBLISH` or `SPUBLISH`.
/// Returns as `RELEASE_STRING` does.
const RELEASE_MEMBER: &str = r#"
local n = redis.call('ZREM', KEYS[1], ARGV[1])
if n == 1 then
  local heard = redis.pcall(ARGV[3], ARGV[2], ARGV[1])
  if type(heard) ~= 'number' then heard = 0 end
  return 1 + heard
end
return n
"#;

/// KEYS: lock, fence. ARGV: token, lease ms, fence ttl ms.
const EXTEND_STRING: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
"#;

/// KEYS: holders, fence. ARGV: token, lease ms, fence ttl ms.
const EXTEND_MEMBER: &str = r#"
local now = now_ms()
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now then
  hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
"#;

/// The arguments (past the keys) and bytes a script call is sized for.
const CALL_ARGS: usize = 8;
const CALL_BYTES: usize = 384;

/// A Lua script: its text and SHA1.
pub(super) struct Lua {
    body: String,
    hash: String,
}

impl Lua {
    pub(super) fn new(body: String) -> Self {
        let hash = Script::new(&body).get_hash().to_owned();
        Lua { body, hash }
    }

    /// A call of the script with `keys` keys, which are written first, then
    /// its arguments.
    pub(super) fn call(&self, keys: usize) -> Call<'_> {
        // Sized once for a typical call (a script's keys and arguments come
        // to a few hundred bytes): grown from empty, the buffers were
        // reallocated a dozen times per lock, a fifth of its client cost.
        let mut cmd = Cmd::with_capacity(3 + keys + CALL_ARGS, CALL_BYTES);
        cmd.arg("EVALSHA").arg(&self.hash).arg(keys);
        Call {
            lua: self,
            cmd,
            keys_left: keys,
        }
    }
}

/// A script's call: `EVALSHA`, and `EVAL` with the text where the server
/// does not have it yet (not `SCRIPT LOAD`: a Redis Cluster sends that to
/// every node, and one down fails it).
///
/// Written straight into the command, the keys without formatting: it is
/// built twice for every lock.
pub(super) struct Call<'a> {
    lua: &'a Lua,
    cmd: Cmd,
    /// Keys still to write before the first argument.
    keys_left: usize,
}

impl Call<'_> {
    pub(super) fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        debug_assert!(
            self.keys_left >= key.num_of_args(),
            "more keys than declared"
        );
        self.keys_left = self.keys_left.saturating_sub(key.num_of_args());
        key.write_redis_args(&mut self.cmd);
        self
    }

    /// The key named `name` followed by `suffix`.
    pub(super) fn key_suffixed(&mut self, name: &str, suffix: &str) -> &mut Self {
        self.key(Suffixed(name, suffix))
    }

    pub(super) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        debug_assert_eq!(self.keys_left, 0, "an argument before the last key");
        arg.write_redis_args(&mut self.cmd);
        self
    }

    pub(super) async fn invoke<T: FromRedisValue, C: ConnectionLike>(
        &self,
        conn: &mut C,
    ) -> RedisResult<T> {
        debug_assert_eq!(self.keys_left, 0, "fewer keys than declared");
        match self.cmd.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(&self.lua.body);
                // Past `EVALSHA` and the hash: the key count, keys, args.
                for arg in self.cmd.args_iter().skip(2) {
                    if let Arg::Simple(arg) = arg {
                        eval.arg(arg);
                    }
                }
                eval.query_async(conn).await
            }
            result => result,
        }
    }
}

/// A name and a suffix, written as one argument without formatting.
pub(super) struct Suffixed<'a>(pub(super) &'a str, pub(super) &'a str);

impl ToRedisArgs for Suffixed<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        write_joined(out, &[self.0.as_bytes(), self.1.as_bytes()]);
    }
}

/// Writes `parts` as one argument, joined on the stack: a lock names a
/// dozen keys and a few composite arguments, and the command's writer for
/// an argument in pieces cost some 150 instructions each more.
pub(super) fn write_joined<W: ?Sized + RedisWrite>(out: &mut W, parts: &[&[u8]]) {
    let mut joined = [0u8; 160];
    let len = parts.iter().map(|p| p.len()).sum::<usize>();
    if len > joined.len() {
        let mut arg = out.writer_for_next_arg();
        for part in parts {
            // Writes to a command's buffer cannot fail.
            let _ = arg.write_all(part);
        }
        return;
    }
    let mut at = 0;
    for part in parts {
        joined[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    out.write_arg(&joined[..len]);
}

pub(super) struct Scripts {
    pub(super) acquire_exclusive: Lua,
    pub(super) acquire_queued: Lua,
    pub(super) acquire_read: Lua,
    pub(super) acquire_write: Lua,
    pub(super) acquire_semaphore: Lua,
    pub(super) release_string: Lua,
    pub(super) release_member: Lua,
    pub(super) leave_queue: Lua,
    pub(super) extend_string: Lua,
    pub(super) extend_member: Lua,
}

/// Lua defining `name()`, which defines the helpers in `parts` and returns
/// their function `name`: a script pays for the helpers (Redis runs a
/// script's definitions on every call) only when it uses them, as a queue's
/// are used only under contention.
pub(super) fn lazily(name: &str, parts: &[&str]) -> String {
    format!(
        "local function {name}()\n{}\nreturn {name}\nend\n",
        parts.concat()
    )
}

pub(super) fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| {
        let script = |parts: &[&str]| Lua::new(parts.concat());
        let in_set = [NOW_MS, HOLD_IN_SET].concat();
        let enqueue = lazily("enqueue", &[NOW_MS, ENQUEUE]);
        let enqueue = enqueue.as_str();
        let fence = fence();
        let fence = fence.as_str();
        let hand_on = lazily("hand_on", &[NOW_MS, fence, HAND_ON]);
        let hand_on = hand_on.as_str();
        Scripts {
            acquire_exclusive: script(&[QUARANTINE, fence, ACQUIRE_EXCLUSIVE]),
            acquire_queued: script(&[QUARANTINE, enqueue, fence, ACQUIRE_QUEUED]),
            acquire_read: script(&[QUARANTINE, &in_set, fence, ACQUIRE_READ]),
            acquire_write: script(&[QUARANTINE, NOW_MS, fence, ACQUIRE_WRITE]),
            acquire_semaphore: script(&[QUARANTINE, &in_set, fence, ACQUIRE_SEMAPHORE]),
            release_string: script(&[hand_on, enqueue, RELEASE_STRING]),
            release_member: script(&[RELEASE_MEMBER]),
            leave_queue: script(&[hand_on, LEAVE_QUEUE]),
            extend_string: script(&[EXTEND_STRING]),
            extend_member: script(&[&in_set, EXTEND_MEMBER]),
        }
    })
}
