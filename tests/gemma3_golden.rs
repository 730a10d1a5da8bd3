//! The CPU f32 reference forward pass on a second, real model — Gemma 3 270M in Q4_K_M (K-quants,
//! mixed block types, the gemma3 layer plan: embedding scale, four norms per layer, q/k norms,
//! sliding-window layers with their own RoPE base, GELU, NeoX RoPE, head_dim 256) — against
//! Hugging Face transformers (golden data in gemma3-270m/).

mod common;

use common::Reference::Gemma3;
use webgpu_llm::arch::{Activation, RopeStyle};
use webgpu_llm::model::Logits;
use webgpu_llm::sampling::argmax;

const LOGIT_TOLERANCE: f64 = 1e-3;

#[test]
fn the_plan_is_gemma3s() {
    let plan = &Gemma3.cpu_model().plan;
    let meta = Gemma3.golden("meta.json");
    let a = &meta["architecture"];
    let c = &plan.config;
    assert_eq!((c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim), (18, 640, 4, 1, 256));
    assert_eq!(c.vocab_size, a["vocab_size"].as_u64().unwrap() as usize);
    assert_eq!(plan.activation, Activation::GeluTanh);
    assert_eq!(plan.embed_scale, Some(640f32.sqrt()));
    for (i, (l, kind)) in plan.layers.iter().zip(a["layer_types"].as_array().unwrap()).enumerate() {
        let sliding = kind == "sliding_attention";
        assert_eq!(l.window, sliding.then_some(512), "layer {i}");
        let base = a["rope_parameters"][kind.as_str().unwrap()]["rope_theta"].as_f64().unwrap();
        assert_eq!(plan.ropes[l.rope].base, base, "layer {i}");
        assert_eq!(plan.ropes[l.rope].style, RopeStyle::NeoX);
        assert!(l.qk_norm.is_some() && l.post_attn_norm.is_some() && l.post_ffn_norm.is_some());
    }
}

/// Every golden generation: 64 greedy tokens identical up to any step where the golden top-1 /
/// top-2 margin is within our logit tolerance (a flip there is not a discrepancy), and the top-20
/// logits at each recorded step within LOGIT_TOLERANCE.
#[test]
fn greedy_generations_and_logits_match_transformers() {
    let model = Gemma3.cpu_model();
    let golden = Gemma3.golden("generations.json");
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    let mut max_diff = 0f64;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt = common::ids(&case["prompt_ids"]);
        let expected = common::ids(&case["generated_ids"]);
        let margins = common::floats(&case["top1_top2_margins"]);
        let top: Vec<&serde_json::Value> = case["top_logits"].as_array().unwrap().iter().collect();
        let mut cache = model.new_cache();
        let mut logits = model.forward(&mut cache, &prompt, Logits::Last).unwrap();
        let mut compared = 0;
        for (step, &want) in expected.iter().enumerate() {
            if let Some(t) = top.iter().find(|t| t["step"].as_u64() == Some(step as u64)) {
                assert_eq!(t["position"].as_u64().unwrap() as usize, cache.len() - 1);
                for (id, want) in common::ids(&t["ids"]).iter().zip(common::floats(&t["logits"])) {
                    let diff = (logits[*id as usize] as f64 - want).abs();
                    max_diff = max_diff.max(diff);
                    assert!(
                        diff < LOGIT_TOLERANCE,
                        "{name} step {step}: logit of {id} is {}, golden {want}",
                        logits[*id as usize]
                    );
                }
            }
            let next = argmax(&logits);
            if next != want {
                assert!(
                    margins[step] < 2.0 * LOGIT_TOLERANCE,
                    "{name}: greedy token {step} is {next}, golden {want} (golden margin {})",
                    margins[step]
                );
                break;
            }
            compared += 1;
            logits = model.forward(&mut cache, &[next], Logits::Last).unwrap();
        }
        eprintln!("{name}: {compared}/{} greedy tokens identical", expected.len());
    }
    eprintln!("max |logit - golden| over all recorded steps: {max_diff:.2e}");
}

/// Teacher-forced perplexity over the 1074-token passage: positions past 512 exercise the
/// sliding window.
#[test]
fn passage_perplexity_matches_transformers() {
    let model = Gemma3.cpu_model();
    let golden = Gemma3.golden("perplexity.json");
    let ids = common::ids(&golden["ids"]);
    let golden_nll = common::floats(&golden["nll"]);
    let mut cache = model.new_cache();
    let vocab = model.config.vocab_size;
    let mut nll = Vec::with_capacity(ids.len() - 1);
    for (c, chunk) in ids.chunks(128).enumerate() {
        let logits = model.forward(&mut cache, chunk, Logits::All).unwrap();
        for (t, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(&target) = ids.get(c * 128 + t + 1) else { break };
            nll.push(common::nll(row, target));
        }
    }
    assert_eq!(nll.len(), golden_nll.len());
    let worst = nll.iter().zip(&golden_nll).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let ppl = (nll.iter().sum::<f64>() / nll.len() as f64).exp();
    let want = golden["perplexity"].as_f64().unwrap();
    eprintln!("perplexity {ppl:.6} (golden {want:.6}), max |dNLL| {worst:.2e}");
    assert!(((ppl - want) / want).abs() < 1e-3, "perplexity {ppl}, golden {want}");
    assert!(worst < 1e-3, "per-token NLL differs by up to {worst}");
}
