//! `floor`: the round trips a lock needs at least, through the client each
//! backend uses.

use super::*;

/// One raw create (ephemeral) and delete per sample: the round trips any
/// ZooKeeper lock needs at least.
pub(super) async fn floor(backend: &str, n: usize) -> ExitCode {
    if backend.starts_with("redis://") {
        return redis_floor(backend, n, "").await;
    }
    if backend.starts_with("redis+sentinel://") || backend.starts_with("redis+cluster://") {
        // The master's floor, on a line tagged as the locks' lines are (the
        // replicas a write waits for are the locks' business, not the
        // floor's).
        let tag = servers_setting(backend.split('?').next().unwrap_or(backend));
        return match redis_group_master(backend).await {
            Ok(master) => redis_floor(&master, n, &tag).await,
            Err(e) => {
                eprintln!("bench: {e}");
                ExitCode::from(2)
            }
        };
    }
    if backend.starts_with("postgres://") || backend.starts_with("postgresql://") {
        return postgres_floor(backend, n).await;
    }
    if backend.starts_with("mysql://") {
        return mysql_floor(backend, n).await;
    }
    if let Some(rest) = backend.strip_prefix("etcd://") {
        let servers = servers_setting(backend);
        return etcd_floor(rest.split('/').next().unwrap_or(rest), n, &servers).await;
    }
    let Some(hosts) = backend
        .strip_prefix("zk://")
        .map(|r| r.split('/').next().unwrap_or(r))
    else {
        eprintln!(
            "bench: the floor workload is measured for redis:// (and redis+sentinel://, redis+cluster://), zk://, postgres://, mysql:// and etcd:// backends only"
        );
        return ExitCode::from(2);
    };
    let zk = match zookeeper_client::Client::connect(hosts).await {
        Ok(zk) => zk,
        Err(e) => {
            eprintln!("bench: connecting to ZooKeeper at {hosts}: {e}");
            return ExitCode::from(2);
        }
    };
    let ephemeral =
        zookeeper_client::CreateMode::Ephemeral.with_acls(zookeeper_client::Acls::anyone_all());
    let path = format!("/bench-floor-{}", std::process::id());
    // An ensemble's server may drop the connection (the client reconnects
    // within the session): the request lost is sent again, its sample kept
    // (it shows at p99) and the losses counted on the line.
    let losses = std::cell::Cell::new(0u64);
    let lost = |e: zookeeper_client::Error| {
        if !matches!(e, zookeeper_client::Error::ConnectionLoss) {
            panic!("zookeeper floor: {e}");
        }
        losses.set(losses.get() + 1);
    };
    let samples = timed(n, || async {
        loop {
            match zk.create(&path, &[], &ephemeral).await {
                // NodeExists: made by a create whose answer was lost.
                Ok(_) | Err(zookeeper_client::Error::NodeExists) => break,
                Err(e) => lost(e),
            }
        }
        loop {
            match zk.delete(&path, None).await {
                Ok(()) | Err(zookeeper_client::Error::NoNode) => break,
                Err(e) => lost(e),
            }
        }
    })
    .await;
    let losses = match losses.get() {
        0 => String::new(),
        n => format!(" connection_losses={n}"),
    };
    println!(
        "impl=raw-create-delete backend=zookeeper workload=uncontended{} {}{losses}",
        servers_setting(backend),
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// The `redis://` URL of the master behind a `redis+sentinel://` URL (as
/// the first Sentinel that answers names it) or of a master of a
/// `redis+cluster://` one (the first node given that says it is one).
/// Only the bench's own URLs: no credentials, no database.
pub(super) async fn redis_group_master(url: &str) -> Result<String, String> {
    let (sentinel, rest) = match url.strip_prefix("redis+sentinel://") {
        Some(rest) => (true, rest),
        None => (false, url.strip_prefix("redis+cluster://").unwrap_or(url)),
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let hosts = hosts.split('?').next().unwrap_or(hosts);
    let name = path.split(['/', '?']).next().unwrap_or("");
    for host in hosts.split(',') {
        let Ok(client) = redis::Client::open(format!("redis://{host}")) else {
            continue;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        if sentinel {
            let addr: redis::RedisResult<Option<(String, u16)>> = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(name)
                .query_async(&mut conn)
                .await;
            if let Ok(Some((ip, port))) = addr {
                return Ok(format!("redis://{ip}:{port}"));
            }
        } else {
            let role: redis::RedisResult<Vec<redis::Value>> =
                redis::cmd("ROLE").query_async(&mut conn).await;
            if matches!(role.as_deref(), Ok([redis::Value::BulkString(r), ..]) if r == b"master") {
                return Ok(format!("redis://{host}"));
            }
        }
    }
    Err(format!("no master found behind {url}"))
}

/// Two PINGs per sample through the `redis` crate's `ConnectionManager`, the
/// connection the Redis backend uses: the round trips a lock needs at least,
/// as this client makes them. `tag` marks a group's master (` sentinels=N`,
/// ` servers=N`).
async fn redis_floor(url: &str, n: usize, tag: &str) -> ExitCode {
    let conn = match redis::Client::open(url) {
        Ok(client) => redis::aio::ConnectionManager::new(client).await,
        Err(e) => Err(e),
    };
    let conn = match conn {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("bench: connecting to Redis at {url}: {e}");
            return ExitCode::from(2);
        }
    };
    let samples = timed(n, || {
        let mut conn = conn.clone();
        async move {
            for _ in 0..2 {
                let _: String = redis::cmd("PING")
                    .query_async(&mut conn)
                    .await
                    .expect("ping");
            }
        }
    })
    .await;
    println!(
        "impl=redis-rs-2xping backend=redis workload=uncontended{tag} {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// Two `SELECT 1` per sample, prepared once, through `tokio-postgres` (the
/// driver the PostgreSQL backend uses): the round trips a lock needs at
/// least.
async fn postgres_floor(url: &str, n: usize) -> ExitCode {
    // The driver knows no `lease_table` parameter.
    let plain = tower_lock::backend::postgres::driver_url(url);
    let client = match tokio_postgres::connect(&plain, tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(connection);
            client
        }
        Err(e) => {
            eprintln!("bench: connecting to PostgreSQL: {e}");
            return ExitCode::from(2);
        }
    };
    // The lease-table mode writes a row to lock and deletes it to unlock:
    // its floor is two committed writes (each waits for the WAL flush).
    if url.contains("lease_table") {
        client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS bench_floor (key text PRIMARY KEY, n bigint NOT NULL)",
            )
            .await
            .expect("create the floor's table");
        const UPSERT: &str = "INSERT INTO bench_floor VALUES ('floor', 1) \
                              ON CONFLICT (key) DO UPDATE SET n = bench_floor.n + 1";
        // Behind a pooler a prepared statement may run on another server
        // session: the library's statements are then unnamed, and so are
        // the floor's.
        let upsert = match behind_pooler() {
            false => Some(client.prepare(UPSERT).await.expect("prepare")),
            true => None,
        };
        let samples = timed(n, || async {
            for _ in 0..2 {
                match &upsert {
                    Some(upsert) => client.execute(upsert, &[]).await.map(drop),
                    None => client.query_typed(UPSERT, &[]).await.map(drop),
                }
                .expect("upsert");
            }
        })
        .await;
        client
            .batch_execute("DROP TABLE bench_floor")
            .await
            .expect("drop the floor's table");
        println!(
            "impl=tokio-postgres-2xupsert backend=postgres workload=uncontended{} {}",
            servers_setting(url),
            latencies(n, samples)
        );
        return ExitCode::SUCCESS;
    }
    let select = client.prepare("SELECT 1").await.expect("prepare");
    let samples = timed(n, || async {
        for _ in 0..2 {
            client.query_one(&select, &[]).await.expect("select");
        }
    })
    .await;
    println!(
        "impl=tokio-postgres-2xselect backend=postgres workload=uncontended {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// One put and one delete per sample through `etcd-client` (the client the
/// etcd backend uses): the writes any etcd lock needs at least.
async fn etcd_floor(hosts: &str, n: usize, servers: &str) -> ExitCode {
    let endpoints: Vec<&str> = hosts.split(',').collect();
    let client = match etcd_client::Client::connect(&endpoints, None).await {
        Ok(client) => client,
        Err(e) => {
            eprintln!("bench: connecting to etcd at {hosts}: {e}");
            return ExitCode::from(2);
        }
    };
    let key = format!("/bench-floor-{}", std::process::id());
    let samples = timed(n, || {
        let (mut kv, key) = (client.kv_client(), key.clone());
        async move {
            kv.put(key.as_str(), "", None).await.expect("put");
            kv.delete(key.as_str(), None).await.expect("delete");
        }
    })
    .await;
    println!(
        "impl=etcd-client-put-delete backend=etcd workload=uncontended{servers} {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}

/// Two `SELECT 1` per sample, prepared once, through `mysql_async` (the
/// driver the MariaDB backend uses).
async fn mysql_floor(url: &str, n: usize) -> ExitCode {
    use mysql_async::prelude::Queryable;
    let conn = match mysql_async::Conn::from_url(url).await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("bench: connecting to MariaDB: {e}");
            return ExitCode::from(2);
        }
    };
    let conn = tokio::sync::Mutex::new(conn);
    let samples = timed(n, || async {
        let mut conn = conn.lock().await;
        for _ in 0..2 {
            let _: Option<i64> = conn.exec_first("SELECT 1", ()).await.expect("select");
        }
    })
    .await;
    println!(
        "impl=mysql-async-2xselect backend=mysql workload=uncontended {}",
        latencies(n, samples)
    );
    ExitCode::SUCCESS
}
