//! The whole GPU model (on lavapipe when there is no GPU) against the golden data, on the f32
//! path and on the f16 path (f16 KV cache, subgroups) where the adapter has shader-f16.

use crate::common;

use common::Reference::{self, Gemma3, SmolLm2};
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, KernelStyle, KvStore, Readback};

fn load(reference: Reference, force_f32: bool) -> GpuModel {
    load_with(reference, force_f32, None)
}

/// `style`: override the kernel variants chosen from the adapter type.
fn load_with(reference: Reference, force_f32: bool, style: Option<KernelStyle>) -> GpuModel {
    load_options(reference, GpuOptions { force_f32, ..Default::default() }, style)
}

fn load_options(reference: Reference, options: GpuOptions, style: Option<KernelStyle>) -> GpuModel {
    let mut gpu = pollster::block_on(Gpu::new(options)).expect("a GPU adapter (lavapipe in CI)");
    if let Some(style) = style {
        gpu.style = style;
    }
    pollster::block_on(GpuModel::load(gpu, reference.gguf(), reference.bytes(), 2048, &mut |_, _| {}))
        .expect("the model uploads")
}

/// Loads the adapter's own path, or None (with a note) when it has no shader-f16.
fn load_f16(reference: Reference) -> Option<GpuModel> {
    // Asked of the adapter before the model is uploaded (lavapipe has no shader-f16).
    let gpu = pollster::block_on(Gpu::new(GpuOptions::default())).expect("a GPU adapter (lavapipe in CI)");
    if !gpu.f16 {
        eprintln!("the adapter has no shader-f16: the f16 path does not exist here");
        return None;
    }
    let model = pollster::block_on(GpuModel::load(gpu, reference.gguf(), reference.bytes(), 2048, &mut |_, _| {}))
        .expect("the model uploads");
    Some(model)
}

struct Tolerances {
    logits: f64,
    perplexity_rel: f64,
    /// A greedy token may differ from the golden one only at a step whose golden top-1/top-2
    /// margin is below this (then the comparison of that generation ends).
    flip_margin: f64,
}

const F32: Tolerances = Tolerances { logits: 2e-3, perplexity_rel: 1e-3, flip_margin: 0.0 };
const F16: Tolerances = Tolerances { logits: 5e-2, perplexity_rel: 1e-2, flip_margin: 0.05 };

/// The golden generations, half on each path (two raw prompts and two chat prompts each): every
/// generation is checked on one path or the other, and a path costs lavapipe half the time.
const EVEN: &[usize] = &[0, 2, 4, 6];
const ODD: &[usize] = &[1, 3, 5, 7];

/// The golden generations numbered in `cases`: greedy tokens identical to the golden ones for `steps`
/// tokens (on the f16 path up to a step whose golden top-1/top-2 margin is below `flip_margin`),
/// and the top-20 logits within the tolerance at every recorded step (the last prompt position,
/// then decode steps). Past the recorded steps decoding is pipelined as the engine runs it: the
/// step for the next token is submitted before that token is read, taking it from GPU memory.
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
        let mut check_logits = |logits: &[f32], step: usize| {
            let top = recorded(step).unwrap();
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
        pollster::block_on(model.step(&prompt, 0, Readback::Logits(&mut logits))).unwrap();
        check_logits(&logits, 0);
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
                check_logits(&logits, step + 1);
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
        eprintln!("{name}: {same}/{steps} greedy tokens identical");
    }
    eprintln!("max |logit - golden| over {compared} recorded steps: {max_diff:.2e}");
}

/// Teacher-forced perplexity of the golden passage's tokens `from..to` (positions; the whole
/// passage when `to` is None) against the golden per-token NLLs of the same positions. The
/// positions before `from` are prefilled without logits, so a check past a long prefix (past a
/// sliding window, or 1024 keys) pays the LM head and the read-back only where it compares.
fn check_perplexity(reference: Reference, model: &mut GpuModel, tol: &Tolerances, from: usize, to: Option<usize>) {
    let golden = reference.golden("perplexity.json");
    let all = common::ids(&golden["ids"]);
    let ids = &all[..to.map_or(all.len(), |p| p.min(all.len()))];
    let golden_nll = &common::floats(&golden["nll"])[from..ids.len() - 1];
    let vocab = model.config.vocab_size;
    for (c, tokens) in ids[..from].chunks(webgpu_llm::gpu::PREFILL_CHUNK).enumerate() {
        pollster::block_on(model.step(tokens, c * webgpu_llm::gpu::PREFILL_CHUNK, Readback::None)).unwrap();
    }
    let chunk = model.all_logits_chunk();
    let mut nll = Vec::new();
    for (c, tokens) in ids[from..].chunks(chunk).enumerate() {
        let start = from + c * chunk;
        let logits = pollster::block_on(model.logits_all(tokens, start)).unwrap();
        for (t, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(&target) = ids.get(start + t + 1) else { break };
            nll.push(common::nll(row, target));
        }
    }
    assert_eq!(nll.len(), golden_nll.len());
    let ppl = (nll.iter().sum::<f64>() / nll.len() as f64).exp();
    let want = (golden_nll.iter().sum::<f64>() / golden_nll.len() as f64).exp();
    eprintln!("perplexity over positions {from}..{} {ppl:.5} (golden {want:.5})", ids.len() - 1);
    assert!(((ppl - want) / want).abs() < tol.perplexity_rel, "perplexity {ppl}, golden {want}");
}

