//! `rediss://` and `redlocks://`, against TLS servers of the tests' own.

use super::*;

/// A throw-away CA and a server certificate it signed for 127.0.0.1, made
/// with `openssl` in a directory of their own, removed when dropped.
#[cfg(feature = "redis-tls")]
struct TestCa {
    dir: std::path::PathBuf,
}

#[cfg(feature = "redis-tls")]
impl TestCa {
    fn new() -> TestCa {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-tls-{}-{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ca = TestCa { dir };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        ca.openssl(&[
            &["req", "-x509"],
            &ec,
            &["-days", "1", "-subj", "/CN=tower-lock test CA"],
            &["-keyout", "ca.key", "-out", "ca.crt"],
        ]);
        ca.openssl(&[
            &["req"],
            &ec,
            &[
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]);
        std::fs::write(
            ca.path("server.ext"),
            "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        ca.openssl(&[&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "server.ext",
            "-out",
            "server.crt",
        ]]);
        ca
    }

    fn openssl(&self, args: &[&[&str]]) {
        let args = args.concat();
        let out = Command::new("openssl")
            .args(&args)
            .current_dir(&self.dir)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run openssl ({e}), which makes the TLS tests' certificates: install \
                     it with `apt-get install openssl` (scripts/test-all.sh does, as root)"
                )
            });
        assert!(
            out.status.success(),
            "openssl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name)
    }

    /// The CA certificate, PEM.
    fn pem(&self) -> Vec<u8> {
        std::fs::read(self.path("ca.crt")).unwrap()
    }
}

#[cfg(feature = "redis-tls")]
impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(feature = "redis-tls")]
impl Server {
    /// Serving TLS only, on a free port, with the certificate `ca` made for
    /// 127.0.0.1; clients are not asked for certificates.
    fn start_tls(ca: &TestCa) -> Server {
        let files = ["server.crt", "server.key", "ca.crt"].map(|name| ca.path(name));
        Self::wrap(|work, name| {
            tower_lock_servers::Server::start_redis_tls(
                work,
                name,
                files.each_ref().map(|p| p.as_path()),
            )
        })
    }
}

/// Takes `k` with `a`, checks `b` is refused it meanwhile, releases it and
/// takes it with `b`.
#[cfg(feature = "redis-tls")]
async fn excludes_and_releases(a: &impl Backend, b: &impl Backend) {
    let g = a.lock("k").await.unwrap();
    let second = b.lock("k").fail_fast().await;
    assert!(
        matches!(second, Err(LockError::Busy)),
        "a second holder must be refused as busy: {second:?}"
    );
    g.release().await.unwrap();
    b.lock("k")
        .fail_fast()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rediss_trusting_a_private_ca_locks_exclude_and_release() {
    let ca = TestCa::new();
    let server = Server::start_tls(&ca);
    let url = server.tls_url();
    let options = || {
        RedisOptions::default()
            .prefix("tls:")
            .tls_root_certificate(ca.pem())
    };
    let a = RedisBackend::connect_with(&url, options()).await.unwrap();
    let b = RedisBackend::connect_with(&url, options()).await.unwrap();
    excludes_and_releases(&a, &b).await;
    // Contended from two backends: one holder at a time, tokens rising.
    contend_from_two(&a, &b).await;
    // Released in Redis: only the fencing counter is left.
    let keys = keys_under(&format!("{url}#insecure"), "tls:").await;
    assert_eq!(keys, ["tls:{k}:fence"]);
}

#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn rediss_refuses_a_certificate_it_cannot_verify_unless_insecure() {
    let ca = TestCa::new();
    let server = Server::start_tls(&ca);
    let url = server.tls_url();
    let other = TestCa::new();
    // Neither the system's trust store nor another CA vouch for the server.
    for options in [
        RedisOptions::default(),
        RedisOptions::default().tls_root_certificate(other.pem()),
    ] {
        let started = Instant::now();
        let err = RedisBackend::connect_with(&url, options).await.unwrap_err();
        let took = started.elapsed();
        assert!(matches!(err, LockError::Backend { .. }), "{err}");
        assert!(
            err.to_string().contains("certificate verify failed"),
            "{err}"
        );
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
    // `#insecure` checks nothing, and works.
    let insecure = format!("{url}#insecure");
    let a = RedisBackend::connect(&insecure).await.unwrap();
    let b = tower_lock::backend::connect(&insecure).await.unwrap();
    excludes_and_releases(&a, &b).await;
    // A root certificate that is not one, or one given for a plain URL.
    for (url, pem) in [
        (url.as_str(), b"not a certificate".to_vec()),
        (&server.url(), ca.pem()),
    ] {
        let options = RedisOptions::default().tls_root_certificate(pem);
        let err = RedisBackend::connect_with(url, options).await.unwrap_err();
        assert!(matches!(err, LockError::Config(_)), "{url}: {err}");
    }
}

#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn a_plain_url_to_a_tls_port_fails_clearly_within_the_timeout() {
    let ca = TestCa::new();
    let tls = Server::start_tls(&ca);
    let plain = Server::start();
    let timeout = Duration::from_secs(1);
    let options = || {
        RedisOptions::default()
            .connect_timeout(timeout)
            .response_timeout(timeout)
    };
    for (url, options, hint) in [
        (tls.url(), options(), "if it expects TLS, use rediss://"),
        // And the other way round: TLS to a server that does not speak it.
        (
            plain.tls_url(),
            options().tls_root_certificate(ca.pem()),
            "if the server does not speak TLS, use redis://",
        ),
    ] {
        let started = Instant::now();
        let err = RedisBackend::connect_with(&url, options).await.unwrap_err();
        let took = started.elapsed();
        eprintln!("{url}: {err} (after {took:?})");
        assert!(matches!(err, LockError::Backend { .. }), "{url}: {err}");
        assert!(err.to_string().contains(&url), "{url}: {err}");
        assert!(err.to_string().contains(hint), "{url}: {err}");
        // One try and two retries of the connection manager, at most.
        assert!(took < 4 * timeout, "{url}: took {took:?}: {err}");
    }
}

