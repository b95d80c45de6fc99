//! Who holds a key: its keys read in one script (one slot, one round
//! trip), for [`Backend::inspect`](crate::Backend::inspect).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

use super::call::Lua;
use super::connection::Link;
use super::layout::{redis_error, redis_name};
use super::replicas::Acked;
use super::scripts::{fence, hand_on_loader, FENCE_TTL, TURN};
use super::server::{sentinel_floor, RedisStore};
use crate::backend::{Broken, Holder, Inspection};
use crate::error::LockError;
use crate::key::LockKey;
use crate::mode::LockMode;
use crate::token::FencingToken;

/// The exclusive lock's owner and time left, the writer's, the readers'
/// and the semaphore's holders with their expiry, and the server's clock
/// in ms. A missing string reads as empty (a Lua array ends at its first
/// nil). KEYS: lock, writer, readers, permits.
const HOLDERS: &str = r"
local function s(v) if v then return v else return '' end end
local function holders()
  local t = redis.call('TIME')
  return {
    s(redis.call('GET', KEYS[1])), redis.call('PTTL', KEYS[1]),
    s(redis.call('GET', KEYS[2])), redis.call('PTTL', KEYS[2]),
    redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES'),
    redis.call('ZRANGE', KEYS[4], 0, -1, 'WITHSCORES'),
    tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  }
end
";

/// The holders, then, in one script: the fence raised past every token
/// handed out, every lock key deleted and the release published (to the
/// first of the exclusive lock's queue too, named as a release names it),
/// and the floor last. KEYS: lock, writer, readers, permits, fence, and
/// with a queue the queue (a waiter named by a break comes to take the
/// lock: no direct grant). ARGV: fence floor (as the acquire scripts take
/// it), channel, `PUBLISH` or `SPUBLISH`, the least the fence is raised to
/// (a Redlock break's floor, from its first round; else 0).
fn break_script() -> String {
    format!(
        r"
local floor = floor_of(ARGV[1])
local h = holders()
local f = fence(KEYS[5], 1, floor)
local least = tonumber(ARGV[4])
if f < least then
  redis.call('SET', KEYS[5], string.format('%.0f', least), 'PX', {ttl})
  f = least
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
redis.pcall(ARGV[3], ARGV[2], 'released')
if #KEYS >= 6 then
  hand_on()(KEYS[1], ARGV[2], ARGV[3], 'released', nil)
end
h[8] = f
return h
",
        ttl = FENCE_TTL.as_millis()
    )
}

type Answer = (String, i64, String, i64, Vec<String>, Vec<String>, i64);

impl RedisStore {
    /// Holders by mode with their owner (the random token each acquisition
    /// writes) and time left; no fencing token (the key keeps its owner;
    /// the fence only the last token handed out) and no count of waiters
    /// (those of other processes are not all in the exclusive lock's
    /// queue: a waiter joins it once it finds the lock held, other modes
    /// have none).
    pub(super) async fn inspect_key(
        self: Arc<Self>,
        key: LockKey,
    ) -> Result<Inspection, LockError> {
        let mut conn = self.conn.get();
        let holders = holders(&mut conn, &self.prefix, &key)
            .await
            .map_err(|e| redis_error("inspecting a lock", e))?;
        Ok(Inspection {
            key,
            holders,
            waiters: None,
        })
    }
}

