//! A model that produces NaN or infinity must stop with an error, on every backend and sampling
//! path, and never emit a token (before this, the CPU emitted token 0 forever and the GPU id
//! 4294967295, outside the vocabulary). The models: the tiny chat model with its output tied to
//! its Q8_0 embedding and a NaN block scale in one row, and the committed tiny llama3 (F32, tied)
//! with an infinite final-norm weight.

use crate::common::tiny;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
use webgpu_llm::gguf::{Gguf, GgufWriter};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::model::{CpuModel, Logits};
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::Error;

/// `bytes` written again without `output.weight` (the output is then the embedding) and with
/// `patch` applied to the named tensor's data.
fn rewritten(bytes: &[u8], tied: bool, name: &str, patch: impl Fn(&mut [u8])) -> Vec<u8> {
    let g = Gguf::parse(bytes).unwrap();
    let mut w = GgufWriter::new(3);
    let mut keys: Vec<_> = g.metadata.iter().collect();
    keys.sort_by_key(|(k, _)| k.as_str());
    for (k, v) in keys {
        w.metadata(k, v.clone());
    }
    assert!(g.tensor(name).is_some(), "{name}");
    for t in g.tensors.iter().filter(|t| !(tied && t.name == "output.weight")) {
        let mut data = t.data(bytes).to_vec();
        if t.name == name {
            patch(&mut data);
        }
        w.tensor(&t.name, &t.shape, t.ty, data);
    }
    w.to_bytes()
}

/// The tiny chat model tied to its embedding, with a NaN scale in the embedding row of `token`
/// (so that token's logit is NaN for every prompt, and a prompt holding it is NaN throughout).
fn model_with_nan_embedding(token: usize) -> Vec<u8> {
    let embd = Gguf::parse(tiny::chat()).unwrap().tensor("token_embd.weight").unwrap().clone();
    // These blocks start with their f16 scale d.
    assert_eq!(embd.ty.name(), "Q8_0");
    let row_bytes = embd.byte_size as usize / embd.rows().1;
    rewritten(tiny::chat(), true, "token_embd.weight", |data| {
        data[token * row_bytes..token * row_bytes + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
        // f16 NaN
    })
}

/// The tiny llama3 (F32, tied) with its final norm's first weight +infinity: every logit is
/// plus or minus infinity (or NaN), for every prompt.
fn model_with_infinite_norm() -> Vec<u8> {
    let bytes = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/arch/llama3/model.gguf")).unwrap();
    assert!(Gguf::parse(&bytes).unwrap().tensor("output.weight").is_none(), "tied");
    rewritten(&bytes, false, "output_norm.weight", |data| data[..4].copy_from_slice(&f32::INFINITY.to_le_bytes()))
}

fn load(bytes: &[u8], backend: BackendKind) -> Engine {
    let options = LoadOptions { backend, context_length: Some(64), gpu: GpuOptions::from_env() };
    pollster::block_on(Engine::load(bytes, options, &mut |_, _| {})).unwrap()
}

/// Every generation on `bytes` fails at the end of its 3-token prompt with no token emitted:
/// one with `bad_token` in the prompt (when given), and one without.
fn check(bytes: &[u8], bad_token: Option<u32>) {
    for backend in [BackendKind::Cpu, BackendKind::Gpu] {
        let mut engine = load(bytes, backend);
        for sampling in [SamplingParams::greedy(), SamplingParams { seed: 1, ..SamplingParams::default() }] {
            let options = GenerateOptions { max_tokens: 4, sampling, ..GenerateOptions::default() };
            let prompts = bad_token.map(|t| vec![259, 300, t]).into_iter().chain([vec![259, 300, 301]]);
            for prompt in prompts {
                let mut emitted = Vec::new();
                let result =
                    pollster::block_on(engine.generate(&Prompt::Tokens(prompt.clone()), &options, &mut |ev| {
                        emitted.push(ev.id);
                        true
                    }));
                match result {
                    Err(e @ Error::NonFiniteLogits { position: 3 }) => {
                        assert!(e.to_string().contains("non-finite"), "{e}")
                    }
                    other => panic!("{backend:?} {prompt:?}: expected NonFiniteLogits at position 3, got {other:?}"),
                }
                assert!(emitted.is_empty(), "{backend:?} {prompt:?} emitted {emitted:?}");
            }
        }
    }
}

#[test]
fn non_finite_logits_are_an_error_on_the_cpu_and_the_gpu_greedy_and_sampled() {
    // The embedding is tied to the output, so row `bad_token` of the logits is NaN for any
    // prompt: each call fails the same way, with no panic and no token.
    let bad_token = 1000;
    check(&model_with_nan_embedding(bad_token), Some(bad_token as u32));
}

#[test]
fn infinite_logits_are_an_error_on_the_cpu_and_the_gpu_greedy_and_sampled() {
    let bytes = model_with_infinite_norm();
    // Infinities, not NaN: h[0] * inf * embedding[v][0] is plus or minus infinity.
    let gguf = Gguf::parse(&bytes).unwrap();
    let cpu = CpuModel::load(&gguf, &bytes).unwrap();
    let logits = cpu.forward(&mut cpu.new_cache(), &[259, 300, 301], Logits::Last).unwrap();
    assert!(logits.iter().all(|l| l.is_infinite()), "{:?}", &logits[..8]);
    assert!(logits.iter().any(|&l| l > 0.0) && logits.iter().any(|&l| l < 0.0));
    check(&bytes, None);
}
