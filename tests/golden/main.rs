//! The checks whose truth is transformers on the two golden models (SmolLM2-135M-Instruct Q4_1
//! and Gemma 3 270M Q4_K_M, fetched by scripts/fetch-model; golden data in ../shared/golden):
//! the CPU reference, the GPU model on each kernel path, the engine's generation loop and the
//! batcher's logprobs, beam search, the tokenizer and the chat templates. Every other property
//! is checked on tiny models (tests/properties).

#[path = "../common/mod.rs"]
mod common;

mod beams;
mod chat;
mod chat_builtin;
mod constrained;
mod cpu_gemma3;
mod cpu_smollm2;
mod engine;
mod gpu;
mod tokenizer;

/// Prints how long a test (or a part of one) took when it ends, for the slow GPU checks.
pub struct Timer {
    name: String,
    start: std::time::Instant,
}

impl Timer {
    pub fn new(name: &str) -> Self {
        Self { name: name.to_string(), start: std::time::Instant::now() }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("[time] {}: {:.1} s", self.name, self.start.elapsed().as_secs_f64());
    }
}
