//! The little JSON the crate writes (operator views: [`admin`](crate::admin),
//! [`Inspection::to_json`](crate::backend::Inspection::to_json)), without a
//! serializer dependency.

use std::fmt::Write as _;

/// Appends `s` as a JSON string.
pub(crate) fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Appends `value`, or `null`.
pub(crate) fn number(out: &mut String, value: Option<impl std::fmt::Display>) {
    match value {
        Some(v) => {
            let _ = write!(out, "{v}");
        }
        None => out.push_str("null"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn strings_are_escaped() {
        let mut out = String::new();
        super::string(&mut out, "a\"b\\c\n\u{1}é");
        assert_eq!(out, r#""a\"b\\c\u000a\u0001é""#);
    }
}
