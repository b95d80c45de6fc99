//! The Lua scripts: acquire, release and extend for each layout.
//!
//! Redis charges a script for every key and argument it is given (each
//! becomes a Redis object and a Lua string: some 1,500 instructions of the
//! server's, about as much as a command the script runs), for every
//! `redis.call`, and for each conversion between Lua and Redis values. A
//! lock and its release are two scripts on every request, so an
//! uncontended one runs five commands (`SET NX`, `TIME`, `SET … GET` of the
//! fence; `GET`, `DEL`) and one `EXISTS` of the queue, with the lifetimes
//! written into the scripts' text as strings rather than sent (a number
//! Redis formats with `printf` on every call), arguments left out where
//! the script's default is theirs, and the names of the queue's keys made
//! from the lock's in the script (they share its hash tag, and the queue
//! is only ever on one server or a Sentinel's master, never on a Cluster:
//! see `Layout::sharded`).

use std::sync::OnceLock;
use std::time::Duration;

use super::call::Lua;

/// How long a fencing counter outlives the last acquisition of its key.
pub(crate) const FENCE_TTL: Duration = Duration::from_secs(24 * 3600);

/// Lua helpers, each prepended only to the scripts that use it: Redis
/// creates a script's functions on every call.
pub(super) const NOW_MS: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"#;

/// A number as the text of an integer (`%.0f`: all its digits, where Lua's
/// own conversion keeps 14). A `printf` in the server: the clock's scores
/// and tokens are kept as `TIME`'s text instead (`MICROS`).
const INT: &str = r#"
local function int(x) return string.format('%.0f', x) end
"#;

