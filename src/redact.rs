//! Keeping secrets in the process: the userinfo of every URL in a message
//! (`redis://:password@host`, `postgres://user:password@host/db`) and any
//! `pass=` or `password=` query value become `***` before the message
//! reaches an error's text, a `Debug` output, a log or a response.

use std::borrow::Cow;

/// Where an authority surely ends: its path, or the end of a spaced or
/// quoted word. Not at `,` `(` `'` `;` `[` and the like, which a password
/// may hold unencoded: up to the last `@` before this point is userinfo
/// (of one host, or of a list of them, as Redlock takes).
fn ends_authority(c: char) -> bool {
    matches!(c, '/' | '"' | '\\') || c.is_whitespace()
}

/// `text` with the userinfo of every URL in it, and every `pass=` or
/// `password=` query value, replaced by `***`.
///
/// ```text
/// redis://:s3cret@db:6379/0            → redis://***@db:6379/0
/// redlock://:a@h1:1,:b@h2:2,h3:3       → redlock://***@h2:2,h3:3
/// redis+unix:///r.sock?pass=s3cret     → redis+unix:///r.sock?pass=***
/// ```
pub(crate) fn redact(text: &str) -> Cow<'_, str> {
    let has_userinfo = text.contains("://") && text.contains('@');
    if !has_userinfo && !text.to_ascii_lowercase().contains("pass") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let end = after.find(ends_authority).unwrap_or(after.len());
        match after[..end].rfind('@') {
            Some(userinfo_end) => {
                out.push_str("***");
                rest = &after[userinfo_end..];
            }
            None => rest = after,
        }
    }
    out.push_str(rest);
    Cow::Owned(hide_passwords(&out))
}

/// `?pass=x` and `&password=x` (any case) with the value as `***`.
fn hide_passwords(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    // The next `pass=` or `password=` from `i`, and its length.
    let next = |i: usize| {
        ["pass=", "password="]
            .iter()
            .filter_map(|name| Some((lower[i..].find(name)? + i, name.len())))
            .min()
    };
    while let Some((hit, len)) = next(i) {
        let value = hit + len;
        out.push_str(&text[i..value]);
        i = value;
        if hit > 0 && matches!(text.as_bytes()[hit - 1], b'?' | b'&' | b';') {
            let end = text[value..]
                .find(|c: char| matches!(c, '&' | '#' | '"' | '\\') || c.is_whitespace())
                .map_or(text.len(), |e| value + e);
            out.push_str("***");
            i = end;
        }
    }
    out.push_str(&text[i..]);
    out
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn userinfo_and_password_parameters_are_hidden_and_the_rest_kept() {
        for (raw, shown) in [
            ("redis://:s3cret@db:6379/0", "redis://***@db:6379/0"),
            (
                "postgres://app:pw@10.0.0.1:5432/test",
                "postgres://***@10.0.0.1:5432/test",
            ),
            (
                "invalid Redis URL \"rediss://u:p%40ss@h:1\": bad",
                "invalid Redis URL \"rediss://***@h:1\": bad",
            ),
            (
                "redlock://:a@h1:1,:b@h2:2,h3:3 down",
                "redlock://***@h2:2,h3:3 down",
            ),
            // Unencoded `@`, `(`, `,`, `'`, `;` and brackets in a password.
            ("redis://:p@ss@h:1", "redis://***@h:1"),
            (
                "connecting to redis://:p(w)0rd@127.0.0.1:1",
                "connecting to redis://***@127.0.0.1:1",
            ),
            ("redis://:ab,cd@h:1", "redis://***@h:1"),
            ("redis://:a'b;c[d]@h:1", "redis://***@h:1"),
            (
                "redlock://:pw@[::1]:1,:pw@[::2]:2 too few",
                "redlock://***@[::2]:2 too few",
            ),
            // A list of whole URLs, as etcd's endpoints.
            (
                "[\"http://a:1\", \"http://u:pw@h:1\"]",
                "[\"http://a:1\", \"http://***@h:1\"]",
            ),
            ("http://a:1,http://u:pw@h:1", "http://a:1,http://***@h:1"),
            (
                "redis+unix:///run/r.sock?db=0&pass=s3cret x",
                "redis+unix:///run/r.sock?db=0&pass=*** x",
            ),
            (
                "unix:///r.sock?PASSWORD=s3cret",
                "unix:///r.sock?PASSWORD=***",
            ),
            (
                "no URL here, mail@example.org, passes",
                "no URL here, mail@example.org, passes",
            ),
            ("redis://h:1/ then x@y", "redis://h:1/ then x@y"),
            (
                "two: mysql://r:x@a/db and etcd://b:y@c",
                "two: mysql://***@a/db and etcd://***@c",
            ),
        ] {
            assert_eq!(redact(raw), shown, "{raw}");
        }
    }
}
