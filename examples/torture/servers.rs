//! The lock servers a run uses: started by the harness (so that it can kill,
//! restart and pause them) or given by URL (then it cannot).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What kind of server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Redis,
    ZooKeeper,
    /// A private PostgreSQL cluster, run as the `postgres` user when the
    /// harness runs as root (PostgreSQL refuses root). Its processes form a
    /// group of their own, so that kill and pause reach every one of them.
    Postgres,
}

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

/// A command run as the `postgres` user when this process is root.
fn as_postgres(program: PathBuf) -> Command {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
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
        let port = free_port().map_err(|e| e.to_string())?;
        let dir = work.join(name);
        std::fs::create_dir_all(dir.join("data")).map_err(|e| e.to_string())?;
        let mut server = Server {
            kind,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            dir,
            child: None,
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
        if kind == Kind::Postgres {
            let data = server.dir.join("data");
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } == 0 {
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
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.join("server.log")).map_err(|e| e.to_string())?;
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
        match self.kind {
            Kind::Postgres => {}
            Kind::Redis => {
                cmd.arg("redis-server")
                    .args(["--port", &self.addr.port().to_string()])
                    .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(self.dir.join("data"));
            }
            Kind::ZooKeeper => {
                cmd.arg("java")
                    .arg(format!("-Dzookeeper.log.dir={}", self.dir.display()))
                    .arg("-Dznode.container.checkIntervalMs=1000")
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
        self.wait_up(Duration::from_secs(120))
    }

    /// Waits until the server answers on its port.
    fn wait_up(&self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        let (probe, expect): (&[u8], &str) = match self.kind {
            Kind::Redis => (b"PING\r\n", "+PONG"),
            Kind::ZooKeeper => (b"isro", "rw"),
            Kind::Postgres => (b"", ""),
        };
        loop {
            if self.kind == Kind::Postgres {
                let ready = Command::new("pg_isready")
                    .args(["-q", "-h", "127.0.0.1", "-p", &self.addr.port().to_string()])
                    .status();
                if ready.is_ok_and(|s| s.success()) {
                    return Ok(());
                }
            } else if let Ok(mut s) = std::net::TcpStream::connect(self.addr) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let mut reply = String::new();
                if s.write_all(probe).is_ok() {
                    let mut buf = [0u8; 64];
                    if let Ok(n) = s.read(&mut buf) {
                        reply = String::from_utf8_lossy(&buf[..n]).into_owned();
                    }
                }
                if reply.contains(expect) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{:?} on {} did not come up (log: {})",
                    self.kind,
                    self.addr,
                    self.dir.join("server.log").display()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
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

/// Sends `signal` (`STOP`, `CONT`, `KILL`) to a process, or with `GROUP-`
/// before it to the process group it leads.
pub fn signal_pid(pid: u32, signal: &str) {
    let (pid, signal) = match signal.strip_prefix("GROUP-") {
        Some(signal) => (-(pid as i64), signal),
        None => (pid as i64, signal),
    };
    let signal = match signal {
        "STOP" => libc::SIGSTOP,
        "CONT" => libc::SIGCONT,
        _ => libc::SIGKILL,
    };
    // SAFETY: kill(2) with a pid this harness started; a process already
    // gone only makes it fail.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}