impl RedisStore {
    /// One script raises the fence, frees every holder and wakes the
    /// waiters; the holders find it at their next renewal.
    pub(super) async fn break_key(self: Arc<Self>, key: LockKey) -> Result<Broken, LockError> {
        let (mut conn, breaks, epoch) = self.conn.for_locking(self.response_timeout).await?;
        let (floor, publish) = match self.conn.is_cluster() {
            true => ("cluster".to_owned(), "SPUBLISH"),
            false => (sentinel_floor(epoch)?.to_string(), "PUBLISH"),
        };
        // One server's exclusive locks have a queue (see `Layout::sharded`).
        let queued = !self.conn.is_cluster();
        let fail = |e| redis_error("breaking a lock", e);
        let broken = match self.replicas {
            None => break_on(&mut conn, &self.prefix, &key, &floor, publish, queued, 0)
                .await
                .map_err(fail),
            Some(replicas) => {
                // Acknowledged by the replicas, as a grant is: a failover
                // must not bring the broken lock back.
                let mut acked = Acked::new(&mut conn, replicas);
                let broken =
                    break_on(&mut acked, &self.prefix, &key, &floor, publish, queued, 0).await;
                broken
                    .map_err(fail)
                    .and_then(|b| acked.check("the break").map(|()| b))
            }
        };
        // Reconnected meanwhile, maybe to a master the Sentinels replaced,
        // whose grants are not the new master's: not trusted.
        let broken = broken.and_then(|b| match self.conn.broke_since(breaks) {
            true => Err(LockError::backend(
                "redis",
                "the connection to the master broke during the break: inspect the key and \
                 break again",
                None,
            )),
            false => Ok(b),
        });
        if broken.is_err() {
            self.conn.suspect();
        }
        let (holders, floor) = broken?;
        Ok(Broken {
            key,
            holders,
            floor: FencingToken::new(floor),
        })
    }
}

impl RedisStore {
    /// The keys whose lock keys exist, by `SCAN` on the one server (or the
    /// master), or on each master of a Cluster in turn.
    pub(super) async fn list_keys(
        self: Arc<Self>,
        prefix: String,
    ) -> Result<Vec<LockKey>, LockError> {
        let listed = match self.conn.get() {
            Link::Cluster(mut cluster) => {
                cluster_held_keys(&mut cluster, &self.prefix, &prefix).await
            }
            mut conn => held_keys(&mut conn, &self.prefix, &prefix).await,
        };
        listed.map_err(|e| redis_error("listing locks", e))
    }
}

/// The keys starting with `key_prefix` held on a Redis Cluster: each
/// master (from `CLUSTER SLOTS`) scanned in turn. A
/// slot moving meanwhile may show its keys twice (once listed) or not at
/// all, as any scan of a changing keyspace.
async fn cluster_held_keys(
    conn: &mut ClusterConnection,
    prefix: &str,
    key_prefix: &str,
) -> Result<Vec<LockKey>, redis::RedisError> {
    let slots = conn
        .route_command(
            redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await?;
    let mut keys = Vec::new();
    for (host, port) in masters(&slots)? {
        let mut cursor = 0u64;
        loop {
            let answer = conn
                .route_command(
                    scan(cursor, prefix, key_prefix),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port,
                    }),
                )
                .await?;
            let (next, names): (u64, Vec<Vec<u8>>) = redis::from_redis_value(answer)?;
            keys_named(prefix, names, &mut keys);
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    keys.sort_unstable();
    keys.dedup();
    Ok(keys)
}

/// The address of each master serving slots, from `CLUSTER SLOTS`
/// (`[[start, end, [host, port, id, ..], replicas..], ..]`): the addresses
/// the cluster client knows its nodes by.
fn masters(slots: &redis::Value) -> Result<Vec<(String, u16)>, redis::RedisError> {
    use redis::Value;
    let unreadable = || {
        redis::RedisError::from((
            redis::ErrorKind::Parse,
            "CLUSTER SLOTS names a master without an address this client can reach \
             (an empty or unknown endpoint): its keys cannot be listed",
        ))
    };
    let Value::Array(ranges) = slots else {
        return Err(unreadable());
    };
    let mut masters = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Value::Array(range) = range else {
            return Err(unreadable());
        };
        let Some(Value::Array(master)) = range.get(2) else {
            return Err(unreadable());
        };
        let host: Option<String> = master
            .first()
            .and_then(|h| redis::from_redis_value(h.clone()).ok());
        let port: Option<u16> = master
            .get(1)
            .and_then(|p| redis::from_redis_value(p.clone()).ok());
        match (host, port) {
            (Some(host), Some(port))
                if !host.is_empty() && !matches!(host.as_str(), "?" | "0.0.0.0" | "::") =>
            {
                masters.push((host, port))
            }
            // An address redis-rs would fill in from the node that answered,
            // which this listing cannot know: never skipped silently.
            _ => return Err(unreadable()),
        }
    }
    masters.sort();
    masters.dedup();
    Ok(masters)
}