/// Lua text: the microseconds of `t`, a `TIME` answer, as six digits, so
/// that `t[1] .. MICROS` is the clock in µs and its first three digits the
/// milliseconds, made with no number turned into text (see `INT`).
const MICROS: &str = "string.sub('00000' .. t[2], #t[2])";

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
/// `CLUSTER INFO` counts the state of all 16,384 slots: some 270,000
/// instructions of the server's, three times the rest of a lock. So an
/// acquire script on a Cluster is given `cluster-cached` and, past its own
/// `n` keys, a key of the lock's slot (`epoch_cache` in `layout.rs`): it
/// holds the epoch the slot's locks were last given their floor from, and
/// the replication ID (`master_replid`, from `INFO replication`, a tenth of
/// the cost) of the master that wrote it. While the ID is this node's, the
/// node has been that master all along and the floor stands. Else (a node
/// promoted, restarted or replaced; the slot resharded here) the epoch is
/// read again and the floor becomes the higher of it and the one kept: a
/// high-water mark of the slot, which never expires and moves with the
/// slot's keys (it is declared, so that no script runs where it is not
/// while the slot migrates). A master's epoch may rise while it serves
/// (`CLUSTER SETSLOT … NODE` after an import, `BUMPEPOCH`); its floor then
/// stays the one it took, which is above every earlier master's of the
/// slot, and a later master takes its own, above all. Without leave to run
/// `INFO` (an ACL), the epoch is read every time.
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
///
/// The counter is set to that clock and its old value read in one `SET …
/// GET` (Redis 6.2+): nearly always the clock has moved past the old value
/// by more than `n`, and then the clock is the new value. Else (grants
/// faster than the clock, or a clock stepped back) it is set again, past
/// the old value. A Lua number given to `redis.call` is sent with 17
/// significant digits, exact for integers below 2^53: no `string.format`.
/// With no floor (one server, Sentinel before a failover), the clock goes
/// to the `SET` as the text `TIME` answered, seconds and microseconds
/// joined: Redis formats a Lua number with `printf` on every call, a
/// quarter of a fresh key's fence. A caller that has read the clock gives
/// it as `t`, for one `TIME` a script; the last token comes back as text
/// too when it is that clock's (else false). For a new counter with no
/// floor, a caller that says `text_ok` gets the token itself as that text,
/// never made a number: Lua's `tonumber` of sixteen digits is a `strtod`,
/// some 2,000 of the server's instructions (the acquire scripts, whose
/// client parses the text; the break compares the token with a number).
pub(super) fn fence() -> String {
    format!(
        r#"
local function floor_of(arg, n)
  if arg == nil or arg == '0' then return 0, 0 end
  if arg ~= 'cluster' and arg ~= 'cluster-cached' then return tonumber(arg), 0 end
  local cache, replid, high = nil, nil, 0
  if arg == 'cluster-cached' then
    cache = KEYS[n + 1]
    local info = redis.pcall('INFO', 'replication')
    if type(info) == 'string' then replid = string.match(info, 'master_replid:(%x+)') end
    local cached = redis.call('GET', cache)
    if cached then
      local id, kept = string.match(cached, '^(%x+) (%d+)$')
      if id and id == replid then return tonumber(kept) * {stride}, 1 end
      high = tonumber(kept) or 0
    end
  end
  local epoch = tonumber(string.match(redis.call('CLUSTER', 'INFO'), 'cluster_my_epoch:(%d+)'))
  if epoch then epoch = math.max(epoch, high) end
  if not epoch or epoch * {stride} > {max} then
    error({{err = 'ERR the config epoch ' .. tostring(epoch) .. ' is not a number up to {most}, the highest fencing tokens can carry'}})
  end
  if replid then redis.call('SET', cache, replid .. ' ' .. epoch) end
  if cache then return epoch * {stride}, 1 end
  return epoch * {stride}, 0
end
local function fence(key, n, floor, t, text_ok)
  t = t or redis.call('TIME')
  local least = nil
  if floor == 0 then
    least = t[1] .. {micros}
  else
    least = floor + tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  local prev = redis.call('SET', key, least, 'PX', '{ttl}', 'GET')
  if text_ok and not prev and floor == 0 then return least, n, least end
  local text = floor == 0 and least
  least = tonumber(least)
  if not prev then return least, n, text end
  prev = tonumber(prev)
  if prev + n <= least then return least, n, text end
  n = math.max(1, least - prev)
  local f = math.max(prev + n, least)
  redis.call('SET', key, f, 'PX', '{ttl}')
  return f, n
end
"#,
        stride = EPOCH_STRIDE,
        max = MAX_FLOOR,
        most = MAX_FLOOR / EPOCH_STRIDE,
        ttl = FENCE_TTL.as_millis(),
        micros = MICROS,
    )
}

/// Adds a member to a sorted set of holders scored by expiry, and keeps the
/// set alive as long as its longest holder. Needs `INT`.
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

/// What a lock's key holds while a release has named a waiter: the lock
/// is that waiter's turn, `~` and its token (no token has a `~`), so that
/// no one else, redis-py included, takes it meanwhile, and an attempt
/// reads whether it is free, held or someone's turn in one `SET NX`.
pub(super) const TURN: &str = "~";

/// The queue of an exclusive lock `lock`: its waiters in the order they
/// first found it busy (`lock:queue`, a sorted set scored by the server's
/// clock in µs, or by the score the waiter chose: Redlock's waiters give
/// every instance the same, so that all queue them in one order), when
/// each one's place runs out (`lock:places`, a sorted set scored in ms),
/// and the terms on which a release may grant a waiter the lock directly
/// (`lock:grants`, a hash: `lease-ms tokens`, see `hand_on`). Named from
/// the lock's key in the script: see the module's docs.
///
/// `enqueue` gives `token` a place, or keeps its place alive; a `score` of
/// 0 is the server's clock (`t`, the server's `TIME`, or read here);
/// `terms` of '' leave none. The clock's scores are made from the text
/// `TIME` answers, seconds and zero-padded microseconds: a number turned
/// into text (`string.format`, or a Lua number given to `redis.call`)
/// costs the server a `printf` each, more than a command. Needs `INT`;
/// loaded by `lazily`.
fn enqueue() -> String {
    format!(
        r#"
local function enqueue(lock, token, score, terms, t)
  local queue, places = lock .. ':queue', lock .. ':places'
  t = t or redis.call('TIME')
  local us = {micros}
  if score == 0 then score = t[1] .. us else score = int(score) end
  redis.call('ZADD', queue, 'NX', score, token)
  redis.call('ZADD', places, (t[1] + {ttl_s}) .. string.sub(us, 1, 3), token)
  redis.call('PEXPIRE', queue, '{ttl}')
  redis.call('PEXPIRE', places, '{ttl}')
  if terms ~= '' then
    local grants = lock .. ':grants'
    redis.call('HSET', grants, token, terms)
    redis.call('PEXPIRE', grants, '{ttl}')
  end
end
"#,
        ttl = QUEUE_TTL.as_millis(),
        ttl_s = QUEUE_TTL.as_secs(),
        micros = MICROS,
    )
}

