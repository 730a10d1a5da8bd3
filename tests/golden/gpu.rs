//! The whole GPU model (on lavapipe when there is no GPU) against transformers' golden data, on
//! each kernel path the engine has:
//! - f32: f32 arithmetic and KV cache, no subgroups (`force_f32`), the tight bounds;
//! - f16: the adapter's own path where it has shader-f16 (f16 KV cache and arithmetic,
//!   subgroups; this VM's lavapipe has both); on an adapter without it the f16 tests say so
//!   and pass;
//! - packed f16 KV: f16 pairs packed in u32 words (adapters without shader-f16, SwiftShader in
//!   the browser) with f32 arithmetic;
//! - GPU-style kernels (32 lanes per row, subgroup reductions, RMSNorm fused into the gemv, RoPE
//!   and the KV write in the q|k|v epilogue, tiled prefill attention), forced on any adapter:
//!   lavapipe is a CPU adapter, so the other paths run the CPU-style kernels there;
//! - int8: the GPU-style kernels with int8 activations (`Gpu::int8`, `WEBGPU_LLM_INT8=1`: the
//!   decode gemvs and prefill gemms over 32-value integer blocks sum dot4I8Packed products),
//!   held to the f16 path's bounds on any adapter (its activations' rounding is its own);
//! - coop: the GPU-style kernels with the prefill gemms on cooperative matrices (`Gpu::coop`,
//!   `WEBGPU_LLM_COOP=1`: f16 tiles, f32 sums), held to the f16 path's bounds, where the adapter
//!   has them (this VM's lavapipe 22.3 has none: the coop tests say so and pass; Mesa 26's
//!   lavapipe has 8x8 ones, README "Cooperative matrices").
//!
//! Each path runs its own golden prompts (one or two SmolLM2 prompts, one or two Gemma 3 prompts,
//! so that the paths together cover every SmolLM2 case and five of Gemma's; the CPU reference runs
//! every case in cpu_smollm2 and cpu_gemma3) for 8 tokens at least: the top-20 logits at every
//! recorded step (the last prompt position and the 8 decode steps after it) and the greedy tokens.
//! Perplexity, each position's logits from prefill passes and then a few decode steps: SmolLM2's
//! f32 path over the passage's first 112 positions, its f16 path over the first 128; Gemma's f32
//! path over its first 28, its f16 path over its first 64.
//! Long contexts (past 1024 keys, past a sliding window) are tests/properties/long_context.rs's,
//! on tiny models against the CPU reference, whose own perplexity over the whole passage
//! matches transformers (cpu_smollm2, cpu_gemma3): a 135M model takes minutes a thousand
//! positions on lavapipe. Every case and the whole passage on every path (Gemma's packed-f16 KV
//! path too): the ignored tests at the end (tens of minutes on lavapipe:
//! `target/release/deps/golden-* --ignored`).

use crate::common;
use crate::Timer;

use common::Reference::{self, Gemma3, SmolLm2};
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, KernelStyle, KvStore, Readback};

struct Tolerances {
    logits: f64,
    perplexity_rel: f64,
    /// A greedy token may differ from the golden one only at a step whose golden top-1/top-2
    /// margin is below this (then the comparison of that generation ends).
    flip_margin: f64,
}

const F32: Tolerances = Tolerances { logits: 2e-3, perplexity_rel: 1e-3, flip_margin: 0.0 };
const F16: Tolerances = Tolerances { logits: 5e-2, perplexity_rel: 1e-2, flip_margin: 0.05 };

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    F32,
    F16,
    PackedF16Kv,
    GpuStyle,
    Int8,
    Coop,
}

const PATHS: [Path; 6] = [Path::F32, Path::F16, Path::PackedF16Kv, Path::GpuStyle, Path::Int8, Path::Coop];