#[test]
fn f32_path_greedy_tokens_and_logits_match_the_golden_data() {
    let mut model = load(SmolLm2, true);
    assert!(!model.gpu.f16 && !model.gpu.subgroups);
    check_generations(SmolLm2, &mut model, &F32, 12, EVEN);
}

/// The first 384 positions (attention at every length up to past 1024 keys is checked kernel by
/// kernel in gpu_kernels, and over the whole passage by the ignored test below: lavapipe takes
/// minutes for its prefill).
#[test]
fn f32_path_perplexity_matches_the_golden_data() {
    check_perplexity(SmolLm2, &mut load(SmolLm2, true), &F32, 0, Some(384));
}

/// The whole passage, 1130 positions (attention past 1024 keys), on both paths: minutes on
/// lavapipe, so `cargo test --release --test gpu_golden -- --ignored`.
#[test]
#[ignore]
fn whole_passage_perplexity_matches_the_golden_data_on_both_paths() {
    check_perplexity(SmolLm2, &mut load(SmolLm2, true), &F32, 0, None);
    if let Some(mut model) = load_f16(SmolLm2) {
        check_perplexity(SmolLm2, &mut model, &F16, 0, None);
    }
}

#[test]
fn f16_path_greedy_tokens_and_logits_match_the_golden_data() {
    if let Some(mut model) = load_f16(SmolLm2) {
        check_generations(SmolLm2, &mut model, &F16, 12, ODD);
    }
}

/// Without shader-f16 (SwiftShader in the browser, GPUs without the feature) the KV cache is f16
/// packed two per word: f32 arithmetic, the f16 path's bounds.
#[test]
fn packed_f16_kv_greedy_tokens_and_logits_match_the_golden_data() {
    let mut model = load_options(SmolLm2, GpuOptions { force_f32: true, packed_kv: true, ..Default::default() }, None);
    assert_eq!(model.gpu.kv, KvStore::PackedF16);
    check_generations(SmolLm2, &mut model, &F16, 8, &[2, 7]);
}

/// The first 256 positions (the f32 path takes 384; the whole passage: the ignored test above).
#[test]
fn f16_path_perplexity_matches_the_golden_data() {
    if let Some(mut model) = load_f16(SmolLm2) {
        check_perplexity(SmolLm2, &mut model, &F16, 0, Some(256));
    }
}

/// lavapipe is a CPU adapter, so the tests above run the CPU-style kernels; this one runs the
/// GPU-style ones (32 lanes per row, subgroup reductions, RMSNorm fused into the gemv, RoPE and
/// the KV write in the q|k|v epilogue, tiled prefill attention) on a raw and a chat prompt
/// (each kernel is checked alone in both styles in gpu_kernels; they cost lavapipe 4x more).
#[test]
fn gpu_style_kernels_give_the_golden_greedy_tokens_and_logits() {
    let mut model = load_with(SmolLm2, false, Some(KernelStyle::Gpu));
    let tol = if model.gpu.f16 { &F16 } else { &F32 };
    check_generations(SmolLm2, &mut model, tol, 8, &[0, 7]);
}

/// Gemma 3 270M Q4_K_M: K-quants and the gemma3 plan (post-norms, q/k norms, GELU, NeoX RoPE,
/// head_dim 256) on the GPU, two raw prompts a path (all eight: tests/gemma3_golden on the CPU
/// reference). The f32 perplexity compares positions 480 to 576, across 512 where the
/// sliding-window layers start dropping keys (the positions before are prefilled without
/// logits: each compared position reads back a 262144-wide row; the full 1074 positions matched
/// too: 18.92253, golden 18.92252).
#[test]
fn gemma3_f32_path_greedy_tokens_logits_and_perplexity_match_the_golden_data() {
    let mut model = load(Gemma3, true);
    check_generations(Gemma3, &mut model, &F32, 8, &[2, 4]);
    check_perplexity(Gemma3, &mut model, &F32, 480, Some(576));
}

#[test]
fn gemma3_f16_path_greedy_tokens_logits_and_perplexity_match_the_golden_data() {
    if let Some(mut model) = load_f16(Gemma3) {
        check_generations(Gemma3, &mut model, &F16, 8, &[5, 7]);
        // Positions 192 to 256 (the f32 path crosses the sliding window).
        check_perplexity(Gemma3, &mut model, &F16, 192, Some(256));
    }
}

/// The GPU-style kernels (fused norms, subgroups) on Gemma's layer plan.
#[test]
fn gemma3_gpu_style_kernels_give_the_golden_logits() {
    let mut model = load_with(Gemma3, false, Some(KernelStyle::Gpu));
    let tol = if model.gpu.f16 { &F16 } else { &F32 };
    check_generations(Gemma3, &mut model, tol, 2, &[0, 2]);
}

#[test]
fn a_decode_step_creates_nothing_submits_once_and_reads_back_four_bytes() {
    let mut model = load(SmolLm2, false);
    let prompt = [504u32, 3575, 282, 4649, 314];
    let mut next = pollster::block_on(model.step(&prompt, 0, Readback::Argmax)).unwrap().unwrap();
    let before = model.gpu.counters();
    // 20 steps: past a 16-token KV block, where a sequence's table grows.
    for pos in prompt.len()..prompt.len() + 20 {
        next = pollster::block_on(model.step(&[next], pos, Readback::Argmax)).unwrap().unwrap();
    }
    let d = model.gpu.counters() - before;
    assert_eq!((d.buffers, d.bind_groups, d.pipelines), (0, 0, 0), "objects created in the decode loop: {d:?}");
    assert_eq!(d.submissions, 20);
    assert_eq!(d.bytes_read_back, 20 * 4);
}
