//! Who this process is, as a store shows it to
//! [`Backend::inspect`](crate::Backend::inspect) where it can carry it
//! without a request of its own: the label set on the backend, this
//! process's id and its host name.

use std::sync::OnceLock;

/// `"<label>, pid <pid> on <host>"`, or without the label.
pub(crate) fn holder_identity(label: Option<&str>) -> String {
    let process = format!("pid {} on {}", std::process::id(), host());
    match label {
        Some(label) if !label.is_empty() => format!("{label}, {process}"),
        _ => process,
    }
}

/// [`holder_identity`] in at most `max` bytes of printable ASCII (what
/// PostgreSQL keeps of an `application_name`): other characters become
/// `?`, and a long label is clipped so that the process and host still
/// show.
#[cfg(feature = "postgres")]
pub(crate) fn holder_identity_within(label: Option<&str>, max: usize) -> String {
    let ascii = |text: &str| -> String {
        text.chars()
            .map(|c| {
                if c.is_ascii_graphic() || c == ' ' {
                    c
                } else {
                    '?'
                }
            })
            .collect()
    };
    let process: String = ascii(&holder_identity(None)).chars().take(max).collect();
    match label.map(ascii).filter(|l| !l.is_empty()) {
        Some(label) if process.len() + 3 <= max => {
            let room = max - process.len() - 2;
            format!("{}, {process}", &label[..label.len().min(room)])
        }
        _ => process,
    }
}

/// `text` as shown to an operator: control characters (which another
/// client could have written into a lock node's data or a key's value, to
/// forge lines on a terminal) escaped.
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) fn shown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// The host name as the kernel has it (no lookup: nothing that could block
/// or reach the network), or the `HOSTNAME` variable, once per process.
fn host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "an unnamed host".to_owned())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_label_comes_first_and_the_process_always() {
        let pid = format!("pid {} on ", std::process::id());
        assert!(super::holder_identity(None).starts_with(&pid));
        let labelled = super::holder_identity(Some("orders-api"));
        assert!(
            labelled.starts_with(&format!("orders-api, {pid}")),
            "{labelled}"
        );
        assert!(!super::host().is_empty());
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn an_application_name_fits_and_keeps_the_process() {
        let pid = format!("pid {} on ", std::process::id());
        let long = "a-rather-long-service-name-".repeat(4);
        for label in [
            None,
            Some("orders"),
            Some(long.as_str()),
            Some("café\u{0}x"),
        ] {
            let name = super::holder_identity_within(label, 63);
            assert!(name.len() <= 63, "{name}");
            assert!(name.contains(&pid), "{name}");
            assert!(
                name.chars().all(|c| c.is_ascii_graphic() || c == ' '),
                "{name}"
            );
        }
        assert!(super::holder_identity_within(Some("café"), 63).starts_with("caf?, pid"));
    }

    #[cfg(any(feature = "zookeeper", feature = "etcd"))]
    #[test]
    fn control_characters_are_shown_escaped() {
        assert_eq!(super::shown("a\nfloor 1\u{1b}[2J"), "a\\nfloor 1\\u{1b}[2J");
    }
}
