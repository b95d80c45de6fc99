//! Lock keys: validated, cheaply cloned names of the entity a lock protects.

use std::borrow::{Borrow, Cow};
use std::fmt;
use std::sync::Arc;

/// The longest key accepted, in bytes of UTF-8, namespace included.
///
/// ```
/// use tower_lock::{LockKey, MAX_KEY_LEN};
///
/// assert!(LockKey::new(&"k".repeat(MAX_KEY_LEN)).is_ok());
/// assert!(LockKey::new(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
/// ```
///
/// Chosen so that every backend can store the key as it is: a ZooKeeper node
/// name is limited by the server's path length, and a Redis key this short
/// costs nothing extra to hash.
pub const MAX_KEY_LEN: usize = 256;

/// The name of the entity a lock protects, such as `orders:sku-42`.
///
/// A key is any UTF-8 text of 1 to [`MAX_KEY_LEN`] bytes (namespace
/// included) that
///
/// - contains no control character (NUL included) and no `/`, and is not `.`
///   or `..`, so that every backend can use it directly in a node name, a
///   Redis key or a log line without escaping surprises;
/// - is not blank: not only whitespace or invisible characters (`"   "`,
///   `"\u{200B}"`), and neither starts nor ends with them, since `"A1 "` and
///   `"A1"` would lock different entities;
/// - contains no invisible formatting character that makes two keys look
///   alike: zero-width space, word joiner, byte-order mark, soft hyphen,
///   bidirectional controls. (Zero-width joiners and variation selectors,
///   which scripts and emoji need, are allowed inside a key.)
///
/// Everything else is accepted: any script, spaces inside, punctuation,
/// `a..b`, `%`. A key of up to 23 bytes (most: `sku:42`,
/// `orders:7f3a9c`) is kept in place, without a heap allocation; a longer
/// one is shared, and cloning it is a reference-count increment.
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
#[derive(Clone)]
pub struct LockKey(Repr);

/// The longest key kept in place: with its length byte, 24 bytes. Every
/// request makes a key; most fit.
const INLINE: usize = 23;

#[derive(Clone)]
enum Repr {
    /// Its text is `bytes[..len]`.
    Inline {
        len: u8,
        bytes: [u8; INLINE],
    },
    Shared(Arc<str>),
}

impl Repr {
    /// `key`'s text, in place if it fits.
    fn of(key: &str) -> Self {
        if key.len() > INLINE {
            return Repr::Shared(Arc::from(key));
        }
        let mut bytes = [0; INLINE];
        bytes[..key.len()].copy_from_slice(key.as_bytes());
        Repr::Inline {
            len: key.len() as u8,
            bytes,
        }
    }

    fn as_str(&self) -> &str {
        match self {
            Repr::Inline { len, bytes } => inline_str(&bytes[..usize::from(*len)]),
            Repr::Shared(text) => text,
        }
    }
}

/// A key's text before validation, kept as a [`LockKey`]'s is (in place up
/// to 23 bytes): how `PathParam` carries a parameter's value out of axum's
/// deserializer without an allocation or a second UTF-8 check.
#[cfg(feature = "axum")]
pub(crate) struct KeyText(Repr);

#[cfg(feature = "axum")]
impl KeyText {
    pub(crate) fn of(text: &str) -> Self {
        KeyText(Repr::of(text))
    }

