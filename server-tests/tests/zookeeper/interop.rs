//! Curator and kazoo on the same paths, both ways.

use super::*;

/// Curator's jars from Debian's libcurator-recipes-java, and the interop
/// program compiled against them (once per test run).
fn curator_classpath() -> &'static str {
    static CP: OnceLock<String> = OnceLock::new();
    CP.get_or_init(|| {
        let jars = [
            "curator-client", "curator-framework", "curator-recipes", "zookeeper",
            "zookeeper-jute", "guava", "slf4j-api", "slf4j-nop",
        ];
        let mut cp: Vec<String> = Vec::new();
        for jar in jars {
            let path = format!("/usr/share/java/{jar}.jar");
            assert!(
                std::path::Path::new(&path).exists(),
                "{path} is missing: install Debian's libcurator-recipes-java (scripts/test-all.sh does)"
            );
            cp.push(path);
        }
        let out: PathBuf = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("curator-interop");
        std::fs::create_dir_all(&out).unwrap();
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/interop/CuratorLock.java");
        let status = Command::new("javac")
            .args(["-d", &out.display().to_string(), "-cp", &cp.join(":"), source])
            .status()
            .expect("javac not found: install a JDK (default-jdk-headless)");
        assert!(status.success(), "compiling {source} failed");
        cp.insert(0, out.display().to_string());
        cp.join(":")
    })
}

/// A foreign client process holding or trying a lock.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Peer {
    fn curator(path: &str, recipe: &str, action: &[&str]) -> Peer {
        let mut cmd = Command::new("java");
        cmd.args([
            "-cp",
            curator_classpath(),
            "CuratorLock",
            &zk_addr(),
            path,
            recipe,
        ]);
        cmd.args(action);
        Self::spawn(cmd)
    }

    fn kazoo(path: &str, action: &[&str]) -> Peer {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/interop/kazoo_lock.py");
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.args([script, &zk_addr(), path]);
        cmd.args(action);
        Self::spawn(cmd)
    }

    fn spawn(mut cmd: Command) -> Peer {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect(
                "cannot start the peer (java / python3-kazoo; scripts/test-all.sh installs them)",
            );
        Peer {
            stdin: child.stdin.take(),
            out: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    /// The peer's next word on its own line.
    fn says(&mut self) -> String {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    /// Tells a holding peer to release, and waits for it.
    fn release(mut self) {
        writeln!(self.stdin.take().unwrap()).unwrap();
        assert_eq!(self.says(), "released");
        assert!(self.child.wait().unwrap().success());
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `(peer, recipe)`: Curator holds, we wait; then we hold, Curator waits.
async fn interop_both_ways(test: &str, ours: LockMode, recipe: &str) {
    let zk = backend(test).await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());

    let mut theirs = Peer::curator(&path, recipe, &["hold"]);
    assert_eq!(theirs.says(), "held");
    assert!(matches!(
        zk.lock("k").mode(ours).fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let zk = zk.clone();
        tokio::spawn(async move { zk.lock("k").mode(ours).wait(Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "acquired while Curator held {recipe}"
    );
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
    let g = waiting.await.unwrap().unwrap();

    let mut peer = Peer::curator(&path, recipe, &["try", "300"]);
    assert_eq!(
        peer.says(),
        "timeout",
        "Curator's {recipe} ignored our lock"
    );
    g.release().await.unwrap();
    let mut peer2 = Peer::curator(&path, recipe, &["try", "5000"]);
    assert_eq!(peer2.says(), "acquired");
    peer.child.wait().unwrap();
    peer2.child.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_mutex_interoperates_both_ways() {
    interop_both_ways("curator-mutex", LockMode::Exclusive, "mutex").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_read_write_lock_interoperates() {
    interop_both_ways("curator-write", LockMode::Write, "write").await;
    // Readers share with Curator's readers; a Curator writer waits for ours.
    let zk = backend("curator-read").await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());
    let theirs = Peer::curator(&path, "read", &["hold"]);
    let mut theirs = theirs;
    assert_eq!(theirs.says(), "held");
    let r = zk.lock("k").mode(LockMode::Read).fail_fast().await.unwrap();
    assert!(matches!(
        zk.lock("k").mode(LockMode::Write).fail_fast().await,
        Err(LockError::Busy)
    ));
    let mut writer = Peer::curator(&path, "write", &["try", "300"]);
    assert_eq!(writer.says(), "timeout");
    writer.child.wait().unwrap();
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
    r.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_semaphore_v2_counts_our_leases() {
    let zk = backend("curator-sem").await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());
    let sem = LockMode::Semaphore { permits: 2 };
    let mut theirs = Peer::curator(&path, "semaphore:2", &["hold"]);
    assert_eq!(theirs.says(), "held");
    let ours = zk.lock("k").mode(sem).fail_fast().await.unwrap();
    assert!(matches!(
        zk.lock("k").mode(sem).fail_fast().await,
        Err(LockError::Busy)
    ));
    let mut third = Peer::curator(&path, "semaphore:2", &["try", "300"]);
    assert_eq!(third.says(), "timeout");
    third.child.wait().unwrap();
    ours.release().await.unwrap();
    let mut third = Peer::curator(&path, "semaphore:2", &["try", "5000"]);
    assert_eq!(third.says(), "acquired");
    third.child.wait().unwrap();
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kazoo_locks_coexist_on_the_same_path() {
    let zk = backend("kazoo").await;
    let path = zk.lock_path(&LockKey::new("k").unwrap());
    let mut theirs = Peer::kazoo(&path, &["hold"]);
    assert_eq!(theirs.says(), "held");
    assert!(matches!(
        zk.lock("k").fail_fast().await,
        Err(LockError::Busy)
    ));
    let waiting = {
        let zk = zk.clone();
        tokio::spawn(async move { zk.lock("k").wait(Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished());
    tokio::task::spawn_blocking(move || theirs.release())
        .await
        .unwrap();
    let g = waiting.await.unwrap().unwrap();
    let mut peer = Peer::kazoo(&path, &["try", "300"]);
    assert_eq!(peer.says(), "timeout", "kazoo ignored our lock");
    peer.child.wait().unwrap();
    g.release().await.unwrap();
    let mut peer = Peer::kazoo(&path, &["try", "5000"]);
    assert_eq!(peer.says(), "acquired");
    peer.child.wait().unwrap();
}
