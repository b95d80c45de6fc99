//! The key rules, checked on what each accepts and refuses.

use super::*;

#[test]
fn a_namespace_is_held_to_the_rules_of_a_namespace() {
    let under = |ns: &str| LockKey::namespaced(ns, "k");
    assert_eq!(under("a/b"), Err(KeyError::ForbiddenChar('/')));
    assert_eq!(under("a\nb"), Err(KeyError::ForbiddenChar('\n')));
    assert_eq!(under(" ns"), Err(KeyError::EdgeBlank));
    assert_eq!(under("ns\u{200B}"), Err(KeyError::Invisible('\u{200B}')));
    assert_eq!(under(".."), Err(KeyError::DotSegment));
    // As `LockLayer::namespace` and `Locker::namespace` take them.
    for ns in ["a/b", "a\nb", " ns", "ns\u{200B}", ".."] {
        assert!(check_namespace(ns).is_err(), "{ns:?}");
    }
    assert_eq!(under("orders").unwrap().as_str(), "orders:k");
    // Too long, whatever else: the whole's length, namespace included.
    assert_eq!(
        LockKey::namespaced(&"n".repeat(255), "kkk"),
        Err(KeyError::TooLong {
            len: 259,
            namespace: 256
        })
    );
    assert_eq!(
        LockKey::namespaced(&"n/".repeat(150), "k"),
        Err(KeyError::TooLong {
            len: 302,
            namespace: 301
        })
    );
    assert_eq!(under("").unwrap().as_str(), "k");
}

#[test]
fn keys_kept_in_place_are_equal_exactly_when_their_texts_are() {
    let k = |s: &str| LockKey::new(s).unwrap();
    assert_eq!(k("sku-1"), k("sku-1"));
    assert_eq!(
        k("orders:sku-1"),
        LockKey::namespaced("orders", "sku-1").unwrap()
    );
    assert_ne!(k("sku-1"), k("sku-10"), "a prefix");
    assert_ne!(k("sku-1"), k("sku-2"));
    assert_ne!(k("a"), k("b"));
    let longest = "k".repeat(INLINE);
    assert_eq!(k(&longest), k(&longest));
    assert_ne!(
        k(&longest),
        k(&"k".repeat(INLINE + 1)),
        "in place and shared"
    );
    assert_eq!(k(&"k".repeat(INLINE + 1)), k(&"k".repeat(INLINE + 1)));
}

#[test]
fn short_keys_are_kept_in_place_and_long_ones_shared_alike() {
    let short = "k".repeat(INLINE);
    let long = "k".repeat(INLINE + 1);
    let (a, b) = (LockKey::new(&short).unwrap(), LockKey::new(&long).unwrap());
    assert!(matches!(a.0, Repr::Inline { .. }));
    assert!(matches!(b.0, Repr::Shared(_)));
    assert_eq!((a.as_str(), b.as_str()), (short.as_str(), long.as_str()));
    let joined = LockKey::namespaced("ns", "café").unwrap();
    assert!(matches!(joined.0, Repr::Inline { .. }));
    assert_eq!(joined, LockKey::try_from("ns:café".to_owned()).unwrap());
    assert!(a < b && b.clone() == b && b.ptr_eq(&b.clone()));
    let mut map = std::collections::HashMap::new();
    map.insert(a.clone(), 1);
    map.insert(b.clone(), 2);
    // Looked up by text: the hash is the text's.
    assert_eq!(
        (map.get(short.as_str()), map.get(long.as_str())),
        (Some(&1), Some(&2))
    );
    assert_eq!(format!("{a}|{b:?}"), format!("{short}|{long:?}"));
}

