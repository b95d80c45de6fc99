//! The in-process backend under the same cancellation contract as the
//! remote ones (`common::cancel`): it needs no server.

mod common;

use tower_lock::MemoryBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_cut_at_every_poll_frees_no_other_holder() {
    // One backend is one process's map: the other holder is a second
    // handle on the same map.
    let backend = MemoryBackend::new();
    common::cancel::every_cut("memory", &backend, &backend.clone(), "k").await;
}
