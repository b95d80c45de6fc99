//! What the bench program (`src/main.rs`) and the instruction and
//! allocation counts (`src/bin/http_instructions.rs`,
//! `src/bin/http_allocations.rs`, `tests/allocations.rs`) share: the
//! `http` workload's handlers and routes, and a counting allocator.

pub mod counting;
pub mod orders;
pub mod routes;
