//! What the engine is given, checked without running a model on the GPU: GGUF files (valid,
//! truncated, hostile, fuzzed), block types against gguf-py, tokenizer metadata, chat templates,
//! the sampler, and the tiny per-architecture references on the CPU reference.

#[path = "../common/mod.rs"]
mod common;
#[path = "../layout/mod.rs"]
mod layout;
#[path = "../meter/mod.rs"]
mod meter;

mod arch_references;
mod fuzz_load;
mod gguf;
mod hostile_files;
mod hostile_template;
mod quant;
mod sampling;
mod tokenizer_metadata;
