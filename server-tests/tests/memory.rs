//! The in-process backend under the conformance suite (`common::contract`):
//! it needs no server.

mod common;

use tower_lock::MemoryBackend;

use common::fault_proxy::FaultProxy;

/// One process's map: every "process" of a test is a handle on it.
struct Memory(MemoryBackend);

impl common::contract::Subject for Memory {
    type Backend = MemoryBackend;

    async fn connect(&self, _test: &str) -> MemoryBackend {
        self.0.clone()
    }

    async fn connect_through_proxy(&self, _test: &str) -> Option<(Vec<FaultProxy>, MemoryBackend)> {
        None
    }

    async fn assert_nothing_left(&self, test: &str, _keys: &[String]) {
        let memory = self.0.clone();
        common::eventually(&format!("{test}: every key forgotten"), move || {
            memory.active_keys() == 0
        })
        .await;
    }
}

mod conformance {
    crate::common::contract::conformance!(super::Memory(super::MemoryBackend::new()));
}
