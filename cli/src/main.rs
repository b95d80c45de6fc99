//! `tower-lock`: who holds a lock, from an operator's shell.
//!
//! ```text
//! tower-lock inspect [URL] KEY [--json]
//! tower-lock list [URL] [PREFIX] [--json]
//! tower-lock break [URL] KEY [--force] [--json]
//! ```
//!
//! `URL` is any URL `tower_lock::backend::connect` takes (`redis://…`,
//! `redlock://…`, `zk://…`, `postgres://…`, `mysql://…`, `etcd://…`). It
//! may be left out when `TOWER_LOCK_URL` holds it, and a password may come
//! from `TOWER_LOCK_PASSWORD` rather than the URL, so that neither is on
//! the command line (where other users of the machine can read it). No
//! output shows a password.
//!
//! Exit codes: 0 answered (held or free); 2 bad usage, URL or key; 3 the
//! server could not be reached or failed; 4 the backend cannot do it
//! (`break` on PostgreSQL advisory locks and MariaDB: not without
//! `--force`).

use std::process::ExitCode;
use std::time::Duration;

use tower_lock::backend::{BreakScope, Broken, Inspection};
use tower_lock::{LockError, LockKey};

const USAGE: &str = "usage: tower-lock inspect [URL] KEY [--json]
       tower-lock list [URL] [PREFIX] [--json]
       tower-lock break [URL] KEY [--force] [--json]

  inspect  who holds KEY (token, mode, lease left, identity) and how many
           wait, as far as the store keeps them
  list     the keys held, those starting with PREFIX if given
  break    frees KEY whoever holds it, after raising its fencing floor
           above every token handed out: prints the floor, to write to
           the fenced store so that the broken holder's writes are refused.
           On PostgreSQL advisory locks and MariaDB it ends the holder's
           connection (every lock it holds): only with --force. There the
           floor comes from the token sequence: add ?sequence=name to the
           URL if the application names its own. ZooKeeper semaphores are
           not broken; a PostgreSQL advisory semaphore's permits show free

  URL     a backend URL (redis://, redlock://, zk://, postgres://, mysql://,
          etcd://); TOWER_LOCK_URL when left out. TOWER_LOCK_PASSWORD, if
          set, is the password of a URL that gives none.
  KEY     the lock key, namespace included (e.g. sku:42); after `--` when
          it starts with `--`

exit codes: 0 answered, 2 bad usage, URL or key, 3 server unreachable or
failing, 4 the backend cannot do it (break: not without --force)";

/// What the command line asks.
struct Command {
    what: What,
    url: String,
    /// The key to inspect, or the prefix to list.
    key: String,
    json: bool,
    /// `break` may end the holder's connection.
    force: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum What {
    Inspect,
    List,
    Break,
}

/// Whether a lone argument of `list` is a URL rather than a prefix.
fn is_url(arg: &str) -> bool {
    arg.contains("://") || arg == "memory"
}

fn env_url() -> Result<String, String> {
    match std::env::var("TOWER_LOCK_URL") {
        Ok(url) if !url.is_empty() => Ok(url),
        _ => Err("no URL: give one, or set TOWER_LOCK_URL".into()),
    }
}

fn parse(args: &[String]) -> Result<Command, String> {
    // Options before `--`; after it, a key may start with `--`.
    let (options, after) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (args, &[][..]),
    };
    let json = options.iter().any(|a| a == "--json");
    let force = options.iter().any(|a| a == "--force");
    let mut rest: Vec<&String> = options
        .iter()
        .filter(|a| *a != "--json" && *a != "--force")
        .collect();
    if let Some(flag) = rest.iter().find(|a| a.starts_with("--")) {
        return Err(format!("unknown option {flag}"));
    }
    rest.extend(after);
    let (what, url, key) = match rest.as_slice() {
        [cmd, url, key] if cmd.as_str() == "inspect" => {
            (What::Inspect, (*url).clone(), (*key).clone())
        }
        [cmd, key] if cmd.as_str() == "inspect" => (What::Inspect, env_url()?, (*key).clone()),
        [cmd, ..] if cmd.as_str() == "inspect" => {
            return Err("inspect takes a URL (or TOWER_LOCK_URL) and a key".into())
        }
        [cmd, url, key] if cmd.as_str() == "break" => (What::Break, (*url).clone(), (*key).clone()),
        [cmd, key] if cmd.as_str() == "break" => (What::Break, env_url()?, (*key).clone()),
        [cmd, ..] if cmd.as_str() == "break" => {
            return Err("break takes a URL (or TOWER_LOCK_URL) and a key".into())
        }
        [cmd, url, prefix] if cmd.as_str() == "list" => {
            (What::List, (*url).clone(), (*prefix).clone())
        }
        [cmd, arg] if cmd.as_str() == "list" && is_url(arg) => {
            (What::List, (*arg).clone(), String::new())
        }
        [cmd, prefix] if cmd.as_str() == "list" => (What::List, env_url()?, (*prefix).clone()),
        [cmd] if cmd.as_str() == "list" => (What::List, env_url()?, String::new()),
        [cmd, ..] if cmd.as_str() == "list" => {
            return Err("list takes a URL (or TOWER_LOCK_URL) and a prefix".into())
        }
        [cmd, ..] => return Err(format!("unknown command {cmd:?}")),
        [] => return Err("no command".into()),
    };
    if force && what != What::Break {
        return Err("--force is an option of break".into());
    }
    if url == "memory" || url.starts_with("memory://") {
        return Err(
            "the memory backend lives in one process: another sees none of its locks".into(),
        );
    }
    let url = match std::env::var("TOWER_LOCK_PASSWORD") {
        Ok(password) if !password.is_empty() && takes_password(&url) => {
            with_password(&url, &password)?
        }
        _ => url,
    };
    Ok(Command {
        what,
        url,
        key,
        json,
        force,
    })
}

/// Whether `url`'s scheme has a password (ZooKeeper and etcd URLs have
/// none, and TOWER_LOCK_PASSWORD is left out of them).
fn takes_password(url: &str) -> bool {
    let scheme = url.split_once("://").map_or("", |(s, _)| s);
    matches!(
        scheme,
        "redis"
            | "rediss"
            | "redis+sentinel"
            | "redis+cluster"
            | "postgres"
            | "postgresql"
            | "mysql"
    )
}

/// `url` with `password` as its password, unless it gives one already.
fn with_password(url: &str, password: &str) -> Result<String, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(url.to_owned());
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    if authority.contains(',') {
        return Err(
            "TOWER_LOCK_PASSWORD applies to a URL of one host; give each host's in the URL".into(),
        );
    }
    let (user, host) = match authority.rsplit_once('@') {
        Some((userinfo, _)) if userinfo.contains(':') => return Ok(url.to_owned()),
        Some((user, host)) => (user, host),
        None => ("", authority),
    };
    let encoded: String = password
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect();
    Ok(format!("{scheme}://{user}:{encoded}@{host}{tail}"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    }
    if matches!(args[0].as_str(), "-h" | "--help" | "help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let command = match parse(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tower-lock: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a Tokio runtime");
    let result = match command.what {
        What::Inspect => runtime.block_on(inspect(&command)).map(|seen| {
            if command.json {
                format!("{}\n", seen.to_json())
            } else {
                table(&seen)
            }
        }),
        What::Break => runtime.block_on(break_lock(&command)).map(|broken| {
            if command.json {
                format!("{}\n", broken.to_json())
            } else {
                broken_table(&broken)
            }
        }),
        What::List => runtime.block_on(list(&command)).map(|keys| {
            if command.json {
                let keys: Vec<String> = keys.iter().map(|k| string(k.as_str())).collect();
                format!("[{}]\n", keys.join(","))
            } else {
                keys.iter().map(|k| format!("{k}\n")).collect()
            }
        }),
    };
    match result {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            // `LockError`'s text never shows a URL's userinfo.
            eprintln!("tower-lock: {e}");
            ExitCode::from(match e {
                LockError::InvalidKey(_) | LockError::Config(_) | LockError::InvalidMode(_) => 2,
                LockError::Unsupported(_) => 4,
                _ => 3,
            })
        }
    }
}