/// The model on `path` with that path's bounds, or None (with a note) where the adapter lacks
/// the path (the f16 path without shader-f16: asked of the adapter before the model uploads).
fn load(reference: Reference, path: Path) -> Option<(GpuModel, &'static Tolerances)> {
    let options = match path {
        Path::F32 => GpuOptions { force_f32: true, ..Default::default() },
        Path::PackedF16Kv => GpuOptions { force_f32: true, packed_kv: true, ..Default::default() },
        Path::F16 | Path::GpuStyle | Path::Int8 => GpuOptions::default(),
        Path::Coop => GpuOptions { coop: Some(true), ..Default::default() },
    };
    let mut gpu = match pollster::block_on(Gpu::new(options)) {
        Err(e) if path == Path::Coop => {
            eprintln!("the adapter cannot run the coop path: {e}");
            return None;
        }
        gpu => gpu.expect("a GPU adapter (lavapipe in CI)"),
    };
    let tol = match path {
        Path::F32 => {
            assert!(!gpu.f16 && !gpu.subgroups && gpu.kv == KvStore::F32);
            &F32
        }
        Path::F16 => {
            if !gpu.f16 {
                eprintln!("the adapter has no shader-f16: the f16 path does not exist here");
                return None;
            }
            assert_eq!(gpu.kv, KvStore::F16);
            &F16
        }
        Path::PackedF16Kv => {
            assert!(!gpu.f16 && gpu.kv == KvStore::PackedF16);
            &F16
        }
        Path::GpuStyle => {
            gpu.style = KernelStyle::Gpu;
            // An adapter without shader-f16 keeps the cache as packed f16 pairs: the packed
            // path's bounds (an adapter without shader-f16 gave 0.0031 here, within them).
            if gpu.f16 || gpu.kv != KvStore::F32 {
                &F16
            } else {
                &F32
            }
        }
        Path::Int8 => {
            gpu.style = KernelStyle::Gpu;
            gpu.int8 = true;
            &F16
        }
        Path::Coop => {
            gpu.style = KernelStyle::Gpu;
            &F16
        }
    };
    eprintln!(
        "{reference:?} on the {path:?} path: f16 {}, subgroups {}, KV {:?}, {:?}-style kernels, int8 {}, coop {:?}",
        gpu.f16, gpu.subgroups, gpu.kv, gpu.style, gpu.int8, gpu.coop
    );
    let start = std::time::Instant::now();
    let model = pollster::block_on(GpuModel::load(gpu, reference.gguf(), reference.bytes(), 2048, &mut |_, _| {}))
        .expect("the model uploads");
    eprintln!("uploaded in {:.1} s", start.elapsed().as_secs_f64());
    Some((model, tol))
}

/// The golden generations each path runs in CI (indices into generations.json's cases): SmolLM2
/// every case once, one (the chat prompt) with the GPU-style kernels, which cost lavapipe 4x
/// more a token; Gemma (raw prompts only) two on the f32 and f16 paths, one GPU-style: 0, 2, 4,
/// 5 and 7 (1, 3 and 6 on the CPU reference; 6 on the packed path in the ignored test).
fn cases(reference: Reference, path: Path) -> &'static [usize] {
    match (reference, path) {
        (SmolLm2, Path::F32) => &[0, 5],
        (SmolLm2, Path::F16) => &[2, 6],
        (SmolLm2, Path::PackedF16Kv) => &[1, 3, 7],
        (SmolLm2, Path::GpuStyle) => &[4],
        (SmolLm2, Path::Int8) => &[3],
        (SmolLm2, Path::Coop) => &[1],
        (Gemma3, Path::F32) => &[2, 4],
        (Gemma3, Path::F16) => &[5, 7],
        (Gemma3, Path::PackedF16Kv) => &[6],
        (Gemma3, Path::GpuStyle) => &[0],
        (Gemma3, Path::Int8) => &[2],
        (Gemma3, Path::Coop) => &[4],
    }
}