#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlocks_locks_over_tls_and_checks_certificates() {
    use tower_lock::backend::redis::redlock::RedlockBackend;
    let ca = TestCa::new();
    let servers: Vec<Server> = (0..3).map(|_| Server::start_tls(&ca)).collect();
    let list = redlock_url(&servers).replace("redlock://", "");
    let insecure = format!("redlocks://{list}#insecure");
    let a = RedlockBackend::connect(&insecure).await.unwrap();
    let b = RedlockBackend::connect(&insecure).await.unwrap();
    excludes_and_releases(&a, &b).await;
    // Checked against the system's trust store, which lacks the test CA;
    // and plain connections to TLS ports: no instance answers.
    for url in [format!("redlocks://{list}"), format!("redlock://{list}")] {
        let b = RedlockBackend::connect(&url).await.unwrap();
        let err = b.lock("k").fail_fast().await.unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{url}: {err}");
    }
    assert!(matches!(
        RedlockBackend::connect(&format!("redlock://{list}#insecure")).await,
        Err(LockError::Config(_))
    ));
    // The test CA trusted through OpenSSL's SSL_CERT_FILE, read once per
    // process: in a child, through `backend::connect`.
    let urls = [format!("redlocks://{list}"), servers[0].tls_url()];
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TOWER_LOCK_CHILD", "tls_lock")
        .env("TOWER_LOCK_TLS_URLS", urls.join(" "))
        .env("SSL_CERT_FILE", ca.path("ca.crt"))
        .env_remove("SSL_CERT_DIR")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for url in &urls {
        assert!(stdout.contains(&format!("locked {url}")), "{url}: {stdout}");
    }
}

/// The child of the test above: takes and releases a lock through every URL
/// of `TOWER_LOCK_TLS_URLS`.
#[cfg(feature = "redis-tls")]
pub(super) async fn tls_lock_child() {
    let urls = std::env::var("TOWER_LOCK_TLS_URLS").unwrap();
    for url in urls.split(' ') {
        let b = tower_lock::backend::connect(url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        let g = b
            .lock("k")
            .fail_fast()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        g.release().await.unwrap();
        println!("locked {url}");
    }
}

#[cfg(not(feature = "redis-tls"))]
#[tokio::test]
async fn without_the_redis_tls_feature_a_tls_url_is_a_config_error_naming_it() {
    use tower_lock::backend::redis::redlock::RedlockBackend;
    let names_the_feature = |url: &str, err: LockError| match err {
        LockError::Config(m) if m.contains("`redis-tls` feature") => {}
        other => panic!("{url}: {other}"),
    };
    let rediss = "rediss://127.0.0.1:6379/";
    let redlocks = "redlocks://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3";
    names_the_feature(rediss, RedisBackend::connect(rediss).await.unwrap_err());
    names_the_feature(
        redlocks,
        RedlockBackend::connect(redlocks).await.unwrap_err(),
    );
    for url in [rediss, redlocks] {
        names_the_feature(url, tower_lock::backend::connect(url).await.err().unwrap());
    }
}
