//! The checks after a run: every key can be had again, and nothing is
//! left on the servers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tower_lock::{Backend, BackendExt, LockError, Wait};

/// Locks every key once, each within `wait`: the keys that cannot be had.
///
/// With `retry_refusals`, a backend error is tried again until `wait` runs
/// out: right after the faults heal, a `wait_for_replicas` backend refuses
/// at once while a replica catches up, as documented, and that is not a key
/// lost for good. A key still locked by someone, or an error that lasts the
/// whole wait, counts.
pub async fn liveness(
    backend: Arc<dyn Backend>,
    keys: &[String],
    lease: Duration,
    wait: Duration,
    retry_refusals: bool,
) -> u64 {
    let tries: Vec<_> = keys
        .iter()
        .map(|k| {
            let (backend, k) = (backend.clone(), k.clone());
            tokio::spawn(async move {
                let deadline = tokio::time::Instant::now() + wait;
                let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
                let mut refused = 0;
                loop {
                    let result = backend
                        .lock(k.as_str())
                        .lease(lease)
                        .wait(Wait::Timeout(left()))
                        .await;
                    match result {
                        Ok(guard) => {
                            if refused > 0 {
                                eprintln!(
                                    "torture: key {k} acquired after {refused} backend refusals"
                                );
                            }
                            return guard.release().await.is_ok();
                        }
                        Err(LockError::Backend { .. })
                            if retry_refusals && left() > RETRY_PAUSE =>
                        {
                            refused += 1;
                            tokio::time::sleep(RETRY_PAUSE).await;
                        }
                        Err(e) => {
                            eprintln!(
                                "torture: key {k} not acquirable after the faults healed \
                                 ({refused} backend refusals before): {e}"
                            );
                            return false;
                        }
                    }
                }
            })
        })
        .collect();
    let mut unavailable = 0;
    for t in tries {
        if !t.await.unwrap_or(false) {
            unavailable += 1;
        }
    }
    unavailable
}

/// The pause before a refused liveness acquisition is tried again.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Lock keys or nodes still on the servers once `within` has passed (the
/// leases and sessions of killed clients end first).
pub async fn leaks(
    kind: &str,
    servers: &[SocketAddr],
    root: &str,
    within: Duration,
) -> Result<u64, String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = match kind {
            "zk" | "zk3" => zk_nodes(servers[0], root).await?,
            "postgres" => advisory_locks(servers[0]).await?,
            "postgres-table" => lease_rows(servers[0], root).await?,
            "mysql" => user_locks(servers[0], root).await?,
            "etcd" | "etcd3" => etcd_keys(servers, root).await?,
            _ => {
                let mut n = 0;
                for s in servers {
                    n += redis_lock_keys(*s, root).await?;
                }
                n
            }
        };
        if left == 0 || tokio::time::Instant::now() > deadline {
            return Ok(left);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn redis_lock_keys(server: SocketAddr, root: &str) -> Result<u64, String> {
    let client = redis::Client::open(format!("redis://{server}")).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("redis at {server}: {e}"))?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{{{root}-k*"))
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(keys.iter().filter(|k| !k.ends_with(":fence")).count() as u64)
}

/// A client of the harness's own PostgreSQL server.
async fn pg_client(server: SocketAddr) -> Result<tokio_postgres::Client, String> {
    let url = format!("postgres://postgres@{server}/postgres");
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("postgres at {server}: {e}"))?;
    tokio::spawn(connection);
    Ok(client)
}

/// Advisory locks held or waited for on the harness's own server.
async fn advisory_locks(server: SocketAddr) -> Result<u64, String> {
    let n: i64 = pg_client(server)
        .await?
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    Ok(n as u64)
}

/// The harness's lease rows left on its own server.
async fn lease_rows(server: SocketAddr, root: &str) -> Result<u64, String> {
    let n: i64 = pg_client(server)
        .await?
        .query_one(
            "SELECT count(*) FROM tower_lock_leases WHERE key LIKE $1",
            &[&format!("{root}-k%")],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    Ok(n as u64)
}

/// The harness's keys still locked with `GET_LOCK` (named as the backend
/// names them).
async fn user_locks(server: SocketAddr, root: &str) -> Result<u64, String> {
    use mysql_async::prelude::Queryable;
    let mut conn = mysql_async::Conn::from_url(format!("mysql://root@{server}/test"))
        .await
        .map_err(|e| format!("mariadb at {server}: {e}"))?;
    let mut n = 0;
    // Far more keys than any run uses.
    for key in crate::worker::keys(root, 64) {
        let used: Option<u64> = conn
            .exec_first(
                "SELECT IS_USED_LOCK(IF(CHAR_LENGTH(?) <= 64, ?, CONCAT('/', LEFT(SHA2(?, 256), 63))))",
                (&key, &key, &key),
            )
            .await
            .map_err(|e| e.to_string())?
            .flatten();
        n += u64::from(used.is_some());
    }
    let _ = conn.disconnect().await;
    Ok(n)
}

/// The lock keys under the run's root (the server may be restarting).
async fn etcd_keys(servers: &[SocketAddr], root: &str) -> Result<u64, String> {
    let endpoints: Vec<String> = servers.iter().map(|s| s.to_string()).collect();
    let mut etcd = etcd_client::Client::connect(&endpoints, None)
        .await
        .map_err(|e| format!("etcd at {endpoints:?}: {e}"))?;
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    let got = etcd
        .get(format!("/{root}/"), Some(options))
        .await
        .map_err(|e| format!("etcd at {endpoints:?}: {e}"))?;
    Ok(got.count() as u64)
}

/// Ephemeral nodes (lock nodes: a mutex's, a read/write lock's, a
/// semaphore's leases and locks) anywhere under the run's root; the
/// persistent parents Curator's recipes keep are not locks.
async fn zk_nodes(server: SocketAddr, root: &str) -> Result<u64, String> {
    let zk = zookeeper_client::Client::connect(&server.to_string())
        .await
        .map_err(|e| format!("zookeeper at {server}: {e}"))?;
    let mut n = 0;
    let mut dirs = vec![format!("/{root}")];
    while let Some(dir) = dirs.pop() {
        let children = match zk.list_children(&dir).await {
            Ok(children) => children,
            Err(zookeeper_client::Error::NoNode) => continue,
            Err(e) => return Err(e.to_string()),
        };
        for child in children {
            let path = format!("{dir}/{child}");
            match zk.check_stat(&path).await {
                Ok(Some(stat)) if stat.ephemeral_owner != 0 => n += 1,
                Ok(Some(_)) => dirs.push(path),
                Ok(None) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }
    Ok(n)
}