/// The keys starting with `key_prefix` that have a lock key on one server,
/// in order.
pub(super) async fn held_keys<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    key_prefix: &str,
) -> Result<Vec<LockKey>, redis::RedisError> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, names): (u64, Vec<Vec<u8>>) =
            scan(cursor, prefix, key_prefix).query_async(conn).await?;
        keys_named(prefix, names, &mut keys);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort_unstable();
    keys.dedup();
    Ok(keys)
}

/// One `SCAN` step for the lock keys of keys starting with `key_prefix`.
fn scan(cursor: u64, prefix: &str, key_prefix: &str) -> redis::Cmd {
    let start = redis_name(prefix, key_prefix);
    // `prefix{key}` with its closing brace dropped, as a glob.
    let pattern = format!("{}*", glob_escape(&start[..start.len() - 1]));
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(1000);
    cmd
}

/// The lock keys among `names` (a lock's own key or its writer's,
/// readers' or permits'), as keys, pushed onto `keys`.
fn keys_named(prefix: &str, names: Vec<Vec<u8>>, keys: &mut Vec<LockKey>) {
    let name_start = prefix.len() + 1;
    // A name that is not UTF-8 is no lock of ours.
    for name in names.into_iter().filter_map(|n| String::from_utf8(n).ok()) {
        let Some(rest) = name.get(name_start..) else {
            continue;
        };
        let inner = [":w", ":r", ":s", ""]
            .iter()
            .find_map(|suffix| rest.strip_suffix(suffix)?.strip_suffix('}'));
        if let Some(key) = inner.and_then(key_of_name) {
            keys.push(key);
        }
    }
}

/// A key from its hash tag, braces decoded (see `redis_name`).
fn key_of_name(tag: &str) -> Option<LockKey> {
    let decoded = tag.replace("{(", "\u{1}").replace("{)", "\u{2}");
    if decoded.contains(['{', '}']) {
        return None;
    }
    LockKey::new(&decoded.replace('\u{1}', "{").replace('\u{2}', "}")).ok()
}

/// `s` with the glob's special characters escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The holders of `key`'s lock on one server.
pub(super) async fn holders<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    key: &LockKey,
) -> Result<Vec<Holder>, redis::RedisError> {
    let base = redis_name(prefix, key.as_str());
    static INSPECT: OnceLock<Lua> = OnceLock::new();
    let inspect = INSPECT.get_or_init(|| Lua::new([HOLDERS, "return holders()"].concat()));
    let answer: Answer = inspect
        .call(4)
        .key(&base)
        .key_suffixed(&base, ":w")
        .key_suffixed(&base, ":r")
        .key_suffixed(&base, ":s")
        .invoke(conn)
        .await?;
    Ok(holders_of(answer))
}

/// [`break_script`], loaded once: `EVAL` where the server lacks it, never `SCRIPT
/// LOAD`, which a Redis Cluster sends to every node (one down fails it).
static BREAK_LUA: OnceLock<Lua> = OnceLock::new();

/// Raises `key`'s fencing counter on one server as a grant would (the
/// Redlock break's first round: nothing freed yet), and returns it.
pub(super) async fn raise_fence<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    key: &LockKey,
) -> Result<u64, redis::RedisError> {
    static RAISE: OnceLock<Lua> = OnceLock::new();
    let script = RAISE.get_or_init(|| {
        Lua::new(
            [
                fence().as_str(),
                "return fence(KEYS[1], 1, (floor_of(ARGV[1])))",
            ]
            .concat(),
        )
    });
    let fence: i64 = script
        .call(1)
        .key_suffixed(&redis_name(prefix, key.as_str()), ":fence")
        .arg("0")
        .invoke(conn)
        .await?;
    Ok(u64::try_from(fence).unwrap_or(0))
}