/// The golden generations numbered in `cases`: greedy tokens identical to the golden ones for `steps`
/// tokens (up to a step whose golden top-1/top-2 margin is below the path's `flip_margin`, where
/// the comparison of that generation ends), and the top-20 logits within the tolerance at every
/// recorded step (the last prompt position, then decode steps: all 9 when `steps` >= 8). Past
/// the recorded steps decoding is pipelined as the engine runs it: the step for the next token
/// is submitted before that token is read, taking it from GPU memory.
fn check_generations(reference: Reference, model: &mut GpuModel, tol: &Tolerances, steps: usize, cases: &[usize]) {
    let golden = reference.golden("generations.json");
    let vocab = model.config.vocab_size;
    let mut logits = vec![0f32; vocab];
    let (mut max_diff, mut compared) = (0f64, 0);
    for &i in cases {
        let case = &golden["cases"][i];
        let name = case["name"].as_str().unwrap();
        let prompt = common::ids(&case["prompt_ids"]);
        let expected = common::ids(&case["generated_ids"]);
        let margins = common::floats(&case["top1_top2_margins"]);
        let recorded = |step: usize| case["top_logits"].as_array().unwrap().iter().find(|t| t["step"] == step);
        let mut check_logits = |logits: &[f32], step: usize, position: usize| {
            let top = recorded(step).unwrap();
            assert_eq!(top["position"].as_u64().unwrap() as usize, position, "{name} step {step}");
            for (id, want) in common::ids(&top["ids"]).iter().zip(common::floats(&top["logits"])) {
                let diff = (logits[*id as usize] as f64 - want).abs();
                max_diff = max_diff.max(diff);
                assert!(
                    diff < tol.logits,
                    "{name} step {step}: logit of {id} is {}, golden {want}",
                    logits[*id as usize]
                );
            }
            compared += 1;
        };
        let start = std::time::Instant::now();
        pollster::block_on(model.step(&prompt, 0, Readback::Logits(&mut logits))).unwrap();
        let prefill = start.elapsed().as_secs_f64();
        check_logits(&logits, 0, prompt.len() - 1);
        let mut next = webgpu_llm::sampling::argmax(&logits);
        let (mut same, mut ahead) = (0, None);
        for (step, pos) in (0..steps).zip(prompt.len()..) {
            if next != expected[step] {
                let margin = margins[step];
                assert!(
                    margin < tol.flip_margin,
                    "{name}: greedy token {step} is {next}, golden {} (margin {margin})",
                    expected[step]
                );
                break;
            }
            same += 1;
            if recorded(step + 1).is_some() {
                pollster::block_on(model.step(&[next], pos, Readback::Logits(&mut logits))).unwrap();
                check_logits(&logits, step + 1, pos);
                next = webgpu_llm::sampling::argmax(&logits);
            } else {
                let current = match ahead.take() {
                    Some(queued) => queued,
                    None => model.submit_greedy(Some(next), pos).unwrap(),
                };
                if step + 2 < steps {
                    ahead = Some(model.submit_greedy(None, pos + 1).unwrap());
                }
                next = pollster::block_on(model.read_greedy(current)).unwrap();
            }
        }
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "{name}: {same}/{steps} greedy tokens identical (prefill of {} tokens {prefill:.1} s, decode {:.1} s)",
            prompt.len(),
            secs - prefill
        );
    }
    eprintln!("max |logit - golden| over {compared} recorded steps: {max_diff:.2e}");
}

/// Teacher-forced perplexity of the golden passage's tokens at positions `from..to` (to the
/// passage's end when `to` is None) against the golden per-token NLLs of the same positions.
/// The positions before `from` are prefilled without logits, so a check past a long prefix (past
/// a sliding window, or 1024 keys) pays the LM head and the read-back only where it compares;
/// `from..decode_from` take the all-positions logits of prefill passes, `decode_from..` one
/// decode step each (the decode attention kernels, over as many keys).
fn check_perplexity(
    reference: Reference,
    model: &mut GpuModel,
    tol: &Tolerances,
    from: usize,
    decode_from: Option<usize>,
    to: Option<usize>,
) {
    let golden = reference.golden("perplexity.json");
    let all = common::ids(&golden["ids"]);
    let ids = &all[..to.map_or(all.len(), |p| p.min(all.len()))];
    let golden_nll = &common::floats(&golden["nll"])[from..ids.len() - 1];
    let decode_from = decode_from.unwrap_or(ids.len()).clamp(from, ids.len());
    let vocab = model.config.vocab_size;
    let start = std::time::Instant::now();
    let rows = model.pass_rows();
    for (c, tokens) in ids[..from].chunks(rows).enumerate() {
        pollster::block_on(model.step(tokens, c * rows, Readback::None)).unwrap();
    }
    // Submitted is not done: the time printed below is the prefill's, not the next phase's.
    model.gpu.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let prefilled = start.elapsed().as_secs_f64();
    let chunk = model.all_logits_chunk();
    let mut nll = Vec::new();
    for (c, tokens) in ids[from..decode_from].chunks(chunk).enumerate() {
        let start = from + c * chunk;
        let logits = pollster::block_on(model.logits_all(tokens, start)).unwrap();
        for (t, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(&target) = ids.get(start + t + 1) else { break };
            nll.push(common::nll(row, target));
        }
    }
    let all_logits = start.elapsed().as_secs_f64() - prefilled;
    let mut row = vec![0f32; vocab];
    for pos in decode_from..ids.len() - 1 {
        pollster::block_on(model.step(&ids[pos..pos + 1], pos, Readback::Logits(&mut row))).unwrap();
        nll.push(common::nll(&row, ids[pos + 1]));
    }
    let decoded = start.elapsed().as_secs_f64() - prefilled - all_logits;
    eprintln!(
        "prefill of {from} positions {prefilled:.1} s, all-position logits of {} {all_logits:.1} s, {} decode steps \
         {decoded:.1} s",
        decode_from - from,
        (ids.len() - 1).saturating_sub(decode_from)
    );
    assert_eq!(nll.len(), golden_nll.len());
    let worst = nll.iter().zip(golden_nll).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let ppl = (nll.iter().sum::<f64>() / nll.len() as f64).exp();
    let want = (golden_nll.iter().sum::<f64>() / golden_nll.len() as f64).exp();
    eprintln!(
        "perplexity over positions {from}..{} {ppl:.5} (golden {want:.5}), max |dNLL| {worst:.2e}",
        ids.len() - 1
    );
    assert!(((ppl - want) / want).abs() < tol.perplexity_rel, "perplexity {ppl}, golden {want}");
}

