//! `zk://` URLs, the root path, and key names as node names.

use crate::error::LockError;
use crate::key::LockKey;

/// `zk://host:port[,host:port...][/root]` into hosts and root.
pub(super) fn parse_url(url: &str) -> Result<(String, Option<String>), LockError> {
    let rest = url.strip_prefix("zk://").ok_or_else(|| {
        LockError::Config(format!(
            "a ZooKeeper URL looks like zk://host:port[,host:port...][/root], not {url:?}"
        ))
    })?;
    let (hosts, root) = match rest.find('/') {
        Some(i) => (&rest[..i], Some(&rest[i..])),
        None => (rest, None),
    };
    if hosts.contains('@') {
        // The URL is shown redacted (`zk://***@host`): the hosts alone
        // would show the password.
        return Err(LockError::Config(format!(
            "a ZooKeeper URL takes no user or password: {url:?}"
        )));
    }
    if hosts.is_empty() || hosts.split(',').any(|h| !h.contains(':')) {
        return Err(LockError::Config(format!(
            "a ZooKeeper URL names each server as host:port: {url:?}"
        )));
    }
    let root = root.filter(|r| *r != "/").map(str::to_owned);
    Ok((hosts.to_owned(), root))
}

pub(super) fn check_root(root: &str) -> Result<(), LockError> {
    let bad = |why: &str| Err(LockError::Config(format!("ZooKeeper root {root:?} {why}")));
    if !root.starts_with('/') || root.len() < 2 {
        return bad("must be an absolute path below `/`");
    }
    if root.ends_with('/') {
        return bad("must not end with `/`");
    }
    for segment in root[1..].split('/') {
        if segment.is_empty() || segment == "." || segment == ".." {
            return bad("has an empty, `.` or `..` segment");
        }
        if segment.chars().any(forbidden_in_name) {
            return bad("holds a character ZooKeeper refuses in node names");
        }
    }
    if root == "/zookeeper" || root.starts_with("/zookeeper/") {
        return bad("is inside ZooKeeper's reserved `/zookeeper`");
    }
    Ok(())
}

/// Characters ZooKeeper refuses in a node name (its `PathUtils`), beyond `/`.
fn forbidden_in_name(c: char) -> bool {
    matches!(c, '\0'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}')
}

/// The node name of a key: the key, with `%` and refused characters
/// percent-encoded. See the [module documentation](super#key-encoding).
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), tower_lock::KeyError> {
/// use tower_lock::backend::zookeeper::node_name;
/// use tower_lock::LockKey;
///
/// assert_eq!(node_name(&LockKey::new("order:42")?), "order:42");
/// assert_eq!(node_name(&LockKey::new("50%")?), "50%25");
/// # Ok(()) }
/// ```
pub fn node_name(key: &LockKey) -> std::borrow::Cow<'_, str> {
    let key = key.as_str();
    if !key.chars().any(|c| c == '%' || forbidden_in_name(c)) {
        return std::borrow::Cow::Borrowed(key);
    }
    let mut out = String::with_capacity(key.len() + 8);
    let mut utf8 = [0u8; 4];
    for c in key.chars() {
        if c == '%' || forbidden_in_name(c) {
            for b in c.encode_utf8(&mut utf8).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::LockKey;

    #[test]
    fn node_names_encode_only_what_zookeeper_refuses() {
        let plain = LockKey::new("order:42 ä.x").unwrap();
        assert_eq!(node_name(&plain), "order:42 ä.x");
        let odd = LockKey::new("50%\u{e000}\u{fff0}").unwrap();
        assert_eq!(node_name(&odd), "50%25%EE%80%80%EF%BF%B0");
        // One-to-one: the literal text of an encoding stays distinct.
        let literal = LockKey::new("50%25").unwrap();
        assert_eq!(node_name(&literal), "50%2525");
    }

    #[test]
    fn urls_and_roots_are_checked() {
        assert_eq!(
            parse_url("zk://a:1,b:2/locks").unwrap(),
            ("a:1,b:2".to_owned(), Some("/locks".to_owned()))
        );
        assert_eq!(parse_url("zk://a:1/").unwrap(), ("a:1".to_owned(), None));
        assert!(parse_url("zk://a/x").is_err());
        assert!(parse_url("redis://a:1").is_err());
        assert!(check_root("/tower-lock").is_ok());
        assert!(check_root("/a/b").is_ok());
        for bad in [
            "/",
            "a",
            "/a/",
            "/a//b",
            "/a/../b",
            "/zookeeper/x",
            "/a\u{1}",
        ] {
            assert!(check_root(bad).is_err(), "{bad:?}");
        }
    }
}
