//! Heap allocations per request on the memory backend, counted by a
//! global allocator (a count that does not drift with the machine): the
//! `LockLayer` costs at most two more than the bare route, with every
//! feature on (key rules, tokens, the lost signal, re-entrancy, tracing)
//! and a key that fits in place (up to 23 bytes); metrics off, as by
//! default. Red before keys were kept in place (three more).

use tower_lock_bench::counting::{allocations, Counting};
use tower_lock_bench::routes::{app, serve};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Requests per measurement: enough that a map's or buffer's occasional
/// growth (amortised over many requests) rounds away.
const N: u64 = 2_000;

/// The allocations one request costs on `route`, after as many requests
/// again to warm up, on this thread (the runtime runs on it).
fn per_request(route: &str) -> f64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut app = app(route).unwrap();
    runtime.block_on(async {
        serve(&mut app, 0, N).await;
        let before = allocations();
        serve(&mut app, N, N).await;
        (allocations() - before) as f64 / N as f64
    })
}

// The `metrics` facade allocates each sample's labels: the count is for
// the layer as built by default. scripts/test-all.sh runs this test with
// the bench's default features, and checks that it ran.
#[cfg_attr(
    feature = "metrics",
    ignore = "counts the layer without metrics: `cargo test -p tower-lock-bench --test allocations`"
)]
#[test]
fn the_lock_layer_costs_at_most_one_allocation_a_request() {
    let bare = per_request("bare");
    assert!(bare > 0.0, "the counting allocator counts nothing");
    for (route, over) in [("layer-handler", "bare"), ("layer-route", "identity-route")] {
        let (with, without) = (per_request(route), per_request(over));
        println!("{route}: {with:.2} a request, {over}: {without:.2}");
        assert!(
            with - without <= 1.05,
            "{route} costs {with:.2} allocations a request, {:.2} more than {over}",
            with - without
        );
    }
}
