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
}
