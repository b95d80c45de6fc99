//! The `tower-lock` binary as an operator runs it: its error paths, and
//! `inspect` against every backend holding a key this test process took.
//! The servers' URLs come from the environment scripts/test-all.sh sets.

use std::process::{Command, Output};

use tower_lock::{Backend, BackendExt};

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tower-lock"));
    cmd.args(args)
        .env_remove("TOWER_LOCK_URL")
        .env_remove("TOWER_LOCK_PASSWORD");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run tower-lock")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn bad_usage_urls_and_keys_exit_2_saying_why() {
    for (args, says) in [
        (&[][..], "usage: tower-lock inspect"),
        (
            &["frobnicate", "memory", "k"][..],
            "unknown command \"frobnicate\"",
        ),
        (
            &["inspect", "k"][..],
            "no URL: give one, or set TOWER_LOCK_URL",
        ),
        (
            &["inspect", "memory", "k", "--verbose"][..],
            "unknown option --verbose",
        ),
        (&["inspect", "nosuch://host", "k"][..], "misconfigured"),
        (
            &["inspect", "memory", "k", "--force"][..],
            "--force is an option of break",
        ),
        (
            &["break"][..],
            "break takes a URL (or TOWER_LOCK_URL) and a key",
        ),
        (
            &["inspect", "redis://127.0.0.1:1", "a/b"][..],
            "invalid lock key",
        ),
    ] {
        let out = run(args, &[]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(says),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let out = run(&["--help"], &[]);
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn a_free_key_is_shown_free_as_a_table_and_as_json() {
    let redis = urls().remove(0).1;
    let out = run(&["inspect", &redis, "cli:free"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(
        table.contains("key      cli:free\nstate    free\nwaiters  not known"),
        "{table}"
    );
    // The URL from the environment; a key after `--`.
    let out = run(
        &["inspect", "--json", "--", "--k\"q"],
        &[("TOWER_LOCK_URL", &redis)],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "{\"key\":\"--k\\\"q\",\"holders\":[],\"waiters\":null}\n"
    );
    let out = run(&["list", &redis, "cli:nothing:"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "", "nothing held");
}

#[test]
fn an_unreachable_server_exits_3_without_its_password() {
    let out = run(&["inspect", "redis://:s3cret@127.0.0.1:1/", "k"], &[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("s3cret"),
        "{}",
        text(&out.stderr)
    );
    let out = run(
        &["inspect", "redis://127.0.0.1:1/", "k"],
        &[("TOWER_LOCK_PASSWORD", "hunter2/x")],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("hunter2"), "{stderr}");
    // The password went into the URL (percent-encoded): redacted as one.
    assert!(stderr.contains("***"), "{stderr}");
}

/// Every backend's URL the test command exports.
fn urls() -> Vec<(&'static str, String)> {
    let env = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!(
                "{name} is not set. Run scripts/test-all.sh, which starts every server and \
                 sets it; or start the servers with `source scripts/servers.sh; start_servers`"
            )
        })
    };
    vec![
        ("redis", env("TOWER_LOCK_REDIS_URL")),
        ("redlock", env("TOWER_LOCK_REDLOCK_URL")),
        (
            "zookeeper",
            format!("zk://{}/cli", env("TOWER_LOCK_ZK_ADDR")),
        ),
        ("postgres", env("TOWER_LOCK_POSTGRES_URL")),
        ("mysql", env("TOWER_LOCK_MYSQL_URL")),
        ("etcd", env("TOWER_LOCK_ETCD_URL")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_holder_another_process_took_on_every_backend() {
    for (name, url) in urls() {
        let backend = tower_lock::backend::connect(&url).await.unwrap();
        let key = format!("cli:{name}:{}", std::process::id());
        let held = backend.lock(key.as_str()).await.unwrap();
        let out = tokio::task::spawn_blocking({
            let (url, key) = (url.clone(), key.clone());
            move || run(&["inspect", &url, &key, "--json"], &[])
        })
        .await
        .unwrap();
        let json = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", text(&out.stderr));
        assert!(
            json.starts_with(&format!("{{\"key\":\"{key}\",\"holders\":[{{")),
            "{name}: {json}"
        );
        assert_eq!(
            json.matches("\"token\":").count(),
            1,
            "{name}: one holder: {json}"
        );
        if !json.contains("\"token\":null") {
            let token = format!("\"token\":{}", held.token().get());
            assert!(json.contains(&token), "{name}: {json}");
        }
        let listed = tokio::task::spawn_blocking({
            let (url, prefix) = (url.clone(), format!("cli:{name}:"));
            move || run(&["list", &url, &prefix, "--json"], &[])
        })
        .await
        .unwrap();
        let stderr = text(&listed.stderr);
        match name {
            // The store cannot list (Backend::list's docs say why).
            "postgres" => assert_eq!(listed.status.code(), Some(4), "{name}: {stderr}"),
            // MariaDB lists with its metadata_lock_info plugin (which the
            // server suite installs), and says it needs it without.
            "mysql" if listed.status.code() == Some(4) => {
                assert!(stderr.contains("metadata_lock_info"), "{stderr}")
            }
            _ => {
                assert_eq!(listed.status.code(), Some(0), "{name}: {stderr}");
                assert_eq!(text(&listed.stdout), format!("[\"{key}\"]\n"), "{name}");
            }
        }
        held.release().await.unwrap();
        backend.flush().await;
        let out = tokio::task::spawn_blocking(move || run(&["inspect", &url, &key], &[]))
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{name}: {}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains("state    free"),
            "{name}: {}",
            text(&out.stdout)
        );
        println!("{name}: {json}");
    }
}

/// The number after `"floor":` in `break --json`'s output.
fn floor_of(json: &str) -> u64 {
    let rest = &json[json.find("\"floor\":").expect(json) + 8..];
    rest[..rest.find('}').expect(json)].parse().expect(json)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn break_frees_the_holder_and_fences_its_writes_on_every_backend() {
    for (name, url) in urls() {
        let holder = tower_lock::backend::connect(&url).await.unwrap();
        let next = tower_lock::backend::connect(&url).await.unwrap();
        let key = format!("cli-break:{name}:{}", std::process::id());
        let held = holder.lock(key.as_str()).await.unwrap();
        let breaking = |args: Vec<String>| {
            tokio::task::spawn_blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                run(&args, &[])
            })
        };
        let args = |extra: &[&str]| {
            let mut a = vec!["break".to_owned(), url.clone(), key.clone()];
            a.extend(extra.iter().map(|s| (*s).to_owned()));
            a
        };
        let ends_sessions = matches!(name, "postgres" | "mysql");
        if ends_sessions {
            // Ending the holder's connection ends all its locks: asked for.
            let out = breaking(args(&["--json"])).await.unwrap();
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(4), "{name}: {stderr}");
            assert!(stderr.contains("--force"), "{name}: {stderr}");
        }
        let out = breaking(args(&["--force", "--json"][usize::from(!ends_sessions)..]))
            .await
            .unwrap();
        let json = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", text(&out.stderr));
        assert_eq!(json.matches("\"identity\":").count(), 1, "{name}: {json}");
        let floor = floor_of(&json);
        let old = held.token().get();
        assert!(
            floor > old,
            "{name}: floor {floor} under the holder's {old}"
        );
        // A fenced store told the floor refuses the broken holder's write.
        let mut fence = floor;
        let mut write = |token: u64| {
            let accepted = token >= fence;
            fence = fence.max(token);
            accepted
        };
        assert!(
            !write(old),
            "{name}: the broken holder's write was accepted"
        );
        let after = next
            .lock(key.as_str())
            .wait(std::time::Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("{name}: the key stayed held: {e}"));
        assert!(
            write(after.token().get()),
            "{name}: the next holder was refused"
        );
        drop(held);
        holder.flush().await;
        after.release().await.unwrap();
        next.flush().await;
        println!("{name}: {json}");
    }
    // The table, for people.
    let (_, url) = urls().remove(0);
    let out = run(&["break", &url, "cli-break:free"], &[]);
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        table.contains("freed    nothing: the key was free"),
        "{table}"
    );
    assert!(table.contains("floor    "), "{table}");
}

/// Tokens from the application's own sequence: `break` is told it with
/// `?sequence=`, and refuses a floor from a sequence never drawn from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn break_draws_the_floor_from_the_sequence_the_url_names() {
    use tower_lock::backend::postgres::{PostgresBackend, PostgresOptions};
    let url = urls()
        .into_iter()
        .find(|(name, _)| *name == "postgres")
        .unwrap()
        .1;
    let pid = std::process::id();
    let (own, fresh) = (format!("cli_tokens_{pid}"), format!("cli_fresh_{pid}"));
    let holder =
        PostgresBackend::connect_with(&url, PostgresOptions::default().sequence(own.as_str()))
            .await
            .unwrap();
    let key = format!("cli-sequence:{pid}");
    let held = holder.lock(key.as_str()).await.unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    let with = |sequence: &str| format!("{url}{sep}sequence={sequence}");
    let run_break = |url: String| {
        let key = key.clone();
        tokio::task::spawn_blocking(move || run(&["break", &url, &key, "--force", "--json"], &[]))
    };
    let out = run_break(with(&fresh)).await.unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("?sequence="), "{stderr}");
    let out = run_break(with(&own)).await.unwrap();
    let json = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(floor_of(&json) > held.token().get(), "{json}");
    drop(held);
    holder.flush().await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "DROP SEQUENCE IF EXISTS {own}; DROP SEQUENCE IF EXISTS {fresh}"
        ))
        .await
        .unwrap();
}