    pub(crate) fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl LockKey {
    /// Validates `key` and makes a lock key of it.
    ///
    /// # Errors
    ///
    /// [`KeyError`] says which rule the text broke.
    pub fn new(key: &str) -> Result<Self, KeyError> {
        validate(key)?;
        Ok(LockKey(Repr::of(key)))
    }

    /// Makes the key `namespace:key`, validating both parts: each as a key
    /// on its own (so neither may start or end blank), the whole no longer
    /// than [`MAX_KEY_LEN`]. The namespace is held to the rules
    /// [`LockLayer::namespace`](crate::LockLayer::namespace) applies.
    ///
    /// An empty namespace yields `key` alone.
    ///
    /// # Errors
    ///
    /// [`KeyError`] if `key` is empty, or either part or the whole breaks a
    /// rule.
    pub fn namespaced(namespace: &str, key: &str) -> Result<Self, KeyError> {
        if namespace.is_empty() {
            return Self::new(key);
        }
        // An empty key under a namespace would still be a valid-looking
        // `ns:`; it is a missing key, so say so.
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        let prefix = namespace.len() + 1;
        let len = prefix + key.len();
        if len > MAX_KEY_LEN {
            return Err(KeyError::TooLong {
                len,
                namespace: prefix,
            });
        }
        // A layer's namespace was checked when it was set; this costs its
        // requests a pass over a few bytes, and keeps a caller of this
        // function (or of a `KeySource`) from making a key no backend
        // should see. After the length: a too long whole is reported as
        // such, with its length.
        check_namespace(namespace)?;
        validate(key)?;
        // Joined on the stack, so that the key costs no allocation (kept in
        // place) or one (shared), not two: this runs for every request.
        let mut joined = [0u8; MAX_KEY_LEN];
        joined[..namespace.len()].copy_from_slice(namespace.as_bytes());
        joined[namespace.len()] = b':';
        joined[prefix..len].copy_from_slice(key.as_bytes());
        let joined = std::str::from_utf8(&joined[..len]).expect("two strs and a ':'");
        Ok(LockKey(Repr::of(joined)))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// Whether both share one allocation (and so are equal); false for
    /// keys kept in place, which compare cheaply.
    pub(crate) fn ptr_eq(&self, other: &LockKey) -> bool {
        match (&self.0, &other.0) {
            (Repr::Shared(a), Repr::Shared(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// The text of a key kept in place.
#[allow(unsafe_code)]
fn inline_str(bytes: &[u8]) -> &str {
    debug_assert!(std::str::from_utf8(bytes).is_ok());
    // SAFETY: `Repr::of` copied these bytes from a `&str`, whole (its
    // length is the `str`'s), so they are valid UTF-8; nothing writes them
    // after. Checking again on every read would cost each hash and compare.
    unsafe { std::str::from_utf8_unchecked(bytes) }
}

impl PartialEq for LockKey {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            // Both in place: the unused bytes are zero (`Repr::of`), so the
            // arrays compare whole, in a few word compares, not a `memcmp`
            // call (the memory backend compares keys on every lock).
            (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                a == b && x == y
            }
            _ => self.ptr_eq(other) || self.as_str() == other.as_str(),
        }
    }
}

impl Eq for LockKey {}

// As `str`'s, which `Borrow<str>` needs.
impl std::hash::Hash for LockKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl PartialOrd for LockKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for LockKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
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
            namespace: namespace.len() + 1,
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

/// Whether every byte is printable ASCII (`' '..='~'`) other than `/`.
///
/// A key of 4 to 31 bytes (most) is read a word at a time, the last word
/// overlapping the one before (under 8 bytes, two overlapping halves make
/// one word): a few instructions a word where a loop spends a few a byte.
/// Others take that loop, which the compiler vectorises (a fold: `all`
/// would stop early, one byte at a time).
fn printable(bytes: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    // Exact tests of "some byte is ...", from the bit-twiddling classics:
    // below `n` (for `n` up to 128), above `n` (up to 127), zero.
    let word_ok = |w: u64| {
        let below_space = w.wrapping_sub(ONES * 0x20) & !w;
        let above_tilde = w.wrapping_add(ONES) | w; // `ONES * (127 - b'~')`
        let v = w ^ (ONES * u64::from(b'/'));
        let slash = v.wrapping_sub(ONES) & !v;
        (below_space | above_tilde | slash) & HIGH == 0
    };
    let word = |at: usize| u64::from_ne_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let half = |at: usize| u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    match bytes.len() {
        // Two halves, overlapping, in one word.
        4..8 => word_ok(u64::from(half(0)) | u64::from(half(bytes.len() - 4)) << 32),
        8..32 => {
            let last = bytes.len() - 8;
            (0..last).step_by(8).all(|at| word_ok(word(at))) && word_ok(word(last))
        }
        _ => bytes
            .iter()
            .fold(true, |ok, &b| ok & matches!(b, b' '..=b'~') & (b != b'/')),
    }
}

/// Checks a key, or the part of one after its namespace (whose length the
/// caller checks).
fn validate(own: &str) -> Result<(), KeyError> {
    if own.is_empty() {
        return Err(KeyError::Empty);
    }
    if own.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            len: own.len(),
            namespace: 0,
        });
    }
    if own == "." || own == ".." {
        return Err(KeyError::DotSegment);
    }
    let bytes = own.as_bytes();
    // The common case, on the hot path of every request: printable ASCII
    // with no `/`. Only a blank (all spaces, or spaces at an edge) is left
    // to refuse.
    if printable(bytes) {
        if bytes[0] == b' ' || bytes[bytes.len() - 1] == b' ' {
            let all = bytes.iter().all(|&b| b == b' ');
            return Err(if all {
                KeyError::Blank
            } else {
                KeyError::EdgeBlank
            });
        }
        return Ok(());
    }
    // One pass over the bytes. The control characters (`char::is_control`:
    // U+0000..=U+001F, U+007F..=U+009F) are the bytes 0x00..=0x1F and 0x7F,
    // and 0xC2 followed by 0x80..=0x9F.
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'/' => return Err(KeyError::ForbiddenChar('/')),
            0x00..=0x1F | 0x7F => return Err(KeyError::ForbiddenChar(char::from(b))),
            0xC2 if matches!(bytes.get(i + 1), Some(0x80..=0x9F)) => {
                let c = own[i..].chars().next().expect("valid UTF-8");
                return Err(KeyError::ForbiddenChar(c));
            }
            _ => {}
        }
    }
    if let Some(c) = own.chars().find(|&c| misleading(c)) {
        return Err(KeyError::Invisible(c));
    }
    if own.chars().all(blank) {
        return Err(KeyError::Blank);
    }
    let first = own.chars().next().expect("not empty");
    let last = own.chars().next_back().expect("not empty");
    if edge_blank(first) || edge_blank(last) {
        return Err(KeyError::EdgeBlank);
    }
    Ok(())
}

