//! One span per acquisition, carrying key, backend, mode, wait time, hold
//! time and outcome.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tower_lock::{BackendExt, MemoryBackend};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// A span's name and its fields as text.
type SpanRecord = (String, BTreeMap<String, String>);

/// Every span, by id.
#[derive(Clone, Default)]
struct Capture {
    spans: Arc<Mutex<BTreeMap<u64, SpanRecord>>>,
    next: Arc<AtomicU64>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        let mut fields = BTreeMap::new();
        span.record(&mut Fields(&mut fields));
        self.spans
            .lock()
            .unwrap()
            .insert(id, (span.metadata().name().to_owned(), fields));
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some((_, fields)) = self.spans.lock().unwrap().get_mut(&span.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn each_acquisition_has_a_span_with_its_outcome() {
    let capture = Capture::default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tracing::subscriber::with_default(capture.clone(), || {
        rt.block_on(async {
            let backend = MemoryBackend::new();
            let guard = backend.lock("sku-9").read().await.unwrap();
            let busy = backend.lock("sku-9").write().fail_fast().await;
            assert!(busy.is_err());
            let timed_out = backend
                .lock("sku-9")
                .write()
                .wait(Duration::from_millis(20))
                .await;
            assert!(timed_out.is_err());
            tokio::time::sleep(Duration::from_millis(5)).await;
            guard.release().await.unwrap();
        })
    });

    let spans = capture.spans.lock().unwrap();
    let locks: Vec<_> = spans
        .values()
        .filter(|(name, _)| name == "lock")
        .map(|(_, f)| f)
        .collect();
    assert_eq!(locks.len(), 3, "{locks:?}");
    for f in &locks {
        assert_eq!(f["key"], "sku-9");
        assert_eq!(f["backend"], "memory");
        assert!(f.contains_key("wait_us"), "{f:?}");
    }
    assert_eq!(locks[0]["mode"], "read");
    assert_eq!(locks[0]["outcome"], "acquired");
    let hold: u64 = locks[0]["hold_us"].parse().unwrap();
    assert!(hold >= 5_000, "held at least the 5 ms sleep: {hold}");
    assert_eq!(locks[1]["mode"], "write");
    assert_eq!(locks[1]["outcome"], "busy");
    assert_eq!(locks[2]["outcome"], "timeout");
    let waited: u64 = locks[2]["wait_us"].parse().unwrap();
    assert!(waited >= 20_000, "waited the 20 ms timeout: {waited}");
}