// `enqueue` adds the place's life to the clock's seconds.
const _: () = assert!(QUEUE_TTL.subsec_nanos() == 0);

/// `name_next` pops the first waiter of `lock`'s queue whose place has not
/// run out and returns its token and its terms for a direct grant, if it
/// left any (nil when nobody waits). `hand_on` gives it its turn and tells
/// its process, on the lock's channel followed by `:` and the waiter
/// token's first 16 characters, which name its backend (`Tokens::prefix`):
/// a release wakes that process, not every one with a waiter.
///
/// With `grant` and terms left by the waiter, the turn is the lock itself:
/// held by the waiter's token for the lease of its terms, its fencing
/// tokens drawn here, and carried in the message (`releaser named last
/// reserved`), so that the waiter holds the lock as it hears it, with no
/// acquire of its own. Else the named waiter has the lock to itself for
/// `NEXT_TTL`, held as its turn (`TURN`), in which it comes to take it
/// (`releaser named`).
///
/// Named only, it also tells the process of the waiter behind, which
/// looks once the named one's turn is over, in case it did not come (a
/// process gone, a message missed); granted, the lock ends with its lease
/// if the waiter never hears (the one behind looks by the holder's time
/// left, as it does behind any holder). It returns how many heard the
/// named one's message, or nil when nobody waits. It reads the clock
/// once, for the places and a grant's tokens, and keeps it as text: the
/// places (whole milliseconds, as many digits until the year 2286) are
/// compared with it as text, and the message carries the tokens as text
/// where they are the clock's and as many as asked for. It pops the queue's head
/// (`ZPOPMIN`, Redis 5.0+) rather than read and remove it: each command a
/// script runs costs the server several times the command itself, and
/// this one runs on every hand-off, before the next holder hears. Made
/// with what it needs (`INT`, `fence`) by `hand_on_loader`.
fn hand_on() -> String {
    format!(
        r#"
local function name_next(queue, places, grants, now)
  while true do
    local head = redis.call('ZPOPMIN', queue)[1]
    if not head then return nil end
    local place = redis.call('ZSCORE', places, head)
    redis.call('ZREM', places, head)
    local terms = redis.call('HGET', grants, head)
    if terms then redis.call('HDEL', grants, head) end
    if place and (#place > #now or #place == #now and place > now) then return head, terms end
  end
end
local function waiter_channel(channel, token)
  return channel .. ':' .. string.sub(token, 1, 16)
end
local function hand_on(lock, channel, publish, releaser, grant)
  local queue, t = lock .. ':queue', redis.call('TIME')
  local now = t[1] .. string.sub({micros}, 1, 3)
  local named, terms = name_next(queue, lock .. ':places', lock .. ':grants', now)
  if not named then return nil end
  local message = releaser .. ' ' .. named
  local lease, n = nil, nil
  if grant and terms then lease, n = string.match(terms, '^(%d+) (%d+)$') end
  if lease then
    redis.call('SET', lock, named, 'PX', lease)
    local last, reserved, text = fence(lock .. ':fence', tonumber(n), 0, t)
    if reserved ~= tonumber(n) then n = int(reserved) end
    message = message .. ' ' .. (text or int(last)) .. ' ' .. n
  else
    redis.call('SET', lock, '{turn}' .. named, 'PX', '{next_ttl}')
  end
  local heard = redis.pcall(publish, waiter_channel(channel, named), message)
  local behind = not lease and redis.call('ZRANGE', queue, 0, 0)[1]
  if behind and string.sub(behind, 1, 16) ~= string.sub(named, 1, 16) then
    redis.pcall(publish, waiter_channel(channel, behind), message)
  end
  if type(heard) ~= 'number' then heard = 0 end
  return heard
end
"#,
        turn = TURN,
        next_ttl = NEXT_TTL.as_millis(),
        micros = MICROS,
    )
}

/// Lua defining `hand_on()`, which defines `hand_on` and what it needs
/// (`fence`, the text of [`fence()`] its caller made already) and returns it
/// (see `lazily`): for the releases here and the break's.
pub(super) fn hand_on_loader(fence: &str) -> String {
    lazily("hand_on", &[INT, fence, &hand_on()])
}

/// What every acquire script answers a grant with, `n` the tokens asked
/// for: the last token reserved alone when it reserved all it was asked
/// for (a bare integer, or the clock's text for a new counter with no
/// floor: either costs the server less than an array), else `{1,
/// last, reserved}`. Busy, it answers `{0, …}`. Needs `fence`.
const GRANTED: &str = r#"
local function granted(key, n, floor)
  local last, reserved = fence(key, n, floor, nil, true)
  if reserved == n then return last end
  return {1, last, reserved}
end
"#;

/// KEYS: lock, fence. ARGV: token, lease ms, tokens to reserve, fence
/// floor; the floor may be left out when it is `0` (see
/// `Layout::try_acquire`).
///
/// Every acquire script grants again to a token that already holds the
/// lock: a call the client sent twice (the cluster client re-sends one
/// whose connection broke before the answer) must not find itself busy.
const ACQUIRE_EXCLUSIVE: &str = r#"
local floor, cached = floor_of(ARGV[4], 2)
local q = quarantined(2 + cached)
if q then return {0, q} end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, redis.call('PTTL', KEYS[1])} end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return granted(KEYS[2], tonumber(ARGV[3]), floor)
"#;

