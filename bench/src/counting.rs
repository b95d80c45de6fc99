//! A global allocator that counts the heap allocations each thread makes:
//! what `src/bin/http_allocations.rs` and `tests/allocations.rs` install,
//! apart from the instruction count (which its bookkeeping would inflate).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    // Const-initialised and without a destructor: usable inside the
    // allocator, which must not allocate.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting allocations (and reallocations, which
/// may move) per thread.
pub struct Counting;

// SAFETY: every call is passed to `System` unchanged; the count is a
// thread-local cell, touched without allocating.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn bump() {
    // `try_with`: a thread being torn down has no count to keep.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

/// The allocations this thread has made so far, with [`Counting`]
/// installed as the global allocator (else 0).
pub fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}
