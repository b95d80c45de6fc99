//! The harness's own checks: a stopped process dated right, a PostgreSQL
//! restart that waits out the old one.

use super::*;
use crate::now_ns;

/// Run as a child by the test below: one thread writes the time as
/// fast as it can while the main thread waits for it, as a client's
/// runtime thread waits while its workers run.
#[test]
#[ignore = "a child process of stop_pid_returns_once_no_thread_runs"]
fn stop_helper_child() {
    let Some(path) = std::env::var_os("TORTURE_STOP_HELPER") else {
        return;
    };
    let spin = std::thread::spawn(move || {
        use std::io::Write;
        let mut out = std::fs::File::create(path).unwrap();
        loop {
            let _ = writeln!(out, "{}", now_ns());
        }
    });
    let _ = spin.join();
}

/// Nothing the stopped process does is dated after the time `stop_pid`
/// returns, also with every CPU busy (a loaded machine delays the
/// thread that takes the signal, not the one that runs).
#[test]
fn stop_pid_returns_once_no_thread_runs() {
    let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let hogs: Vec<_> = (0..std::thread::available_parallelism().map_or(2, |n| n.get()))
        .map(|_| {
            let busy = busy.clone();
            std::thread::spawn(move || while busy.load(std::sync::atomic::Ordering::Relaxed) {})
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("torture-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut late = Vec::new();
    for i in 0..30 {
        let path = dir.join(format!("{i}"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["server::tests::stop_helper_child", "--exact", "--ignored"])
            .env("TORTURE_STOP_HELPER", &path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        while std::fs::metadata(&path).map_or(0, |m| m.len()) < 4096 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let stop = stop_pid(child.id(), Duration::from_secs(5)).expect("seen stopped");
        std::thread::sleep(Duration::from_millis(5));
        let _ = child.kill();
        let _ = child.wait();
        let text = std::fs::read_to_string(&path).unwrap();
        // The last line may be cut short by the kill.
        let last = text
            .lines()
            .rev()
            .skip(1)
            .find_map(|l| l.parse::<u64>().ok());
        if let Some(t) = last.filter(|&t| t > stop) {
            late.push((t - stop) as f64 / 1e6);
        }
    }
    busy.store(false, std::sync::atomic::Ordering::Relaxed);
    for h in hogs {
        h.join().unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(late.is_empty(), "ran after the pause began (ms): {late:?}");
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let ppid = rest.split_whitespace().nth(1);
        if ppid == Some(pid.to_string().as_str()) {
            found.push(entry.file_name().to_string_lossy().parse().unwrap());
        }
    }
    found
}

/// A PostgreSQL server killed while processes of the old one still
/// hold its shared memory (stopped here, as a loaded machine can leave
/// them for a moment) starts once they are gone, instead of failing
/// "pre-existing shared memory block is still in use".
#[test]
fn postgres_restarts_once_the_old_processes_let_go() {
    let work = std::env::temp_dir().join(format!("servers-pg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let mut server = Server::start(Kind::Postgres, &work, "pg").unwrap();
    let postmaster = server.pid().unwrap();
    let lingering = children_of(postmaster);
    assert!(!lingering.is_empty(), "the postmaster has children");
    for &pid in &lingering {
        signal_pid(pid, "STOP");
    }
    // The postmaster alone, its children stopped and still attached.
    let mut child = server.child.take().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let reaper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        for pid in lingering {
            signal_pid(pid, "KILL");
        }
    });
    let restarted = server.restart();
    reaper.join().unwrap();
    assert!(restarted.is_ok(), "{restarted:?}");
    drop(server);
    let _ = std::fs::remove_dir_all(&work);
}

/// A member that could not bind a port is told from one that failed
/// otherwise, by its log: etcd's and ZooKeeper's wording of it.
#[test]
fn a_port_taken_is_read_off_the_log() {
    let dir = std::env::temp_dir().join(format!("harness-taken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server = Server::prepare(Kind::Etcd, &dir, "server0").unwrap();
    let log = server.dir.join("server.log");
    assert!(!server.found_a_port_taken(), "no log yet");
    for (text, taken) in [
        (
            "etcdmain: listen tcp 127.0.0.1:45049: bind: address already in use",
            true,
        ),
        ("java.net.BindException: Address already in use", true),
        (
            "etcdmain: cannot access data directory: permission denied",
            false,
        ),
    ] {
        std::fs::write(&log, text).unwrap();
        assert_eq!(server.found_a_port_taken(), taken, "{text}");
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
