//! What the database backends share.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::LockError;

/// How many connections a database backend has open, within its limit.
pub(crate) struct Connections {
    open: Arc<AtomicUsize>,
    max: usize,
}

impl Connections {
    pub(crate) fn new(max: usize) -> Self {
        Connections {
            open: Arc::default(),
            max,
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
        let open = self.open.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self.open.clone());
        if open >= self.max {
            return Err(LockError::backend(
                backend,
                format!(
                    "all {} connections to {target} are taken by held or waiting locks; \
                     raise {option} (and the server's max_connections)",
                    self.max
                ),
                None,
            ));
        }
        Ok(slot)
    }
}

/// One connection's place in the count, given back when dropped.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
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

#[cfg(test)]
mod tests {
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