/// `ACQUIRE_EXCLUSIVE` with the lock's queue. KEYS: lock, fence. ARGV:
/// token, lease ms, tokens to reserve, fence floor, queue (`0`: never,
/// `1`: join it if busy, `2`: in it already), place score (`0`: the
/// server's clock in µs); the last three may be left out when they are
/// `0`, `1` and `0`, as on most attempts. With `grants`, a waiter leaves terms for a
/// release to grant it the lock directly: the lease up to `QUEUE_TTL`, and
/// the tokens.
///
/// A lock whose release named a successor holds that successor's turn
/// (`TURN`) until it runs out (`NEXT_TTL`), so that no one, the process
/// that released included, overtakes the queue. Busy, with `grants`, it
/// answers the holder's time left and a number no fencing token drawn
/// after this answer is below: the fencing counter, or the server's clock
/// in µs if higher (a counter lost starts again above the clock, see
/// `fence`). A direct grant the waiter hears of with a token at or below
/// it was made before this answer, and is no longer the waiter's to
/// trust. Without them (no direct grant can reach the waiter) it answers
/// the time left alone.
fn acquire_queued(grants: bool) -> String {
    format!(
        r#"
local floor, cached = floor_of(ARGV[4], 2)
local q = quarantined(2 + cached)
if q then return {{0, q}} end
local tokens, queue = ARGV[3], ARGV[5] or '1'
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local held = redis.call('GET', KEYS[1])
  if held ~= ARGV[1] and held ~= '{turn}' .. ARGV[1] then
    local busy = redis.call('PTTL', KEYS[1])
    local t = nil
    if {grants} then t = redis.call('TIME') end
    if queue ~= '0' then
      local terms = ''
      if t and tonumber(ARGV[2]) < {place_ttl} then terms = ARGV[2] .. ' ' .. tokens
      elseif t then terms = '{place_ttl} ' .. tokens end
      enqueue()(KEYS[1], ARGV[1], tonumber(ARGV[6] or '0'), terms, t)
    end
    if not t then return {{0, busy}} end
    local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
    return {{0, busy, math.max(counter, tonumber(t[1]) * 1000000 + tonumber(t[2]))}}
  end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if queue == '2' then
  redis.call('ZREM', KEYS[1] .. ':queue', ARGV[1])
  redis.call('ZREM', KEYS[1] .. ':places', ARGV[1])
  redis.call('HDEL', KEYS[1] .. ':grants', ARGV[1])
end
return granted(KEYS[2], tonumber(tokens), floor)
"#,
        turn = TURN,
        grants = grants,
        place_ttl = QUEUE_TTL.as_millis(),
    )
}

