//! What the bench program (`src/main.rs`) and the instruction counts
//! (`src/bin/http_instructions.rs`) share: the `http` workload's handlers.

pub mod orders;
