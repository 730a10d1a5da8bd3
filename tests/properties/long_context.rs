//! Attention past 1024 keys on the GPU, against the CPU reference on the same file: a tiny
//! model with SmolLM2's head size (64) runs a 1100-token sequence the way a long prompt and its
//! answer do (prefill chunks that read no logits, then prefill passes that read every position's
//! logits across key 1024, then one decode step at a time past it), on the f32 path with the
//! CPU-style kernels (one query an invocation) and with the GPU-style ones (tiled prefill
//! attention, decode attention split across invocations; also at 1024 rows a pass, as large
//! GPUs prefill: the prefix in one chunk); and the same with a sliding window
//! that starts dropping keys inside the compared positions. Every compared row is the whole
//! vocabulary.
//! The golden models check the same paths at shorter lengths against transformers
//! (tests/golden/gpu.rs): a long context costs a 135M model minutes on lavapipe and a tiny one
//! seconds, and the kernels' chunking does not depend on the model.

use crate::common::tiny::{self, Tiny};
use webgpu_llm::gguf::{Gguf, Value};
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, KernelStyle, Readback};
use webgpu_llm::model::{CpuModel, Logits};

/// Two layers, two query heads of 64 over one KV head (grouped), 2048 positions.
const LONG: Tiny =
    Tiny { vocab: 512, layers: 2, d_model: 128, ffn: 256, heads: 2, kv_heads: 1, context: 2048, seed: 20261203 };

/// Positions 0..PREFIX are prefilled without logits, PREFIX..DECODE read every position's logits
/// from prefill passes, DECODE..LEN one decode step each.
const PREFIX: usize = 900;
const DECODE: usize = 1090;
const LEN: usize = 1110;

#[test]
fn gpu_logits_past_1024_keys_match_the_cpu_reference_in_prefill_and_decode() {
    check("a tiny llama with heads of 64", &LONG.bytes(), tiny::IM_START..tiny::ENDOFTEXT + 1);
}

/// Gemma 2's plan (sliding layers between global ones, soft-capped scores) with its window moved
/// to 1000 keys, inside the compared positions: rows before it see every key, rows after it
/// drop the oldest, in prefill passes and in decode steps alike (Gemma 3's window is 512).
#[test]
fn a_sliding_window_starts_dropping_keys_where_the_cpu_reference_does_on_the_gpu() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/arch/gemma2/model.gguf");
    let bytes = std::fs::read(path).unwrap();
    let bytes = tiny::with_metadata(&bytes, "gemma2.attention.sliding_window", Value::U32(1000));
    // tests/data/arch's specials: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>.
    check("tests/data/arch/gemma2 with a window of 1000", &bytes, 0..3);
}

/// `bytes`' logits at positions PREFIX..LEN of a random sequence (no token of `specials`) on
/// both kernel styles against the CPU reference's, every row whole.
fn check(what: &str, bytes: &[u8], specials: std::ops::Range<u32>) {
    let gguf = Gguf::parse(bytes).unwrap();
    let cpu = CpuModel::load(&gguf, bytes).unwrap();
    let vocab = cpu.config.vocab_size;
    assert!(cpu.config.context_length >= LEN, "{what}: a context of {LEN} positions");
    let mut rng = tiny::Xorshift(7);
    // Byte and word tokens alike: what a long document looks like to the model.
    let ids: Vec<u32> = std::iter::repeat_with(|| (rng.next() % vocab as u64) as u32)
        .filter(|t| !specials.contains(t))
        .take(LEN)
        .collect();
    let want = cpu.forward(&mut cpu.new_cache(), &ids, Logits::All).unwrap();
    assert_eq!(want.len(), LEN * vocab);
    // The logits must vary with the context for the comparison to mean anything: rows far apart
    // differ by much more than the bound.
    let apart = want[..vocab].iter().zip(&want[(LEN - 1) * vocab..]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(apart > 0.1, "{what}: the first and last rows differ by {apart}");

    // Each style at this adapter's rows a pass (512: the prefix in two passes), and the
    // GPU-style kernels at a large GPU's (1024: the prefix in one).
    for (style, pass_rows) in [(KernelStyle::Cpu, None), (KernelStyle::Gpu, None), (KernelStyle::Gpu, Some(1024))] {
        let options = GpuOptions { force_f32: true, pass_rows, ..Default::default() };
        let mut gpu = pollster::block_on(Gpu::new(options)).unwrap();
        gpu.style = style;
        let mut model = pollster::block_on(GpuModel::load(gpu, &gguf, bytes, LEN, &mut |_, _| {})).unwrap();
        let rows = model.pass_rows();
        assert_eq!(rows, pass_rows.unwrap_or(rows), "{what}: the rows asked for fit");
        for (c, tokens) in ids[..PREFIX].chunks(rows).enumerate() {
            pollster::block_on(model.step(tokens, c * rows, Readback::None)).unwrap();
        }
        let mut got = Vec::new();
        let chunk = model.all_logits_chunk();
        for (c, tokens) in ids[PREFIX..DECODE].chunks(chunk).enumerate() {
            got.extend(pollster::block_on(model.logits_all(tokens, PREFIX + c * chunk)).unwrap());
        }
        let mut row = vec![0f32; vocab];
        for pos in DECODE..LEN {
            pollster::block_on(model.step(&ids[pos..pos + 1], pos, Readback::Logits(&mut row))).unwrap();
            got.extend_from_slice(&row);
        }
        assert_eq!(got.len(), (LEN - PREFIX) * vocab);
        let mut worst = 0f32;
        for (i, (g, w)) in got.chunks_exact(vocab).zip(want[PREFIX * vocab..].chunks_exact(vocab)).enumerate() {
            let d = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(
                d < 1e-3,
                "{what}, {style:?}-style kernels, {rows} rows a pass, position {}: logits differ by {d}",
                PREFIX + i
            );
            worst = worst.max(d);
        }
        eprintln!("{what}, {style:?}-style kernels, {rows} rows a pass: positions {PREFIX}..{LEN} within {worst:.2e} of the CPU reference");
    }
}

#[test]
fn rows_a_pass_that_are_no_multiple_of_64_from_256_to_4096_are_refused_in_words() {
    for rows in [0, 255, 300, 4160] {
        let options = GpuOptions { pass_rows: Some(rows), ..Default::default() };
        let err = pollster::block_on(Gpu::new(options)).err().expect("refused");
        let text = err.to_string();
        assert!(text.contains("pass_rows") && text.contains("multiple of 64 from 256 to 4096"), "{rows}: {text}");
    }
}
