//! What the engine does, checked on tiny random-weight models against the CPU reference on the
//! same file (or a hand count): generation and its stops, batching, speculation, beams on the
//! GPU, abort, non-finite logits, what a step reads and writes, ranged loading, the CLI.

#[path = "../common/mod.rs"]
mod common;

mod abort_cycles;
mod batch;
mod beams_gpu;
mod cli;
mod constrained;
mod counters;
mod engine;
mod ledger;
mod long_context;
mod non_finite;
mod speculate;
mod streaming;