/// SmolLM2 on `path`: its two golden prompts for 8 tokens (12 on the f32 path: past the
/// recorded steps, pipelined greedy decoding).
fn smollm2_generations(path: Path) {
    let _t = Timer::new(&format!("SmolLM2 generations on the {path:?} path"));
    if let Some((mut model, tol)) = load(SmolLm2, path) {
        let steps = if path == Path::F32 { 12 } else { 8 };
        check_generations(SmolLm2, &mut model, tol, steps, cases(SmolLm2, path));
    }
}

#[test]
fn f32_path_greedy_tokens_and_logits_match_the_golden_data() {
    smollm2_generations(Path::F32);
}

/// The passage's first 112 positions: 104 from prefill passes, the last 8 one decode step each.
#[test]
fn f32_path_perplexity_matches_the_golden_data() {
    let _t = Timer::new("SmolLM2 perplexity 0..112 on the F32 path");
    let (mut model, tol) = load(SmolLm2, Path::F32).unwrap();
    check_perplexity(SmolLm2, &mut model, tol, 0, Some(104), Some(113));
}

#[test]
fn f16_path_greedy_tokens_and_logits_match_the_golden_data() {
    smollm2_generations(Path::F16);
}

/// The passage's first 128 positions from prefill passes.
#[test]
fn f16_path_perplexity_matches_the_golden_data() {
    let _t = Timer::new("SmolLM2 perplexity 0..128 on the F16 path");
    if let Some((mut model, tol)) = load(SmolLm2, Path::F16) {
        check_perplexity(SmolLm2, &mut model, tol, 0, None, Some(129));
    }
}

#[test]
fn packed_f16_kv_greedy_tokens_and_logits_match_the_golden_data() {
    smollm2_generations(Path::PackedF16Kv);
}

#[test]
fn gpu_style_kernels_give_the_golden_greedy_tokens_and_logits() {
    smollm2_generations(Path::GpuStyle);
}

/// The int8 activations (GPU-style kernels): a golden generation, and the passage's first 64
/// positions, 0..56 from a prefill pass (the int8 gemm), 56..64 one decode step each (the
/// int8 gemv).
#[test]
fn int8_path_greedy_tokens_logits_and_perplexity_match_the_golden_data() {
    let _t = Timer::new("SmolLM2 generations and perplexity 0..64 on the Int8 path");
    let (mut model, tol) = load(SmolLm2, Path::Int8).unwrap();
    check_generations(SmolLm2, &mut model, tol, 8, cases(SmolLm2, Path::Int8));
    check_perplexity(SmolLm2, &mut model, tol, 0, Some(56), Some(65));
}

/// The prefill gemms on cooperative matrices (GPU-style kernels): a golden generation, and the
/// passage's first 64 positions, 0..56 from a prefill pass (the coop gemm), 56..64 one decode
/// step each; where the adapter has them.
#[test]
fn coop_path_greedy_tokens_logits_and_perplexity_match_the_golden_data() {
    let _t = Timer::new("SmolLM2 generations and perplexity 0..64 on the Coop path");
    if let Some((mut model, tol)) = load(SmolLm2, Path::Coop) {
        check_generations(SmolLm2, &mut model, tol, 8, cases(SmolLm2, Path::Coop));
        check_perplexity(SmolLm2, &mut model, tol, 0, Some(56), Some(65));
    }
}

