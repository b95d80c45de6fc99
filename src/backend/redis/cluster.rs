//! Redis Cluster: the `redis` crate's cluster connection, set up as the
//! backend needs it.

use redis::aio::AsyncPushSender;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::ProtocolVersion;

use super::layout::redis_error;
use super::options::RedisOptions;
use super::urls::ClusterUrl;
use crate::error::LockError;

const MIN_RETRY_WAIT_MS: u64 = 10;
const MAX_RETRY_WAIT_MS: u64 = 100;

/// Learns the cluster from the first of `url`'s nodes that answers, and
/// connects to its masters. Each command is routed to the master of its
/// keys' slot and follows `MOVED` and `ASK` redirections within the
/// response timeout, retries included; each subscription is a sharded
/// one (`SSUBSCRIBE`, Redis 7.0+) on the node of its channel's slot (the
/// release channel `lock:{K}:rel` shares the lock's hash tag), which the
/// server ends when the slot moves away and the crate makes again on its
/// new owner.
pub(super) async fn connect(
    url: &ClusterUrl,
    options: &RedisOptions,
    push: impl AsyncPushSender,
) -> Result<ClusterConnection, LockError> {
    let nodes: Vec<String> = url.nodes.iter().map(|n| format!("redis://{n}")).collect();
    let mut builder = ClusterClientBuilder::new(nodes)
        .use_protocol(ProtocolVersion::RESP3)
        .connection_timeout(options.connect_timeout)
        .response_timeout(options.response_timeout)
        // Retries (`TRYAGAIN` while a slot migrates, `MOVED` to a node not
        // yet connected, a master failing over) some 10 to 100 ms apart,
        // within the response timeout: the crate's default first pause,
        // 1.28 s, is longer than the whole default response timeout.
        .min_retry_wait(MIN_RETRY_WAIT_MS)
        .max_retry_wait(MAX_RETRY_WAIT_MS)
        .retry_wait_formula(MIN_RETRY_WAIT_MS, 2)
        .push_sender(push);
    if let Some(user) = url.redis.username() {
        builder = builder.username(user);
    }
    if let Some(password) = url.redis.password() {
        builder = builder.password(password);
    }
    let client = builder
        .build()
        .map_err(|e| redis_error("reading the cluster's node addresses", e))?;
    let doing = format!(
        "connecting to the Redis Cluster through {}",
        url.nodes.join(",")
    );
    // A node to learn the cluster from, its answer, then every master: at
    // most one connect and one response timeout in all.
    let within = options.connect_timeout + options.response_timeout;
    match tokio::time::timeout(within, client.get_async_connection()).await {
        Ok(connected) => connected.map_err(|e| redis_error(&doing, e)),
        Err(_) => Err(LockError::backend(
            "redis",
            format!("{doing}: no answer within {} ms", within.as_millis()),
            None,
        )),
    }
}