/// Runs `work` on the backend the URL opens, within a minute in all.
async fn on_backend<T, F, Fut>(url: &str, work: F) -> Result<T, LockError>
where
    F: FnOnce(std::sync::Arc<dyn tower_lock::Backend>) -> Fut,
    Fut: std::future::Future<Output = Result<T, LockError>>,
{
    let all = async {
        let backend = tower_lock::backend::connect(url).await?;
        work(backend).await
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .unwrap_or_else(|_| {
            Err(LockError::backend(
                "tower-lock",
                "no answer within 60 s",
                None,
            ))
        })
}

/// The held keys under the prefix.
async fn list(command: &Command) -> Result<Vec<LockKey>, LockError> {
    let prefix = command.key.clone();
    on_backend(&command.url, |backend| async move {
        backend.list(&prefix).await
    })
    .await
}

/// Frees the key, ending the holder's connection only with `--force`.
async fn break_lock(command: &Command) -> Result<Broken, LockError> {
    let key = LockKey::new(&command.key)?;
    let scope = if command.force {
        BreakScope::Sessions
    } else {
        BreakScope::LocksOnly
    };
    on_backend(&command.url, |backend| async move {
        backend.break_lock(key, scope).await
    })
    .await
}

/// Who holds the key.
async fn inspect(command: &Command) -> Result<Inspection, LockError> {
    let key = LockKey::new(&command.key)?;
    on_backend(
        &command.url,
        |backend| async move { backend.inspect(key).await },
    )
    .await
}

fn table(seen: &Inspection) -> String {
    let mut out = format!("key      {}\n", seen.key);
    let state = match seen.holders.len() {
        0 => "free".to_owned(),
        1 => "held by 1".to_owned(),
        n => format!("held by {n}"),
    };
    out += &format!("state    {state}\n");
    out += &match seen.waiters {
        Some(n) => format!("waiters  {n}\n"),
        None => "waiters  not known (the store keeps no queue)\n".to_owned(),
    };
    out += &holder_lines(&seen.holders);
    out
}

fn holder_lines(holders: &[tower_lock::backend::Holder]) -> String {
    let mut out = String::new();
    for h in holders {
        let token = h.token.map_or("-".to_owned(), |t| t.to_string());
        let mode = h.mode.map_or("-".to_owned(), |m| m.to_string());
        let left = h
            .lease_left
            .map_or("-".to_owned(), |l| format!("{:.1} s left", l.as_secs_f64()));
        let who = h.identity.as_deref().unwrap_or("-");
        out += &format!("  token {token:<20} {mode:<12} {left:<14} {who}\n");
    }
    out
}

fn broken_table(broken: &Broken) -> String {
    let mut out = format!("key      {}\n", broken.key);
    out += &match broken.holders.len() {
        0 => "freed    nothing: the key was free\n".to_owned(),
        n => format!("freed    {n} holder(s)\n"),
    };
    out += &holder_lines(&broken.holders);
    out += &format!(
        "floor    {}: every token handed out before the break is below it; write it to\n         \
         the fenced store to refuse the broken holder's writes at once\n",
        broken.floor
    );
    out
}

/// `s` as a JSON string (a listed key).
fn string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
