//! The Lua scripts: acquire, release and extend for each layout.

use std::sync::OnceLock;
use std::time::Duration;

use redis::Script;

/// How long a fencing counter outlives the last acquisition of its key.
pub(crate) const FENCE_TTL: Duration = Duration::from_secs(24 * 3600);

/// Lua helpers, each prepended only to the scripts that use it: Redis
/// creates a script's functions on every call.
const NOW_MS: &str = r#"
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

/// Reserves `n` fencing tokens, returns the last. The counter never falls
/// behind `floor` plus the server's clock in microseconds: a counter lost
/// (expired, a restart without persistence, a failover to a replica without
/// its last increments) starts again above anything it reached, and a
/// floor raised with each failover (`EPOCH_STRIDE`) puts a newer master's
/// tokens above an older one's. `floor` is a number, or `cluster`: this
/// node's config epoch (its master's, on a replica) from `CLUSTER INFO`,
/// which a failover raises above every other node's. Lua numbers are
/// doubles: exact below 2^53.
fn fence() -> String {
    format!(
        r#"
local function fence(key, ttl, n, floor)
  if floor == 'cluster' then
    local info = redis.call('CLUSTER', 'INFO')
    local epoch = tonumber(string.match(info, 'cluster_my_epoch:(%d+)'))
    if epoch * {stride} > {max} then
      error({{err = 'ERR the config epoch ' .. epoch .. ' is above {most}, the highest fencing tokens can carry'}})
    end
    floor = epoch * {stride}
  end
  local f = redis.call('INCRBY', key, n)
  local t = redis.call('TIME')
  local least = tonumber(floor) + tonumber(t[1]) * 1000000 + tonumber(t[2])
  if f < least then
    f = least
    redis.call('SET', key, string.format('%.0f', f))
  end
  redis.call('PEXPIRE', key, ttl)
  return f
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

/// KEYS: lock, fence. ARGV: token, lease ms, fence ttl ms, fence floor,
/// tokens to reserve.
const ACQUIRE_EXCLUSIVE: &str = r#"
local q = quarantined(2)
if q then return {0, q} end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, fence(KEYS[2], ARGV[3], tonumber(ARGV[5]), ARGV[4])}
end
return {0, redis.call('PTTL', KEYS[1])}
"#;

/// KEYS: readers, writer, fence. ARGV: token, lease ms, fence ttl ms, fence
/// floor.
const ACQUIRE_READ: &str = r#"
local q = quarantined(3)
if q then return {0, q} end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, redis.call('PTTL', KEYS[2])}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return {1, fence(KEYS[3], ARGV[3], 1, ARGV[4])}
"#;

/// KEYS: writer, readers, fence. ARGV: token, lease ms, fence ttl ms, fence
/// floor, tokens to reserve.
const ACQUIRE_WRITE: &str = r#"
local q = quarantined(3)
if q then return {0, q} end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('PTTL', KEYS[1])}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if first[1] then
  return {0, tonumber(first[2]) - now}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, fence(KEYS[3], ARGV[3], tonumber(ARGV[5]), ARGV[4])}
"#;

/// KEYS: holders, fence. ARGV: token, lease ms, fence ttl ms, fence floor,
/// permits.
const ACQUIRE_SEMAPHORE: &str = r#"
local q = quarantined(2)
if q then return {0, q} end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[5]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, tonumber(first[2]) - now}
end
hold_in_set(KEYS[1], ARGV[1], ARGV[2], now)
return {1, fence(KEYS[2], ARGV[3], 1, ARGV[4])}
"#;

/// KEYS: lock. ARGV: token, channel. redis-py's release, plus the PUBLISH.
const RELEASE_STRING: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0
"#;

/// KEYS: holders. ARGV: token, channel.
const RELEASE_MEMBER: &str = r#"
local n = redis.call('ZREM', KEYS[1], ARGV[1])
if n == 1 then
  redis.call('PUBLISH', ARGV[2], 'released')
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

pub(super) struct Scripts {
    pub(super) acquire_exclusive: Script,
    pub(super) acquire_read: Script,
    pub(super) acquire_write: Script,
    pub(super) acquire_semaphore: Script,
    pub(super) release_string: Script,
    pub(super) release_member: Script,
    pub(super) extend_string: Script,
    pub(super) extend_member: Script,
}

pub(super) fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| {
        let script = |parts: &[&str]| Script::new(&parts.concat());
        let in_set = [NOW_MS, HOLD_IN_SET].concat();
        let fence = fence();
        let fence = fence.as_str();
        Scripts {
            acquire_exclusive: script(&[QUARANTINE, fence, ACQUIRE_EXCLUSIVE]),
            acquire_read: script(&[QUARANTINE, &in_set, fence, ACQUIRE_READ]),
            acquire_write: script(&[QUARANTINE, NOW_MS, fence, ACQUIRE_WRITE]),
            acquire_semaphore: script(&[QUARANTINE, &in_set, fence, ACQUIRE_SEMAPHORE]),
            release_string: script(&[RELEASE_STRING]),
            release_member: script(&[RELEASE_MEMBER]),
            extend_string: script(&[EXTEND_STRING]),
            extend_member: script(&[&in_set, EXTEND_MEMBER]),
        }
    })
}