/// Invisible formatting characters that make two different keys look the
/// same, refused anywhere in a key.
fn misleading(c: char) -> bool {
    matches!(
        c,
        '\u{ad}'                       // soft hyphen
            | '\u{61c}'                // Arabic letter mark
            | '\u{180e}'               // Mongolian vowel separator
            | '\u{200b}'               // zero-width space
            | '\u{200e}'..='\u{200f}'  // left-to-right, right-to-left marks
            | '\u{202a}'..='\u{202e}'  // bidirectional embeddings, overrides
            | '\u{2060}'..='\u{206f}'  // word joiner, invisible operators, isolates
            | '\u{feff}'               // zero-width no-break space (BOM)
    )
}

/// Characters that show as space or as nothing, which a key can neither
/// start nor end with.
fn edge_blank(c: char) -> bool {
    c.is_whitespace()
        || misleading(c)
        || matches!(
            c,
            '\u{34f}'                   // combining grapheme joiner
                | '\u{115f}'..='\u{1160}' // Hangul fillers
                | '\u{17b4}'..='\u{17b5}' // Khmer inherent vowels
                | '\u{200c}'..='\u{200d}' // zero-width (non-)joiner
                | '\u{2800}'               // Braille blank
                | '\u{3164}'               // Hangul filler
                | '\u{ffa0}'               // halfwidth Hangul filler
        )
}