/// Gemma's K-quants, Q5_0 and Q8_0 and its wider activations through the coop gemm.
#[test]
fn gemma3_coop_path_gives_the_golden_greedy_tokens_and_logits() {
    let _t = Timer::new("Gemma 3 generations on the Coop path");
    if let Some((mut model, tol)) = load(Gemma3, Path::Coop) {
        check_generations(Gemma3, &mut model, tol, 4, cases(Gemma3, Path::Coop));
    }
}

/// Gemma 3 270M Q4_K_M: K-quants and the gemma3 plan (post-norms, q/k norms, GELU, NeoX RoPE,
/// head_dim 256, the 262144-row tied head split across bindings) on the GPU. The f32 path's
/// perplexity compares the passage's first 28 positions (each reads back a 262144-wide row):
/// 0..24 from a prefill pass, 24..28 one decode step each.
#[test]
fn gemma3_f32_path_greedy_tokens_logits_and_perplexity_match_the_golden_data() {
    let _t = Timer::new("Gemma 3 generations and perplexity 0..28 on the F32 path");
    let (mut model, tol) = load(Gemma3, Path::F32).unwrap();
    check_generations(Gemma3, &mut model, tol, 8, cases(Gemma3, Path::F32));
    check_perplexity(Gemma3, &mut model, tol, 0, Some(24), Some(29));
}

/// The passage's first 64 positions from one prefill pass.
#[test]
fn gemma3_f16_path_greedy_tokens_logits_and_perplexity_match_the_golden_data() {
    let _t = Timer::new("Gemma 3 generations and perplexity 0..64 on the F16 path");
    if let Some((mut model, tol)) = load(Gemma3, Path::F16) {
        check_generations(Gemma3, &mut model, tol, 8, cases(Gemma3, Path::F16));
        check_perplexity(Gemma3, &mut model, tol, 0, None, Some(65));
    }
}

/// The GPU-style kernels (fused norms, subgroups) on Gemma's layer plan. (Gemma's packed-f16 KV
/// path: the ignored test below.)
#[test]
fn gemma3_gpu_style_kernels_give_the_golden_greedy_tokens_and_logits() {
    let _t = Timer::new("Gemma 3 generations on the GpuStyle path");
    let (mut model, tol) = load(Gemma3, Path::GpuStyle).unwrap();
    // 4 tokens (5 recorded steps): a Gemma token costs lavapipe seconds with these kernels.
    check_generations(Gemma3, &mut model, tol, 4, cases(Gemma3, Path::GpuStyle));
}

/// Gemma's tensors 640 values wide are Q5_0 and Q8_0 (not whole K-quant super-blocks of 256):
/// those take int8 activations.
#[test]
fn gemma3_int8_path_gives_the_golden_greedy_tokens_and_logits() {
    let _t = Timer::new("Gemma 3 generations on the Int8 path");
    let (mut model, tol) = load(Gemma3, Path::Int8).unwrap();
    check_generations(Gemma3, &mut model, tol, 4, cases(Gemma3, Path::Int8));
}

/// Every golden generation on every path, 32 tokens (SmolLM2) and 16 (Gemma): what CI ran
/// before its time was cut (tens of minutes on lavapipe).
#[test]
#[ignore]
fn every_golden_generation_on_every_path() {
    for path in PATHS {
        if let Some((mut model, tol)) = load(SmolLm2, path) {
            check_generations(SmolLm2, &mut model, tol, 32, &[0, 1, 2, 3, 4, 5, 6, 7]);
        }
        if let Some((mut model, tol)) = load(Gemma3, path) {
            check_generations(Gemma3, &mut model, tol, 16, &[0, 1, 2, 3, 4, 5, 6, 7]);
        }
    }
}

/// The whole passage on every path: SmolLM2's 1130 positions (past 1024 keys), Gemma's 1074
/// (past the 512-key window; on the f32 path it matched: 18.92253, golden 18.92252).
#[test]
#[ignore]
fn whole_passage_perplexity_on_every_path() {
    for path in PATHS {
        if let Some((mut model, tol)) = load(SmolLm2, path) {
            check_perplexity(SmolLm2, &mut model, tol, 0, None, None);
        }
        if let Some((mut model, tol)) = load(Gemma3, path) {
            check_perplexity(Gemma3, &mut model, tol, 0, None, None);
        }
    }
}
