//! A model that produces NaN or infinity must stop with an error, on every backend and sampling
//! path, and never emit a token (before this, the CPU emitted token 0 forever and the GPU id
//! 4294967295, outside the vocabulary).

use crate::common;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::Error;

/// The default model with a NaN scale in the embedding row of `token` (the embedding is also
/// the output matrix, so that token's logit is NaN for every prompt).
fn model_with_nan_embedding(token: usize) -> Vec<u8> {
    let mut bytes = common::model_bytes().to_vec();
    let embd = common::model_gguf().tensor("token_embd.weight").unwrap();
    // These blocks start with their f16 scale d.
    assert!(["Q8_0", "Q4_0", "Q4_1"].contains(&embd.ty.name()), "{}", embd.ty.name());
    let row_bytes = embd.byte_size as usize / embd.rows().1;
    let at = embd.file_offset as usize + token * row_bytes;
    bytes[at..at + 2].copy_from_slice(&0x7e00u16.to_le_bytes()); // f16 NaN
    bytes
}

fn load(bytes: &[u8], backend: BackendKind) -> Engine {
    let options = LoadOptions { backend, context_length: Some(64), gpu: GpuOptions::from_env() };
    pollster::block_on(Engine::load(bytes, options, &mut |_, _| {})).unwrap()
}

#[test]
fn non_finite_logits_are_an_error_on_the_cpu_and_the_gpu_greedy_and_sampled() {
    let bad_token = 1000;
    let bytes = model_with_nan_embedding(bad_token);
    for backend in [BackendKind::Cpu, BackendKind::Gpu] {
        let mut engine = load(&bytes, backend);
        for sampling in [SamplingParams::greedy(), SamplingParams { seed: 1, ..SamplingParams::default() }] {
            let options = GenerateOptions { max_tokens: 4, sampling, ..GenerateOptions::default() };
            let mut emitted = Vec::new();
            let result = pollster::block_on(engine.generate(
                &Prompt::Tokens(vec![1, 2, bad_token as u32]),
                &options,
                &mut |ev| {
                    emitted.push(ev.id);
                    true
                },
            ));
            match result {
                Err(e @ Error::NonFiniteLogits { position: 3 }) => {
                    assert!(e.to_string().contains("non-finite"), "{e}")
                }
                other => panic!("{backend:?}: expected NonFiniteLogits at position 3, got {other:?}"),
            }
            assert!(emitted.is_empty(), "{backend:?} emitted {emitted:?}");
            // The embedding is tied to the output, so row `bad_token` of the logits is NaN for
            // any prompt: each call fails the same way, with no panic and no token.
            let again = pollster::block_on(engine.generate(&Prompt::Tokens(vec![1, 2, 3]), &options, &mut |ev| {
                emitted.push(ev.id);
                true
            }));
            assert!(matches!(again, Err(Error::NonFiniteLogits { position: 3 })), "{again:?}");
            assert!(emitted.is_empty(), "{backend:?} emitted {emitted:?}");
        }
    }
}