/// Characters that show as nothing: a key made only of them (and
/// whitespace) is blank. Variation selectors and tags may end a key (they
/// end emoji sequences), so they are not [`edge_blank`].
fn blank(c: char) -> bool {
    edge_blank(c)
        || matches!(
            c,
            '\u{180b}'..='\u{180d}'       // Mongolian variation selectors
                | '\u{fe00}'..='\u{fe0f}' // variation selectors
                | '\u{e0000}'..='\u{e007f}' // tags
                | '\u{e0100}'..='\u{e01ef}' // variation selectors supplement
        )
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for LockKey {
    fn borrow(&self) -> &str {
        self.as_str()
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
        Ok(LockKey(match key.len() > INLINE {
            true => Repr::Shared(Arc::from(key)),
            false => Repr::of(&key),
        }))
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

/// Why a text is not a valid [`LockKey`], or why a request carries none.
///
/// # Examples
///
/// ```
/// use tower_lock::{KeyError, LockKey};
///
/// assert_eq!(LockKey::new("   "), Err(KeyError::Blank));
/// let e = LockKey::namespaced("sku", &"x".repeat(300)).unwrap_err();
/// assert_eq!(
///     e.to_string(),
///     "key is 304 bytes long counting the 4-byte namespace prefix the server adds, the maximum is 256"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    TooLong {
        /// Its length in bytes, namespace included.
        len: usize,
        /// How many of them are the namespace and its `:` (0 without one).
        namespace: usize,
    },
    /// The key contains a control character or `/`.
    ForbiddenChar(char),
    /// The key is `.` or `..`.
    DotSegment,
    /// The key is only whitespace or invisible characters.
    Blank,
    /// The key starts or ends with whitespace or an invisible character.
    EdgeBlank,
    /// The key contains an invisible formatting character (zero-width
    /// space, bidirectional control, …) that makes it look like another key.
    Invisible(char),
    /// The source (a header) held bytes that are not UTF-8.
    NotUtf8,
    /// The request gives the key more than once, with different values (a
    /// header or query parameter repeated): which one to lock is ambiguous.
    Repeated {
        /// How many times it is given.
        count: usize,
    },
    /// A [`KeyFn`](crate::KeyFn) found no key, and says why. Handled as a
    /// missing key: 400, or no lock with
    /// [`OnMissingKey::PassThrough`](crate::OnMissingKey::PassThrough).
    Missing(Cow<'static, str>),
    /// A [`KeyFn`](crate::KeyFn) refused the request's key, and says why.
    Refused(Cow<'static, str>),
    /// The key source cannot work where it was installed (a server
    /// configuration error, not the client's).
    Misconfigured(&'static str),
}

impl KeyError {
    /// A key function's "no key here", with the reason shown to the client.
    pub fn missing(why: impl Into<Cow<'static, str>>) -> Self {
        KeyError::Missing(why.into())
    }

    /// A key function's "this key is unusable", with the reason shown to the
    /// client.
    pub fn refused(why: impl Into<Cow<'static, str>>) -> Self {
        KeyError::Refused(why.into())
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("key is empty"),
            KeyError::TooLong { len, namespace: 0 } => {
                write!(f, "key is {len} bytes long, the maximum is {MAX_KEY_LEN}")
            }
            KeyError::TooLong { len, namespace } => write!(
                f,
                "key is {len} bytes long counting the {namespace}-byte namespace prefix \
                 the server adds, the maximum is {MAX_KEY_LEN}"
            ),
            KeyError::ForbiddenChar(c) => {
                write!(f, "key contains the forbidden character {:?}", c)
            }
            KeyError::DotSegment => f.write_str("key is `.` or `..`"),
            KeyError::Blank => f.write_str("key is blank (only whitespace or invisible characters)"),
            KeyError::EdgeBlank => {
                f.write_str("key starts or ends with whitespace or an invisible character")
            }
            KeyError::Invisible(c) => write!(
                f,
                "key contains the invisible character U+{:04X}, which makes it look like another key",
                u32::from(*c)
            ),
            KeyError::NotUtf8 => f.write_str("key is not valid UTF-8"),
            KeyError::Repeated { count } => write!(
                f,
                "the request gives the key {count} times with different values; give it once"
            ),
            KeyError::Missing(why) => write!(f, "no key: {why}"),
            KeyError::Refused(why) => f.write_str(why),
            KeyError::Misconfigured(why) => write!(f, "key source misconfigured: {why}"),
        }
    }
}

impl std::error::Error for KeyError {}

#[cfg(test)]
mod tests;
