//! The traffic ledger (what each decode dispatch declares it moves) against hand counts for the
//! default model, and the synthetic large-model source `bench --synthetic` runs.

use crate::common;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
use webgpu_llm::gguf::{ByteSource, GgmlType, Gguf};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::model::ModelConfig;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::synthetic::{SyntheticSource, LLAMA_3_2_1B, LLAMA_3_8B};
use webgpu_llm::tokenizer::Tokenizer;

fn gpu_engine(bytes: &(impl ByteSource + ?Sized), context: usize) -> Engine {
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(context), gpu: GpuOptions::default() };
    pollster::block_on(Engine::load_from(bytes, opts, &mut |_, _| {})).expect("a GPU adapter (lavapipe in CI)")
}

#[test]
fn the_decode_ledger_of_the_default_model_matches_a_hand_count() {
    let engine = gpu_engine(common::model_bytes(), 1024);
    let m = engine.gpu_model().unwrap();
    let kvb: u64 = if m.gpu.f16 { 2 } else { 4 };
    // SmolLM2-135M: 30 layers, 3 KV heads of 64; token_embd Q8_0 (tied output), Q4_1 matrices,
    // 61 F32 norm vectors of 576.
    let g = common::model_gguf();
    let bytes_of = |ty: GgmlType| -> u64 { g.tensors.iter().filter(|t| t.ty == ty).map(|t| t.byte_size).sum() };
    let (q4_1, q8_0, f32s) = (bytes_of(GgmlType::Q4_1), bytes_of(GgmlType::Q8_0), bytes_of(GgmlType::F32));
    assert_eq!((q4_1, q8_0, f32s), (66_355_200, 30_081_024, 61 * 576 * 4));
    // On the GPU a Q8_0 row is its 18 scales (9 words) then its 18 blocks' 32 quants: the file's
    // 612 bytes; Q4_1's 20-byte blocks are whole words. The lm_head reads the whole table, the
    // embedding lookup one row.
    let weights = q4_1 + q8_0 + 612 + f32s;
    let kv_row = 2 * 30 * 3 * 64 * kvb;
    for seq in [1, 64, 65, 1000] {
        let ledger = m.decode_traffic(seq);
        assert_eq!(ledger.weights, weights, "at {seq} keys");
        assert_eq!(ledger.kv_read, kv_row * seq as u64, "at {seq} keys");
        assert_eq!(ledger.kv_written, kv_row, "at {seq} keys");
        let least = m.min_decode_traffic(seq);
        assert_eq!(least.weights, q4_1 + q8_0 + f32s);
        assert_eq!(least.kv_read, ledger.kv_read);
        // The bound: weight bytes read per token within 2% of the file's.
        assert!(ledger.weights as f64 / least.weights as f64 <= 1.02);
        assert!(ledger.activations >= least.activations, "at {seq} keys: fewer activation bytes than the least");
    }
    // Attention's records: one per head per 64-key chunk attended, written then read.
    let records = |seq| m.decode_traffic(seq).activations;
    assert_eq!(records(65) - records(64), 30 * 2 * 9 * (64 + 2) * 4);
    assert_eq!(records(64), records(1));
}

#[test]
fn synthetic_models_have_the_real_shapes_and_read_the_same_in_any_pieces() {
    for (shape, params) in [(LLAMA_3_2_1B, 1.236e9), (LLAMA_3_8B, 8.03e9)] {
        let source = SyntheticSource::new(shape);
        let gguf = pollster::block_on(Gguf::read(&source)).unwrap();
        let c = ModelConfig::from_gguf(&gguf).unwrap();
        assert_eq!(
            (c.n_layers, c.d_model, c.ffn_dim, c.n_heads, c.n_kv_heads, c.vocab_size),
            (shape.layers as usize, shape.d_model as usize, shape.ffn as usize, 32, 8, 128256)
        );
        let n: u64 = gguf.tensors.iter().map(|t| t.n_elements()).sum();
        assert!((n as f64 / params - 1.0).abs() < 0.01, "{} parameters", n);
        let last = gguf.tensors.iter().map(|t| t.file_offset + t.byte_size).max().unwrap();
        assert_eq!(last, source.len());
        // Any span reads the same whole or in odd pieces (header, padding, norms, blocks).
        let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
        assert_eq!(tokenizer.decode(&tokenizer.encode("Hello, wörld!").unwrap()).unwrap(), "Hello, wörld!");
        let norm = gguf.tensor("blk.0.attn_norm.weight").unwrap();
        let start = norm.file_offset - 100;
        let whole = pollster::block_on(source.read(start, 20_000)).unwrap();
        let mut pieces = Vec::new();
        for (at, len) in [(0, 7), (7, 93), (100, 1), (101, 4095), (4196, 15_804)] {
            pieces.extend(pollster::block_on(source.read(start + at, len)).unwrap());
        }
        assert_eq!(whole, pieces);
        let ones = &whole[100..100 + norm.byte_size as usize];
        assert!(ones.chunks_exact(4).all(|b| f32::from_le_bytes(b.try_into().unwrap()) == 1.0));
        let q = gguf.tensor("blk.0.attn_q.weight").unwrap();
        let block = pollster::block_on(source.read(q.file_offset + 18 * 1000, 18)).unwrap();
        let scale = half::f16::from_le_bytes([block[0], block[1]]).to_f32().abs();
        assert!((0.0009..0.0031).contains(&scale), "block scale {scale}");
    }
}

#[test]
fn a_synthetic_1b_model_runs_on_the_gpu_with_finite_logits() {
    let mut engine = gpu_engine(&SyntheticSource::new(LLAMA_3_2_1B), 64);
    let options =
        GenerateOptions { max_tokens: 2, sampling: SamplingParams::greedy(), ignore_eos: true, ..Default::default() };
    let mut ids = Vec::new();
    let stats = pollster::block_on(engine.generate(&Prompt::Text("Hello".into()), &options, &mut |ev| {
        ids.push(ev.id);
        true
    }))
    .unwrap();
    assert_eq!(ids.len(), 2);
    assert!(ids.iter().all(|&id| id < 128256));
    assert_eq!(stats.generated_tokens, 2);
    // Q4_0 rows of whole words on the GPU: the weight bytes a token reads are the file's, but
    // for the norm vectors each fused or separate norm reads once, and one embedding row.
    let m = engine.gpu_model().unwrap();
    let (ledger, least) = (m.decode_traffic(64), m.min_decode_traffic(64));
    let ratio = ledger.weights as f64 / least.weights as f64;
    assert!((0.999..1.001).contains(&ratio), "weights read {} vs the file's {}", ledger.weights, least.weights);
}