/// KEYS: readers, writer, fence. ARGV: token, lease ms, fence floor.
const ACQUIRE_READ: &str = r#"
local floor, cached = floor_of(ARGV[3], 3)
local q = quarantined(3 + cached)
if q then return {0, q} end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, redis.call('PTTL', KEYS[2])}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return granted(KEYS[3], 1, floor)
"#;

/// KEYS: writer, readers, fence. ARGV: token, lease ms, tokens to
/// reserve, fence floor; the floor may be left out when it is `0`.
const ACQUIRE_WRITE: &str = r#"
local floor, cached = floor_of(ARGV[4], 3)
local q = quarantined(3 + cached)
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
return granted(KEYS[3], tonumber(ARGV[3]), floor)
"#;

/// KEYS: holders, fence. ARGV: token, lease ms, fence floor, permits.
const ACQUIRE_SEMAPHORE: &str = r#"
local floor, cached = floor_of(ARGV[3], 2)
local q = quarantined(2 + cached)
if q then return {0, q} end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not mine and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, tonumber(first[2]) - now}
end
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return granted(KEYS[2], 1, floor)
"#;

/// KEYS: lock. ARGV: token, channel, `PUBLISH` (or, on a cluster,
/// `SPUBLISH`: a message for the channel's slot only, Redis 7.0+; a server
/// without it sends none, and waiters look again within a second).
/// redis-py's release, plus the message: the releasing token, so that a
/// backend tells its own releases from others'. Returns 0 when the lock
/// was not ours, else 1 plus the number of subscribers that received the
/// message.
const RELEASE_STRING: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  local heard = redis.pcall(ARGV[3], ARGV[2], ARGV[1])
  if type(heard) ~= 'number' then heard = 0 end
  return 1 + heard
end
return 0
"#;

/// `RELEASE_STRING` for a lock with a queue (on one server: its channel is
/// the lock's name and `:rel`, published with `PUBLISH`). KEYS: lock (its
/// queue is named from it, as in `enqueue`: one key fewer to pass costs
/// the server less than the name made here). ARGV: token, and to undo a grant that is not to be kept (a
/// Redlock round short of a majority) the waiter's place score: it goes
/// back in the queue at its place before the next is named, so that the
/// instance names the waiter first by score, as those where it was not
/// granted do.
///
/// It publishes nothing when nobody waits in the queue: its waiters listen
/// on their own processes' channels, which only a turn is sent on; else
/// the message names the successor after a space (with its fencing tokens
/// when it was granted the lock directly, see `hand_on`), and goes to the
/// successor's process alone. A lock handed on is written over with its
/// successor's turn or grant, not deleted first. Returns as
/// `RELEASE_STRING` does.
const RELEASE_QUEUED: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] then enqueue()(KEYS[1], ARGV[1], tonumber(ARGV[2]), '') end
  local heard = nil
  if ARGV[2] or redis.call('EXISTS', KEYS[1] .. ':queue') == 1 then
    heard = hand_on()(KEYS[1], KEYS[1] .. ':rel', 'PUBLISH', ARGV[1], true)
  end
  if not heard then
    redis.call('DEL', KEYS[1])
    return 1
  end
  return 1 + heard
