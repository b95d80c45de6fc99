//! What the database backends share.

use crate::error::LockError;

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
