//! Lock keys: validated, cheaply cloned names of the entity a lock protects.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

/// The longest key accepted, in bytes of UTF-8, namespace included.
///
/// Chosen so that every backend can store the key as it is: a ZooKeeper node
/// name is limited by the server's path length, and a Redis key this short
/// costs nothing extra to hash.
pub const MAX_KEY_LEN: usize = 256;

/// The name of the entity a lock protects, such as `orders:sku-42`.
///
/// A key is any UTF-8 text of 1 to [`MAX_KEY_LEN`] bytes that contains no
/// control character (NUL included), no `/` and no `..`, and is not `.`.
/// Those rules let every backend use the key directly in a node name, a Redis
/// key or a log line without escaping surprises. Cloning is a reference-count
/// increment.
///
/// # Examples
///
/// ```
/// use tower_lock::LockKey;
///
/// let key = LockKey::new("sku-42").unwrap();
/// assert_eq!(key.as_str(), "sku-42");
/// assert!(LockKey::new("a/b").is_err());
/// assert_eq!(LockKey::namespaced("orders", "sku-42").unwrap().as_str(), "orders:sku-42");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(Arc<str>);

impl LockKey {
    /// Validates `key` and makes a lock key of it.
    ///
    /// # Errors
    ///
    /// [`KeyError`] says which rule the text broke.
    pub fn new(key: &str) -> Result<Self, KeyError> {
        validate(key)?;
        Ok(LockKey(Arc::from(key)))
    }

    /// Makes the key `namespace:key`, validating the whole.
    ///
    /// An empty namespace yields `key` alone.
    ///
    /// # Errors
    ///
    /// [`KeyError`] if `key` is empty or the whole breaks a rule.
    pub fn namespaced(namespace: &str, key: &str) -> Result<Self, KeyError> {
        if namespace.is_empty() {
            return Self::new(key);
        }
        // An empty key under a namespace would still be a valid-looking
        // `ns:`; it is a missing key, so say so.
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        let mut joined = String::with_capacity(namespace.len() + 1 + key.len());
        joined.push_str(namespace);
        joined.push(':');
        joined.push_str(key);
        validate(&joined)?;
        Ok(LockKey(Arc::from(joined)))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether both are the same allocation (and so equal).
    pub(crate) fn ptr_eq(&self, other: &LockKey) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Checks a namespace: empty, or valid as a key itself with room left for
/// `:` and a one-byte key.
pub(crate) fn check_namespace(namespace: &str) -> Result<(), KeyError> {
    if namespace.is_empty() {
        return Ok(());
    }
    validate(namespace)?;
    if namespace.len() + 2 > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            len: namespace.len() + 2,
        });
    }
    Ok(())
}

/// Panics with a clear message on an invalid namespace: it is fixed when
/// the service is built, so the mistake shows at start-up, not as a 400 on
/// every request.
pub(crate) fn assert_namespace(namespace: &str) {
    if let Err(e) = check_namespace(namespace) {
        panic!("invalid lock namespace {namespace:?}: {e}");
    }
}

fn validate(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: key.len() });
    }
    if key == "." {
        return Err(KeyError::DotSegment);
    }
    // One pass over the bytes, on the hot path of every request. The control
    // characters (`char::is_control`: U+0000..=U+001F, U+007F..=U+009F) are
    // the bytes 0x00..=0x1F and 0x7F, and 0xC2 followed by 0x80..=0x9F.
    let bytes = key.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'/' => return Err(KeyError::ForbiddenChar('/')),
            b'.' if bytes.get(i + 1) == Some(&b'.') => return Err(KeyError::DotSegment),
            0x00..=0x1F | 0x7F => return Err(KeyError::ForbiddenChar(char::from(b))),
            0xC2 if matches!(bytes.get(i + 1), Some(0x80..=0x9F)) => {
                let c = key[i..].chars().next().expect("valid UTF-8");
                return Err(KeyError::ForbiddenChar(c));
            }
            _ => {}
        }
    }
    Ok(())
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for LockKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for LockKey {
    type Error = KeyError;
    fn try_from(key: &str) -> Result<Self, KeyError> {
        LockKey::new(key)
    }
}

impl TryFrom<String> for LockKey {
    type Error = KeyError;
    fn try_from(key: String) -> Result<Self, KeyError> {
        validate(&key)?;
        Ok(LockKey(Arc::from(key)))
    }
}

impl TryFrom<&String> for LockKey {
    type Error = KeyError;
    fn try_from(key: &String) -> Result<Self, KeyError> {
        LockKey::new(key)
    }
}