end
return 0
"#;

/// KEYS and ARGV as `RELEASE_QUEUED` takes them, without the undo's.
///
/// A waiter that gave up leaves the queue; if a release had named it (the
/// lock holds its turn) or granted it the lock directly (the waiter left
/// before it heard, or without being told), the next waiter is given its
/// turn instead.
fn leave_queue() -> String {
    format!(
        r#"
redis.call('ZREM', KEYS[1] .. ':queue', ARGV[1])
redis.call('ZREM', KEYS[1] .. ':places', ARGV[1])
redis.call('HDEL', KEYS[1] .. ':grants', ARGV[1])
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or held == '{turn}' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
  hand_on()(KEYS[1], KEYS[1] .. ':rel', 'PUBLISH', ARGV[1], true)
end
return 1
"#,
        turn = TURN
    )
}

/// KEYS: holders. ARGV as `RELEASE_STRING` takes them, and returns as it
/// does.
const RELEASE_MEMBER: &str = r#"
local n = redis.call('ZREM', KEYS[1], ARGV[1])
if n == 1 then
  local heard = redis.pcall(ARGV[3], ARGV[2], ARGV[1])
  if type(heard) ~= 'number' then heard = 0 end
  return 1 + heard
end
return n
"#;

/// KEYS: lock, fence. ARGV: token, lease ms.
fn extend_string() -> String {
    format!(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], '{ttl}')
  return 1
end
return 0
"#,
        ttl = FENCE_TTL.as_millis()
    )
}

/// KEYS: holders, fence. ARGV: token, lease ms.
fn extend_member() -> String {
    format!(
        r#"
local now = now_ms()
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now then
  hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
  redis.call('PEXPIRE', KEYS[2], '{ttl}')
  return 1
end
return 0
"#,
        ttl = FENCE_TTL.as_millis()
    )
}

pub(super) struct Scripts {
    pub(super) acquire_exclusive: Lua,
    pub(super) acquire_queued: Lua,
    /// `acquire_queued` leaving terms for a direct grant.
    pub(super) acquire_queued_granting: Lua,
    pub(super) acquire_read: Lua,
    pub(super) acquire_write: Lua,
    pub(super) acquire_semaphore: Lua,
    pub(super) release_string: Lua,
    pub(super) release_queued: Lua,
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
        let in_set = [NOW_MS, INT, HOLD_IN_SET].concat();
        let enqueue = lazily("enqueue", &[INT, &enqueue()]);
        let enqueue = enqueue.as_str();
        let fence = fence();
        let fence = fence.as_str();
        let hand_on = hand_on_loader(fence);
        let hand_on = hand_on.as_str();
        Scripts {
            acquire_exclusive: script(&[QUARANTINE, fence, GRANTED, ACQUIRE_EXCLUSIVE]),
            acquire_queued: script(&[QUARANTINE, enqueue, fence, GRANTED, &acquire_queued(false)]),
            acquire_queued_granting: script(&[
                QUARANTINE,
                enqueue,
                fence,
                GRANTED,
                &acquire_queued(true),
            ]),
            acquire_read: script(&[QUARANTINE, &in_set, fence, GRANTED, ACQUIRE_READ]),
            acquire_write: script(&[QUARANTINE, NOW_MS, fence, GRANTED, ACQUIRE_WRITE]),
            acquire_semaphore: script(&[QUARANTINE, &in_set, fence, GRANTED, ACQUIRE_SEMAPHORE]),
            release_string: script(&[RELEASE_STRING]),
            release_queued: script(&[hand_on, enqueue, RELEASE_QUEUED]),
            release_member: script(&[RELEASE_MEMBER]),
            leave_queue: script(&[hand_on, &leave_queue()]),
            extend_string: script(&[&extend_string()]),
            extend_member: script(&[&in_set, &extend_member()]),
        }
    })
}
