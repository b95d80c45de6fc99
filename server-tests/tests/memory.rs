//! The in-process backend under the conformance suite (`common::contract`):
//! it needs no server.

mod common;

use common::contract::KeysKept;
use tower_lock::MemoryBackend;

impl KeysKept for MemoryBackend {
    fn keys_kept(&self) -> usize {
        self.active_keys()
    }
}

mod conformance {
    use crate::common::contract::InProcess;
    crate::common::contract::conformance!(InProcess(tower_lock::MemoryBackend::new()));
}
