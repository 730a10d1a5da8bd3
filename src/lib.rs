//! webgpu-llm: runs a GGUF language model on the user's own GPU, in the browser through WebGPU
//! and natively through wgpu. The README's "How it works", "Layout" and "Correctness" sections
//! say how the pieces fit and how each is checked.

pub mod arch;
pub mod batcher;
pub mod beam;
pub mod chat;
pub mod constraint;
pub mod deadline;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod gpu;
pub mod kv_pool;
pub mod model;
pub mod openai;
pub mod options;
pub mod quant;
pub mod sampling;
pub mod speculate;
pub mod synthetic;
pub mod tokenizer;
pub mod tools;
#[cfg(target_arch = "wasm32")]
pub mod wasm;

pub use error::Error;
