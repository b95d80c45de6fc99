//! A lock server of the harness's own: started on free loopback ports in
//! a directory of its own, so that it can be killed, restarted and paused.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod signals;

use signals::group_gone;
pub use signals::{signal_pid, stop_pid};

/// What kind of server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Redis,
    ZooKeeper,
    /// A private PostgreSQL cluster, run as the `postgres` user when the
    /// harness runs as root (PostgreSQL refuses root). Its processes form a
    /// group of their own, so that kill and pause reach every one of them.
    Postgres,
    /// A one-member etcd cluster; its data directory survives a kill, so a
    /// restart brings back its keys and leases.
    Etcd,
    /// A Redis Sentinel (`redis-server --sentinel`) monitoring the master
    /// [`SENTINEL_MASTER`].
    Sentinel,
    /// A Redis Cluster node. Its `nodes.conf` survives a kill, so a restart
    /// brings it back as the same node (without data, as a replica once
    /// it hears that its slots have moved).
    ClusterNode,
    /// A private MariaDB server (run as the `mysql` user when the harness
    /// runs as root), `root` without a password and a database `test`;
    /// its data (the token sequence) survives a kill.
    Mariadb,
    /// PgBouncer in transaction pooling in front of a PostgreSQL server's
    /// database `test` (see [`Server::start_pgbouncer`]), run as the
    /// `postgres` user when the harness runs as root.
    PgBouncer,
}

/// The name the Sentinels monitor the master under.
pub const SENTINEL_MASTER: &str = "locks";

/// The newest installed PostgreSQL's programs.
fn postgres_bin() -> Result<PathBuf, String> {
    let mut bins: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("PostgreSQL is not installed (apt-get install postgresql): {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|b| b.join("postgres").exists())
        .collect();
    bins.sort_by_key(|b| {
        let version = b
            .parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str());
        version.and_then(|v| v.parse::<u32>().ok()).unwrap_or(0)
    });
    bins.pop()
        .ok_or_else(|| "PostgreSQL is not installed (apt-get install postgresql)".to_owned())
}

