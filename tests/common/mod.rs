//! Helpers shared by the server tests (`mod common;` in each).
#![allow(dead_code)]

/// The torture harness's fault proxy: a holder's connections go through it,
/// and only that path fails while the server stays up for everyone else.
#[path = "../../examples/torture/fault_proxy.rs"]
pub mod fault_proxy;

/// Serves `app` on a free loopback port.
pub async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Waits until `cond` holds, checking every millisecond for at most 10 s:
/// sequencing for the test, not a timing assertion.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Checks a log of `start P`, `enter P`, `leave P` and `end P` entries from
/// two processes: each critical section is entered and left by one process
/// with no other entry between, and both processes started before either
/// ended, so they contended for the lock at the same time.
pub fn check_two_process_log(log: &[String], sections_each: usize) {
    let pids: std::collections::BTreeSet<&str> = log
        .iter()
        .filter_map(|l| l.strip_prefix("start "))
        .collect();
    assert_eq!(pids.len(), 2, "{log:?}");
    let first_end = log
        .iter()
        .position(|l| l.starts_with("end "))
        .expect("no process ended");
    let started_before = log[..first_end]
        .iter()
        .filter(|l| l.starts_with("start "))
        .count();
    assert_eq!(
        started_before, 2,
        "one process ended before the other started: they never overlapped"
    );
    let sections: Vec<&String> = log
        .iter()
        .filter(|l| l.starts_with("enter ") || l.starts_with("leave "))
        .collect();
    assert_eq!(sections.len(), 2 * 2 * sections_each);
    for pair in sections.chunks(2) {
        let (enter, leave) = (pair[0], pair[1]);
        assert!(enter.starts_with("enter "), "overlap: {pair:?}");
        assert_eq!(
            leave.strip_prefix("leave "),
            enter.strip_prefix("enter "),
            "overlap"
        );
    }
    let switches = sections
        .chunks(2)
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0][0] != w[1][0])
        .count();
    eprintln!("the lock went from one process to the other {switches} times");
}