/// Breaks `key`'s lock on one server, as [`break_script`] does: the holders freed
/// and the fencing floor, raised to at least `at_least`. `floor` is what
/// the acquire scripts take: a number, or `cluster`.
pub(super) async fn break_on<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    key: &LockKey,
    floor: &str,
    publish: &str,
    queued: bool,
    at_least: u64,
) -> Result<(Vec<Holder>, u64), redis::RedisError> {
    let base = redis_name(prefix, key.as_str());
    let script = BREAK_LUA.get_or_init(|| {
        let fence = fence();
        Lua::new(
            [
                &hand_on_loader(&fence),
                fence.as_str(),
                HOLDERS,
                &break_script(),
            ]
            .concat(),
        )
    });
    let mut call = script.call(5 + usize::from(queued));
    call.key(&base)
        .key_suffixed(&base, ":w")
        .key_suffixed(&base, ":r")
        .key_suffixed(&base, ":s")
        .key_suffixed(&base, ":fence");
    if queued {
        call.key_suffixed(&base, ":queue");
    }
    let (a, b, c, d, e, f, now, fence): (
        String,
        i64,
        String,
        i64,
        Vec<String>,
        Vec<String>,
        i64,
        i64,
    ) = call
        .arg(floor)
        .arg(format!("{base}:rel"))
        .arg(publish)
        .arg(at_least)
        .invoke(conn)
        .await?;
    Ok((
        holders_of((a, b, c, d, e, f, now)),
        u64::try_from(fence).unwrap_or(0),
    ))
}

/// The holders in an answer of [`HOLDERS`].
fn holders_of(answer: Answer) -> Vec<Holder> {
    let (exclusive, exclusive_ttl, writer, writer_ttl, readers, permits, now) = answer;
    let ms = |n: i64| Duration::from_millis(u64::try_from(n).unwrap_or(0));
    let mut holders = Vec::new();
    for (owner, ttl, mode) in [
        (exclusive, exclusive_ttl, LockMode::Exclusive),
        (writer, writer_ttl, LockMode::Write),
    ] {
        if owner.is_empty() {
            continue;
        }
        // A release named a waiter: the lock is kept for it for its turn
        // (`scripts::TURN`), and no one else takes it meanwhile.
        let holder = match owner.strip_prefix(TURN) {
            Some(named) => Holder::new(None)
                .lease_left(ms(ttl))
                .identity(format!("turn of waiter {named}")),
            None => owned(&owner, ms(ttl)),
        };
        holders.push(holder.mode(mode));
    }
    for (set, mode) in [(readers, Some(LockMode::Read)), (permits, None)] {
        for pair in set.chunks_exact(2) {
            let expires: f64 = pair[1].parse().unwrap_or(0.0);
            if expires as i64 <= now {
                continue; // expired, not yet swept
            }
            let holder = owned(&pair[0], ms(expires as i64 - now));
            holders.push(match mode {
                Some(mode) => holder.mode(mode),
                None => holder,
            });
        }
    }
    holders
}

fn owned(owner: &str, left: Duration) -> Holder {
    Holder::new(None)
        .lease_left(left)
        .identity(format!("owner {owner}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn masters_serving_slots_are_read_from_cluster_slots() {
        use redis::Value::{Array, BulkString, Int};
        let node = |host: &str, port: i64| {
            Array(vec![
                BulkString(host.into()),
                Int(port),
                BulkString(b"id".to_vec()),
            ])
        };
        let slots = Array(vec![
            Array(vec![
                Int(0),
                Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Array(vec![Int(5461), Int(10922), node("10.0.0.2", 7001)]),
            Array(vec![Int(10923), Int(16383), node("10.0.0.1", 7000)]),
        ]);
        assert_eq!(
            super::masters(&slots).unwrap(),
            [("10.0.0.1".to_owned(), 7000), ("10.0.0.2".to_owned(), 7001)]
        );
        // A master whose address the listing cannot reach is an error, not
        // keys left out.
        for unknown in [
            Array(vec![Int(0), Int(16383), node("", 7000)]),
            Array(vec![
                Int(0),
                Int(16383),
                Array(vec![redis::Value::Nil, Int(7000)]),
            ]),
            Array(vec![Int(0), Int(16383)]),
        ] {
            assert!(super::masters(&Array(vec![unknown])).is_err());
        }
    }
}
