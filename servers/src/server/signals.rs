//! Signals to processes and process groups, and telling when they took
//! effect, from `/proc`.

use std::time::{Duration, Instant};

/// Waits, at most `limit`, until no process of the group `pgid` led is
/// still running. Zombies do not count: they hold no shared memory, and
/// where nothing reaps them they would stay.
pub(super) fn group_gone(pgid: u32, limit: Duration) {
    let deadline = Instant::now() + limit;
    while group_running(pgid) {
        if Instant::now() > deadline {
            eprintln!("harness: processes of group {pgid} still running {limit:?} after a kill");
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a process of group `pgid` is running (a zombie is not).
fn group_running(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    let pgid = pgid.to_string();
    entries.flatten().any(|entry| {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            return false;
        };
        // `pid (comm) state ppid pgrp ...`; `comm` may hold spaces and `)`.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let pgrp = fields.nth(1);
        state != Some("Z") && pgrp == Some(pgid.as_str())
    })
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

/// Stops a client process and returns when every thread of it is seen
/// stopped, with that moment on the monotonic clock; `None` if it is not
/// seen so within `limit` (it exited). `SIGSTOP` is taken by one thread,
/// woken to take it, which then stops the others: on a busy machine that
/// thread may wait milliseconds for a CPU while the others go on running
/// (granting, acting) after `kill(2)` has returned. Dated from here, a
/// pause begins when the process surely runs no more.
pub fn stop_pid(pid: u32, limit: Duration) -> Option<u64> {
    signal_pid(pid, "STOP");
    let deadline = Instant::now() + limit;
    loop {
        if all_stopped(pid) {
            return Some(crate::now_ns());
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Whether every thread of `pid` is in the stopped state (`T`); false once
/// it is gone.
fn all_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for task in tasks {
        let Ok(stat) = task.and_then(|t| std::fs::read_to_string(t.path().join("stat"))) else {
            return false;
        };
        // `tid (comm) state ...`; `comm` may hold spaces and `)`.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if state != Some("T") {
            return false;
        }
        any = true;
    }
    any
}