#[test]
fn accepts_unicode_and_punctuation() {
    for ok in [
        "a",
        "订单-42",
        "acct:1",
        "a.b",
        "a..b",
        "...x",
        "x y",
        "ключ",
        "🔒",
        "50%",
        "👨\u{200d}👩",
        "❤\u{fe0f}",
        "a\u{a0}b",
    ] {
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
            len: MAX_KEY_LEN + 1,
            namespace: 0,
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
    assert_eq!(
        LockKey::new("a\u{85}b"),
        Err(KeyError::ForbiddenChar('\u{85}'))
    );
    assert_eq!(
        LockKey::new("\u{9f}"),
        Err(KeyError::ForbiddenChar('\u{9f}'))
    );
}

#[test]
fn rejects_blank_and_invisible_keys() {
    for blank in [
        "   ",
        " ",
        "\u{200b}",
        "\u{3000}\u{a0}",
        "\u{feff}",
        "\u{200d}\u{fe0f}",
    ] {
        assert!(
            matches!(
                LockKey::new(blank),
                Err(KeyError::Blank | KeyError::Invisible(_))
            ),
            "{blank:?}"
        );
    }
    assert_eq!(LockKey::new("   "), Err(KeyError::Blank));
    assert_eq!(LockKey::new("\u{3000}"), Err(KeyError::Blank));
    for edge in [" A1", "A1 ", "\u{a0}A1", "A1\u{3000}", "\u{200d}A1"] {
        assert_eq!(LockKey::new(edge), Err(KeyError::EdgeBlank), "{edge:?}");
    }
    for (text, c) in [
        ("A\u{200b}1", '\u{200b}'),
        ("A1\u{feff}", '\u{feff}'),
        ("\u{202e}1A", '\u{202e}'),
        ("so\u{ad}ft", '\u{ad}'),
    ] {
        assert_eq!(LockKey::new(text), Err(KeyError::Invisible(c)), "{text:?}");
    }
    // Under a namespace, the part the request gave is what is checked.
    assert_eq!(LockKey::namespaced("sku", "   "), Err(KeyError::Blank));
    assert_eq!(LockKey::namespaced("sku", " A1"), Err(KeyError::EdgeBlank));
    assert_eq!(LockKey::namespaced("sku", ".."), Err(KeyError::DotSegment));
    assert_eq!(
        LockKey::namespaced("sku", "a..b").unwrap().as_str(),
        "sku:a..b"
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
        // Padded to every length read a word at a time, at every place.
        let padded = (0..33).flat_map(|n| {
            let pad = "k".repeat(n);
            [
                format!("{pad}{c}"),
                format!("{c}{pad}"),
                format!("a{pad}{c}{pad}b"),
            ]
        });
        for text in [c.to_string(), format!("a{c}b")].into_iter().chain(padded) {
            let by_chars = if let Some(bad) = text.chars().find(|c| c.is_control() || *c == '/') {
                Err(KeyError::ForbiddenChar(bad))
            } else if text == "." || text == ".." {
                Err(KeyError::DotSegment)
            } else if let Some(bad) = text.chars().find(|&c| misleading(c)) {
                Err(KeyError::Invisible(bad))
            } else if text.chars().all(blank) {
                Err(KeyError::Blank)
            } else if text.starts_with(edge_blank) || text.ends_with(edge_blank) {
                Err(KeyError::EdgeBlank)
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
    assert!(check_namespace(" sku").is_err());
    assert!(check_namespace(&"n".repeat(MAX_KEY_LEN - 1)).is_err());
    let bad = std::panic::catch_unwind(|| assert_namespace(".."));
    assert!(bad.is_err());
}

#[test]
fn namespace_joins_and_counts_towards_length() {
    assert_eq!(LockKey::namespaced("ns", "k").unwrap().as_str(), "ns:k");
    assert_eq!(LockKey::namespaced("", "k").unwrap().as_str(), "k");
    assert_eq!(LockKey::namespaced("ns", ""), Err(KeyError::Empty));
    let k = "a".repeat(MAX_KEY_LEN - 2);
    let e = LockKey::namespaced("ns", &k).unwrap_err();
    assert_eq!(
        e,
        KeyError::TooLong {
            len: MAX_KEY_LEN + 1,
            namespace: 3
        }
    );
    assert!(e.to_string().contains("3-byte namespace prefix"), "{e}");
}
