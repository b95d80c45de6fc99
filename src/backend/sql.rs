//! What the database backends share.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use crate::backend::engine::lease::{drift, known_until};
use crate::error::LockError;
use crate::lost::Deadline;
use crate::token::FencingToken;

/// How long a database connection, and every lock that lives with it, is
/// known alive; and the server's uptime it learnt when it connected.
pub(crate) struct Alive {
    /// Until when the server surely keeps the connection: the send time of
    /// the last request it answered, plus the lease, less drift. Its locks'
    /// leases share it.
    pub(crate) until: Arc<Deadline>,
    lease: Duration,
    /// The server's uptime, and when it was learnt. A restart ends every
    /// connection, so a connection's server has not restarted since.
    uptime: Duration,
    learnt: Instant,
}

impl Alive {
    /// A connection whose first request was sent at `sent`, and that
    /// learnt the server's `uptime` at `learnt`.
    pub(crate) fn new(sent: Instant, lease: Duration, uptime: Duration, learnt: Instant) -> Self {
        Alive {
            until: Arc::new(Deadline::new(known_until(sent, lease))),
            lease,
            uptime,
            learnt,
        }
    }

    /// One request answered, sent at `sent`.
    pub(crate) fn answered(&self, sent: Instant) {
        self.until.extend(known_until(sent, self.lease));
    }

    /// Whether a grant answering a request sent at `sent` (after a long
    /// wait) leaves less than half a lease known ahead: then one more round
    /// trip should make the connection known alive from now.
    pub(crate) fn stale_after(&self, sent: Instant) -> bool {
        known_until(sent, self.lease) < Instant::now() + self.lease / 2
    }

    /// Waits until the server has been up longer than a lease (plus
    /// drift). A restart frees every lock at once, while the holders that
    /// have not heard of it count on theirs until their lease is up; no
    /// lock is granted before then.
    pub(crate) async fn quarantine(&self) {
        let safe = self.lease + drift(self.lease);
        if let Some(left) = safe.checked_sub(self.uptime + self.learnt.elapsed()) {
            tokio::time::sleep(left).await;
        }
    }
}

/// How many connections a database backend has open, within its limit.
pub(crate) struct Connections {
    open: Arc<AtomicUsize>,
    max: usize,
    /// Told when a connection closes or goes back idle: room for one
    /// waiting for a connection ([`Connections::room`]).
    freed: Arc<Notify>,
}

impl Connections {
    pub(crate) fn new(max: usize) -> Self {
        Connections {
            open: Arc::default(),
            max,
            freed: Arc::default(),
        }
    }

    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn at_limit(&self) -> bool {
        self.open() >= self.max
    }

    /// A place for one more connection, or an error saying the limit is
    /// reached (`option` names the setting that raises it).
    pub(crate) fn take(
        &self,
        backend: &'static str,
        option: &str,
        target: &str,
    ) -> Result<Slot, LockError> {
        // Counted only when under the limit: a refusal frees no room, and
        // so wakes no one.
        let taken = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max).then_some(open + 1)
            });
        match taken {
            Ok(_) => Ok(Slot {
                open: self.open.clone(),
                freed: self.freed.clone(),
            }),
            Err(_) => Err(LockError::backend(
                backend,
                format!(
                    "all {} connections to {target} stayed taken by held or waiting locks; \
                     raise {option} (and the server's max_connections)",
                    self.max
                ),
                None,
            )),
        }
    }

    /// Resolves once a connection has closed or gone back idle after this
    /// call ([`Connections::freed`]); enable it before looking for room,
    /// so that a release in between is not missed.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn room(&self) -> Notified<'_> {
        self.freed.notified()
    }

    /// Wakes every acquisition waiting for a connection: one went back
    /// idle.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn freed(&self) {
        self.freed.notify_waiters();
    }
}

/// One connection's place in the count, given back when dropped.
pub(crate) struct Slot {
    open: Arc<AtomicUsize>,
    freed: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        self.freed.notify_waiters();
    }
}

/// The token of a grant (or floor) that drew `value` from a store's token
/// sequence, `spacing` tokens apart: the tokens between two values serve
/// the holders a cohort passes the grant to.
pub(crate) fn spaced_token(value: i64, spacing: u32) -> FencingToken {
    FencingToken::new((value.max(0) as u64).saturating_mul(u64::from(spacing)))
}

/// Checks a table or sequence name given in the options, which goes into
/// SQL as it is: `name` or `schema.name`, in lower-case letters, digits and
/// `_`.
pub(crate) fn check_name(name: &str, option: &str) -> Result<(), LockError> {
    let plain = |part: &str| {
        !part.is_empty()
            && !part.starts_with(|c: char| c.is_ascii_digit())
            && part
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() > 2 || !parts.iter().all(|p| plain(p)) {
        return Err(LockError::Config(format!(
            "{option} {name:?}: expected name or schema.name, in lower-case letters, digits and _"
        )));
    }
    Ok(())
}

/// `url` without its query parameter `name` (which the driver does not
/// know), and the parameter's value: `Some("")` for a bare `name`.
pub(crate) fn take_param(url: &str, name: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), None);
    };
    let mut value = None;
    let mut rest = Vec::new();
    for param in query.split('&').filter(|p| !p.is_empty()) {
        match param.split_once('=') {
            Some((n, v)) if n == name => value = Some(v.to_owned()),
            None if param == name => value = Some(String::new()),
            _ => rest.push(param),
        }
    }
    let url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    (url, value)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_parameter_is_taken_out_of_the_url() {
        use super::take_param;
        assert_eq!(
            take_param("pg://h/db?a=1&sequence=s.t&b", "sequence"),
            ("pg://h/db?a=1&b".to_owned(), Some("s.t".to_owned()))
        );
        assert_eq!(
            take_param("pg://h/db?lease_table", "lease_table"),
            ("pg://h/db".to_owned(), Some(String::new()))
        );
        assert_eq!(take_param("pg://h/db", "x"), ("pg://h/db".to_owned(), None));
    }

    #[test]
    fn only_plain_names_go_into_sql() {
        for good in ["tower_lock_tokens", "locks.tokens", "t2"] {
            assert!(super::check_name(good, "x").is_ok(), "{good}");
        }
        for bad in [
            "",
            "Tokens",
            "a.b.c",
            "x; DROP TABLE t",
            "9lives",
            "a-b",
            "a.",
        ] {
            assert!(super::check_name(bad, "x").is_err(), "{bad}");
        }
    }
}
