//! Runs the loom models of tower-lock's in-process core, which live beside
//! the code they model (`src/loom/models/` in the library), as tests:
//!
//! ```sh
//! RUSTFLAGS="--cfg loom" cargo test -p tower-lock-loom --release
//! ```
//!
//! A member of its own because the library's dev-dependencies (axum's
//! server) do not build under `--cfg loom`. Without the flag it runs
//! nothing.