/// Whether this process runs as root.
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A command run as the `postgres` user when this process is root.
fn as_postgres(program: PathBuf) -> Command {
    if is_root() {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

/// One server the harness started.
pub struct Server {
    pub kind: Kind,
    pub addr: SocketAddr,
    dir: PathBuf,
    child: Option<Child>,
    /// The peer port of an etcd member or ensemble server, the same across
    /// restarts (an etcd member's URL is kept in its data).
    peer: u16,
    /// A ZooKeeper ensemble member's leader-election port.
    election: u16,
    /// etcd: this member's name and the whole cluster's `name=peer URL`
    /// list.
    member: String,
    cluster: String,
    /// A Redis replica's master port (started with `--replicaof`); a
    /// Sentinel's master port (its `sentinel monitor`).
    master: Option<u16>,
    /// A Redis server speaking TLS only: its certificate, key and the CA
    /// that signed them.
    tls: Option<[PathBuf; 3]>,
}

/// Why a server did not come up.
enum NotUp {
    /// Its process ended.
    Exited(String),
    TimedOut(String),
}

impl NotUp {
    fn message(self) -> String {
        match self {
            NotUp::Exited(why) => why,
            NotUp::TimedOut(why) => why,
        }
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Server {
    /// Starts a server of `kind` on a free loopback port, with its files in
    /// a directory of its own under `work`.
    pub fn start(kind: Kind, work: &std::path::Path, name: &str) -> Result<Server, String> {
        let mut server = Self::prepare(kind, work, name)?;
        if kind == Kind::Etcd {
            server.cluster = format!("{}=http://127.0.0.1:{}", server.member, server.peer);
        }
        server.spawn()?;
        Ok(server)
    }

    /// Starts a Redis server that speaks TLS only, on its port, with the
    /// certificate `cert` and key `key` signed by `ca` (clients are not
    /// asked for certificates).
    pub fn start_redis_tls(
        work: &std::path::Path,
        name: &str,
        [cert, key, ca]: [&std::path::Path; 3],
    ) -> Result<Server, String> {
        let mut server = Self::prepare(Kind::Redis, work, name)?;
        server.tls = Some([cert.to_owned(), key.to_owned(), ca.to_owned()]);
        server.spawn()?;
        Ok(server)
    }

    /// Starts PgBouncer in transaction pooling in front of the database
    /// `test` of the PostgreSQL server on `postgres` (user `postgres`,
    /// trust authentication).
    pub fn start_pgbouncer(
        work: &std::path::Path,
        name: &str,
        postgres: SocketAddr,
    ) -> Result<Server, String> {
        let mut server = Self::prepare(Kind::PgBouncer, work, name)?;
        let dir = &server.dir;
        let ini = format!(
            "[databases]\ntest = host={} port={} dbname=test user=postgres\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {}\npool_mode = transaction\n\
             max_client_conn = 1000\ndefault_pool_size = 20\n\
             ignore_startup_parameters = extra_float_digits,options\n",
            postgres.ip(),
            postgres.port(),
            server.addr.port(),
            dir.join("users.txt").display()
        );
        let write = |file: &str, text: &str| {
            std::fs::write(dir.join(file), text).map_err(|e| format!("{file}: {e}"))
        };
        write("pgbouncer.ini", &ini)?;
        write("users.txt", "\"postgres\" \"\"\n")?;
        if is_root() {
            let _ = Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(dir)
                .status();
        }
        server.spawn()?;
        Ok(server)
    }

    /// Starts a cluster of `n` members (an etcd cluster or a ZooKeeper
    /// ensemble), each like [`start`](Self::start)'s. They are all started
    /// before any is waited for: a member serves only once a majority is up.
    pub fn start_cluster(
        kind: Kind,
        work: &std::path::Path,
        n: usize,
    ) -> Result<Vec<Server>, String> {
        // Each port was free when picked, but any process may take it (an
        // outbound connection's ephemeral port) before a member binds it:
        // then the whole cluster starts again on other ports.
        const TRIES: usize = 5;
        for attempt in 1.. {
            match Self::try_start_cluster(kind, work, n) {
                Ok(members) => return Ok(members),
                Err((why, true)) if attempt < TRIES => {
                    eprintln!("harness: {why}: a port was taken; starting the cluster again");
                    for i in 0..n {
                        let _ = std::fs::remove_dir_all(work.join(format!("server{i}")));
                    }
                }
                Err((why, _)) => return Err(why),
            }
        }
        unreachable!("the loop returns")
    }

    /// One try of [`start_cluster`](Self::start_cluster): the members, or
    /// why not and whether a member found one of its ports taken.
    fn try_start_cluster(
        kind: Kind,
        work: &std::path::Path,
        n: usize,
    ) -> Result<Vec<Server>, (String, bool)> {
        let fail = |why: String| (why, false);
        let mut members = (0..n)
            .map(|i| Self::prepare(kind, work, &format!("server{i}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        let cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.member, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let ensemble: String = members
            .iter()
            .enumerate()
            .map(|(i, m)| format!("server.{}=127.0.0.1:{}:{}\n", i + 1, m.peer, m.election))
            .collect();
        for (i, m) in members.iter_mut().enumerate() {
            m.cluster = cluster.clone();
            if kind == Kind::ZooKeeper {
                let cfg = m.dir.join("zoo.cfg");
                let standalone = std::fs::read_to_string(&cfg).map_err(|e| fail(e.to_string()))?;
                let cfg_text = format!("{standalone}initLimit=10\nsyncLimit=5\n{ensemble}");
                std::fs::write(&cfg, cfg_text).map_err(|e| fail(e.to_string()))?;
                std::fs::write(m.dir.join("data/myid"), format!("{}\n", i + 1))
                    .map_err(|e| fail(e.to_string()))?;
            }
            m.launch().map_err(fail)?;
        }
        for m in &mut members {
            if let Err(e) = m.wait_up(Duration::from_secs(120)) {
                let taken = matches!(e, NotUp::Exited(_)) && m.found_a_port_taken();
                return Err((e.message(), taken));
            }
        }
        Ok(members)
    }

    /// Whether the server's log says a port it was to listen on was taken.
    fn found_a_port_taken(&self) -> bool {
        std::fs::read_to_string(self.dir.join("server.log"))
            .is_ok_and(|log| log.to_ascii_lowercase().contains("address already in use"))
    }

    /// A Redis master, two replicas and three Sentinels: the first three
    /// servers are the Redis ones (the first starts as the master), the
    /// last three the Sentinels. The master fails over after `down_after`
    /// without an answer (`SENTINEL SET` changes it later: a long one
    /// while the group comes up keeps a loaded machine from failing it
    /// over before it is used).
    pub fn start_sentinel_group(
        work: &std::path::Path,
        down_after: Duration,
    ) -> Result<Vec<Server>, String> {
        let mut servers = Vec::new();
        for i in 0..6 {
            let kind = if i < 3 { Kind::Redis } else { Kind::Sentinel };
            let mut server = Self::prepare(kind, work, &format!("server{i}"))?;
            if i > 0 {
                server.master = Some(servers.first().map_or(0, |m: &Server| m.addr.port()));
            }
            if kind == Kind::Sentinel {
                let conf = format!(
                    "port {}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 2\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} {}\n\
                     sentinel failover-timeout {SENTINEL_MASTER} 3000\n",
                    server.addr.port(),
                    server.dir.display(),
                    server.master.unwrap_or(0),
                    down_after.as_millis()
                );
                std::fs::write(server.dir.join("sentinel.conf"), conf)
                    .map_err(|e| e.to_string())?;
            }
            server.spawn()?;
            servers.push(server);
        }
        Ok(servers)
    }

    /// A Redis Cluster of six nodes on loopback, made by `redis-cli
    /// --cluster create`: three masters and a replica of each. A master
    /// fails over some two seconds after it stops answering (the node
    /// timeout). Not yet settled when this returns (see
    /// `redis_groups::cluster_settled`).
    pub fn start_redis_cluster(work: &std::path::Path) -> Result<Vec<Server>, String> {
        let mut nodes = Vec::new();
        for i in 0..6 {
            let mut node = Self::prepare(Kind::ClusterNode, work, &format!("server{i}"))?;
            node.spawn()?;
            nodes.push(node);
        }
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|n| n.addr.to_string()))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .map_err(|e| format!("redis-cli (Debian's redis-tools): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create: {}",
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        Ok(nodes)
    }

    /// A server's directory and ports, not yet started.
    fn prepare(kind: Kind, work: &std::path::Path, name: &str) -> Result<Server, String> {
        let port = free_port().map_err(|e| e.to_string())?;
        let dir = work.join(name);
        std::fs::create_dir_all(dir.join("data")).map_err(|e| e.to_string())?;
        if is_root() && matches!(kind, Kind::Postgres | Kind::Mariadb | Kind::PgBouncer) {
            // Run as another user, which must reach its directory through
            // `work` (a `mktemp -d` one is closed to others).
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(work)
                .map_err(|e| e.to_string())?
                .permissions()
                .mode();
            std::fs::set_permissions(work, std::fs::Permissions::from_mode(mode | 0o001))
                .map_err(|e| e.to_string())?;
        }
        let server = Server {
            kind,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            dir,
            child: None,
            peer: free_port().map_err(|e| e.to_string())?,
            election: free_port().map_err(|e| e.to_string())?,
            member: name.to_owned(),
            cluster: String::new(),
            master: None,
            tls: None,
        };
        if kind == Kind::ZooKeeper {
            // A short tick so that short sessions are allowed.
            let cfg = format!(
                "tickTime=200\nminSessionTimeout=400\nmaxSessionTimeout=60000\n\
                 dataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\n4lw.commands.whitelist=*\nmaxClientCnxns=0\n",
                server.dir.join("data").display()
            );
            std::fs::write(server.dir.join("zoo.cfg"), cfg).map_err(|e| e.to_string())?;
        }
        if kind == Kind::Mariadb {
            let data = server.dir.join("data");
            let mut install = Command::new("mariadb-install-db");
            if is_root() {
                let _ = Command::new("chown")
                    .args(["-R", "mysql:"])
                    .arg(&server.dir)
                    .status();
                install.arg("--user=mysql");
            }
            let out = install
                .arg(format!("--datadir={}", data.display()))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
                .output()
                .map_err(|e| format!("mariadb-install-db (apt-get install mariadb-server): {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "mariadb-install-db: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            let init = server.dir.join("init.sql");
            std::fs::write(&init, "CREATE DATABASE IF NOT EXISTS test;\n")
                .map_err(|e| e.to_string())?;
            if is_root() {
                // Read by the server, as `mysql`, whatever the umask.
                let _ = Command::new("chown").arg("mysql:").arg(&init).status();
            }
        }
        if kind == Kind::Postgres {
            let data = server.dir.join("data");
            if is_root() {
                let _ = Command::new("chown")
                    .args(["-R", "postgres:"])
                    .arg(&server.dir)
                    .status();
            }
            let _ = std::fs::remove_dir(&data);
            let out = as_postgres(postgres_bin()?.join("initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
                .output()
                .map_err(|e| format!("initdb: {e}"))?;
            if !out.status.success() {
                return Err(format!("initdb: {}", String::from_utf8_lossy(&out.stderr)));
            }
        }
        Ok(server)
    }

    fn spawn(&mut self) -> Result<(), String> {
        // PostgreSQL restarted after a kill refuses to start while a
        // killed process of the old server still holds its shared memory
        // ("pre-existing shared memory block is still in use"), which a
        // loaded machine can take a moment to tear down: started again
        // until it stays up, for a while.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.launch()?;
            match self.wait_up(Duration::from_secs(120)) {
                Err(NotUp::Exited(why))
                    if self.kind == Kind::Postgres && Instant::now() < deadline =>
                {
                    eprintln!(
                        "harness: {:?} on {} {why}; starting it again",
                        self.kind, self.addr
                    );
                    std::thread::sleep(Duration::from_millis(200));
                }
                result => return result.map_err(NotUp::message),
            }
        }
    }

    /// Starts the process, without waiting for it to serve.
    fn launch(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .map_err(|e| e.to_string())?;
        let mut cmd = Command::new("env");
        if self.kind == Kind::Postgres {
            use std::os::unix::process::CommandExt;
            cmd = as_postgres(postgres_bin()?.join("postgres"));
            cmd.arg("-D")
                .arg(self.dir.join("data"))
                .args(["-p", &self.addr.port().to_string()])
                .arg("-k")
                .arg(&self.dir)
                .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
                .args(["-c", "max_connections=300"])
                .process_group(0);
        }
        if self.kind == Kind::PgBouncer {
            // Debian's is in /usr/sbin, often not on a user's PATH.
            let sbin = PathBuf::from("/usr/sbin/pgbouncer");
            cmd = as_postgres(if sbin.exists() {
                sbin
            } else {
                PathBuf::from("pgbouncer")
            });
            cmd.arg(self.dir.join("pgbouncer.ini"));
        }
        match self.kind {
            Kind::Postgres | Kind::PgBouncer => {}
            Kind::Mariadb => {
                // Debian's is in /usr/sbin, often not on a user's PATH.
                let sbin = std::path::Path::new("/usr/sbin/mariadbd");
                cmd.arg(if sbin.exists() {
                    sbin
                } else {
                    std::path::Path::new("mariadbd")
                })
                .arg("--no-defaults");
                if is_root() {
                    cmd.arg("--user=mysql");
                }
                cmd.arg(format!("--datadir={}", self.dir.join("data").display()))
                    .arg(format!("--port={}", self.addr.port()))
                    .args(["--bind-address=127.0.0.1", "--skip-log-bin"])
                    .arg(format!(
                        "--socket={}",
                        self.dir.join("mysqld.sock").display()
                    ))
                    .arg(format!(
                        "--pid-file={}",
                        self.dir.join("mysqld.pid").display()
                    ))
                    .arg(format!(
                        "--init-file={}",
                        self.dir.join("init.sql").display()
                    ))
                    .args(["--max-connections=300", "--innodb-buffer-pool-size=64M"]);
            }
            Kind::Redis => {
                cmd.arg("redis-server");
                match &self.tls {
                    None => cmd.args(["--port", &self.addr.port().to_string()]),
                    Some([cert, key, ca]) => cmd
                        .args(["--port", "0", "--tls-port", &self.addr.port().to_string()])
                        .arg("--tls-cert-file")
                        .arg(cert)
                        .arg("--tls-key-file")
                        .arg(key)
                        .arg("--tls-ca-cert-file")
                        .arg(ca)
                        .args(["--tls-auth-clients", "no"]),
                };
                cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(self.dir.join("data"));
                // A replica restarted after a failover names the first
                // master; the Sentinels point it at the current one.
                if let Some(master) = self.master {
                    cmd.args(["--replicaof", "127.0.0.1", &master.to_string()]);
                }
                // A replica resynchronised in full after a failover gets
                // the data at once, not after the default 5 s.
                cmd.args(["--repl-diskless-sync-delay", "0"]);
            }
            Kind::ClusterNode => {
                cmd.arg("redis-server")
                    .args(["--port", &self.addr.port().to_string()])
                    .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                    .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                    // Not the default port + 10000, which may be taken.
                    .args(["--cluster-port", &self.peer.to_string()])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--repl-diskless-sync-delay", "0"])
                    .arg("--dir")
                    .arg(self.dir.join("data"));
            }
            Kind::Sentinel => {
                cmd.arg("redis-server")
                    .arg(self.dir.join("sentinel.conf"))
                    .arg("--sentinel");
            }
            Kind::Etcd => {
                let client = format!("http://{}", self.addr);
                let peer = format!("http://127.0.0.1:{}", self.peer);
                cmd.arg("etcd")
                    .args(["--name", &self.member, "--data-dir"])
                    .arg(self.dir.join("data"))
                    .args(["--listen-client-urls", &client])
                    .args(["--advertise-client-urls", &client])
                    .args(["--listen-peer-urls", &peer])
                    .args(["--initial-advertise-peer-urls", &peer])
                    .args(["--initial-cluster", &self.cluster])
                    .args(["--heartbeat-interval", "50", "--election-timeout", "500"]);
            }
            Kind::ZooKeeper => {
                cmd.arg("java")
                    .arg(format!("-Dzookeeper.log.dir={}", self.dir.display()))
                    // Empty container parents reaped every half second,
                    // not every minute.
                    .arg("-Dznode.container.checkIntervalMs=500")
                    .args(["-cp", "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar"])
                    .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
                    .arg(self.dir.join("zoo.cfg"));
            }
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {:?}: {e}", self.kind))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the server answers on its port.
    fn wait_up(&mut self, limit: Duration) -> Result<(), NotUp> {
        let deadline = Instant::now() + limit;
        let (probe, expect): (&[u8], &str) = match self.kind {
            Kind::Redis | Kind::Sentinel | Kind::ClusterNode => (b"PING\r\n", "+PONG"),
            Kind::ZooKeeper => (b"isro", "rw"),
            Kind::Etcd => (b"GET /health HTTP/1.0\r\n\r\n", "\"health\":\"true\""),
            Kind::Postgres | Kind::PgBouncer => (b"", ""),
            // The server greets a client first, naming itself.
            Kind::Mariadb => (b"", "MariaDB"),
        };
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(NotUp::Exited(format!(
                    "{:?} on {} exited ({status}; log: {})",
                    self.kind,
                    self.addr,
                    self.dir.join("server.log").display()
                )));
            }
            if matches!(self.kind, Kind::Postgres | Kind::PgBouncer) {
                let ready = Command::new("pg_isready")
                    .args(["-q", "-h", "127.0.0.1", "-p", &self.addr.port().to_string()])
                    .args(["-U", "postgres", "-d", "test"])
                    .status();
                if ready.is_ok_and(|s| s.success()) {
                    return Ok(());
                }
            } else if self.tls.is_some() {
                // It answers only through TLS: taking connections will do.
                if std::net::TcpStream::connect(self.addr).is_ok() {
                    return Ok(());
                }
            } else if let Ok(mut s) = std::net::TcpStream::connect(self.addr) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let mut reply = String::new();
                if s.write_all(probe).is_ok() {
                    let mut buf = [0u8; 64];
                    if self.kind == Kind::Etcd {
                        // HTTP/1.0: the body comes after the headers, then
                        // the server closes.
                        let _ = s.read_to_string(&mut reply);
                    } else if let Ok(n) = s.read(&mut buf) {
                        reply = String::from_utf8_lossy(&buf[..n]).into_owned();
                    }
                }
                if reply.contains(expect) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(NotUp::TimedOut(format!(
                    "{:?} on {} did not come up (log: {})",
                    self.kind,
                    self.addr,
                    self.dir.join("server.log").display()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether it runs: started, and not killed since.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts a killed server again on the same port (ZooKeeper keeps its
    /// data directory; Redis keeps nothing).
    pub fn restart(&mut self) -> Result<(), String> {
        self.spawn()
    }

    /// `kill -9` (PostgreSQL: its whole process group).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.kind == Kind::Postgres {
                signal_pid(child.id(), "GROUP-KILL");
            }
            let _ = child.kill();
            let _ = child.wait();
            if self.kind == Kind::Postgres {
                // The postmaster's children die a moment after it; one still
                // attached to the shared memory makes a restart refuse
                // ("pre-existing shared memory block is still in use").
                group_gone(child.id(), Duration::from_secs(5));
            }
        }
    }

    pub fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            if self.kind == Kind::Postgres {
                signal_pid(pid, &format!("GROUP-{signal}"));
            } else {
                signal_pid(pid, signal);
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.signal("CONT");
        self.kill();
    }
}

#[cfg(test)]
mod tests;
