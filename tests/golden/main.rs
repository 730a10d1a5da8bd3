//! The checks whose truth is transformers on the two golden models (SmolLM2-135M-Instruct Q4_1
//! and Gemma 3 270M Q4_K_M, fetched by scripts/fetch-model; golden data in ../shared/golden):
//! the CPU reference, the GPU model on each kernel path, beam search, the tokenizer and the chat
//! templates. Every other property is checked on tiny models (tests/properties).

#[path = "../common/mod.rs"]
mod common;

mod beams;
mod chat;
mod chat_builtin;
mod cpu_gemma3;
mod cpu_smollm2;
mod gpu;
mod tokenizer;