impl From<&LockKey> for LockKey {
    fn from(key: &LockKey) -> Self {
        key.clone()
    }
}

/// Why a text is not a valid [`LockKey`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key contains a control character or `/`.
    ForbiddenChar(char),
    /// The key is `.` or contains `..`.
    DotSegment,
    /// The source (a header) held bytes that are not UTF-8.
    NotUtf8,
    /// The key source cannot work where it was installed (a server
    /// configuration error, not the client's).
    Misconfigured(&'static str),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("key is empty"),
            KeyError::TooLong { len } => {
                write!(f, "key is {len} bytes long, the maximum is {MAX_KEY_LEN}")
            }
            KeyError::ForbiddenChar(c) => {
                write!(f, "key contains the forbidden character {:?}", c)
            }
            KeyError::DotSegment => f.write_str("key is `.` or contains `..`"),
            KeyError::NotUtf8 => f.write_str("key is not valid UTF-8"),
            KeyError::Misconfigured(why) => write!(f, "key source misconfigured: {why}"),
        }
    }
}

impl std::error::Error for KeyError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_unicode_and_punctuation() {
        for ok in ["a", "订单-42", "acct:1", "a.b", "x y", "ключ", "🔒"] {
            assert_eq!(LockKey::new(ok).unwrap().as_str(), ok);
        }
        let max = "é".repeat(MAX_KEY_LEN / 2);
        assert!(LockKey::new(&max).is_ok());
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(LockKey::new(""), Err(KeyError::Empty));
        assert_eq!(
            LockKey::new(&"a".repeat(MAX_KEY_LEN + 1)),
            Err(KeyError::TooLong {
                len: MAX_KEY_LEN + 1
            })
        );
        assert_eq!(LockKey::new("a/b"), Err(KeyError::ForbiddenChar('/')));
        assert_eq!(LockKey::new("a\0b"), Err(KeyError::ForbiddenChar('\0')));
        assert_eq!(LockKey::new("a\nb"), Err(KeyError::ForbiddenChar('\n')));
        assert_eq!(
            LockKey::new("\u{7f}"),
            Err(KeyError::ForbiddenChar('\u{7f}'))
        );
        assert_eq!(LockKey::new("."), Err(KeyError::DotSegment));
        assert_eq!(LockKey::new(".."), Err(KeyError::DotSegment));
        assert_eq!(LockKey::new("a..b"), Err(KeyError::DotSegment));
        assert_eq!(
            LockKey::new("a\u{85}b"),
            Err(KeyError::ForbiddenChar('\u{85}'))
        );
        assert_eq!(
            LockKey::new("\u{9f}"),
            Err(KeyError::ForbiddenChar('\u{9f}'))
        );
        assert!(
            LockKey::new("\u{a0}\u{c2}").is_ok(),
            "U+00A0 and Â are not controls"
        );
    }

    #[test]
    fn byte_scan_agrees_with_char_rules() {
        // Every code point up to U+0800 (all one- and two-byte forms), alone
        // and between letters.
        for cp in 0u32..0x800 {
            let Some(c) = char::from_u32(cp) else {
                continue;
            };
            for text in [c.to_string(), format!("a{c}b")] {
                let by_chars = if text == "." || text.contains("..") {
                    Err(KeyError::DotSegment)
                } else if let Some(bad) = text.chars().find(|c| c.is_control() || *c == '/') {
                    Err(KeyError::ForbiddenChar(bad))
                } else {
                    Ok(())
                };
                assert_eq!(validate(&text), by_chars, "{text:?}");
            }
        }
    }

    #[test]
    fn namespaces_are_checked() {
        assert!(check_namespace("").is_ok());
        assert!(check_namespace("orders").is_ok());
        assert!(check_namespace("a/b").is_err());
        assert!(check_namespace(&"n".repeat(MAX_KEY_LEN - 1)).is_err());
        let bad = std::panic::catch_unwind(|| assert_namespace("a..b"));
        assert!(bad.is_err());
    }

    #[test]
    fn namespace_joins_and_counts_towards_length() {
        assert_eq!(LockKey::namespaced("ns", "k").unwrap().as_str(), "ns:k");
        assert_eq!(LockKey::namespaced("", "k").unwrap().as_str(), "k");
        assert_eq!(LockKey::namespaced("ns", ""), Err(KeyError::Empty));
        let k = "a".repeat(MAX_KEY_LEN - 2);
        assert!(matches!(
            LockKey::namespaced("ns", &k),
            Err(KeyError::TooLong { .. })
        ));
    }
}
