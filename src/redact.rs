//! Keeping secrets in the process: the userinfo of every URL in a message
//! (`redis://:password@host`, `postgres://user:password@host/db`) becomes
//! `***` before the message reaches an error's text, a `Debug` output, a
//! log or a response.

use std::borrow::Cow;

/// Where an authority ends (a path, query, fragment, the end of a quoted
/// or spaced word); `,` ends one host of a list and starts the next.
fn ends_authority(c: char) -> bool {
    matches!(
        c,
        '/' | '?' | '#' | '"' | '\'' | '`' | '(' | ')' | '[' | ']' | '<' | '>' | ',' | ';'
    ) || c.is_whitespace()
}

/// `text` with the userinfo of every URL in it (of each host, in a list of
/// hosts as Redlock takes) replaced by `***`.
///
/// ```text
/// redis://:s3cret@db:6379/0            → redis://***@db:6379/0
/// redlock://:a@h1:1,:b@h2:2,h3:3       → redlock://***@h1:1,***@h2:2,h3:3
/// ```
pub(crate) fn redact(text: &str) -> Cow<'_, str> {
    if !text.contains('@') || !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        rest = after;
        // Each host of the authority, up to where it ends.
        loop {
            let end = rest.find(ends_authority).unwrap_or(rest.len());
            let host = &rest[..end];
            match host.rfind('@') {
                Some(userinfo_end) => {
                    out.push_str("***");
                    out.push_str(&host[userinfo_end..]);
                }
                None => out.push_str(host),
            }
            rest = &rest[end..];
            if rest.starts_with(',') {
                out.push(',');
                rest = &rest[1..];
            } else {
                break;
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn userinfo_is_hidden_and_the_rest_kept() {
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
                "redlock://***@h1:1,***@h2:2,h3:3 down",
            ),
            // A password with an unencoded `@`: all of it goes.
            ("redis://:p@ss@h:1", "redis://***@h:1"),
            (
                "no URL here, mail@example.org",
                "no URL here, mail@example.org",
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
