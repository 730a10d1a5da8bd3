//! The CPU f32 reference forward pass on a second, real model — Gemma 3 270M in Q4_K_M (K-quants,
//! mixed block types, the gemma3 layer plan: embedding scale, four norms per layer, q/k norms,
//! sliding-window layers with their own RoPE base, GELU, NeoX RoPE, head_dim 256) — against
//! Hugging Face transformers (golden data in gemma3-270m/).

use crate::common;

use common::Reference::Gemma3;
use webgpu_llm::arch::{Activation, RopeStyle};

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
    let _t = crate::Timer::new("cpu_gemma3::greedy_generations_and_logits_match_transformers");
    let (max_diff, same) = common::check_cpu_generations(Gemma3, LOGIT_TOLERANCE);
    eprintln!("{same}/512 greedy tokens identical; max |logit - golden| over all recorded steps: {max_diff:.2e}");
}

/// Teacher-forced perplexity over the 1074-token passage: positions past 512 exercise the
/// sliding window.
#[test]
fn passage_perplexity_matches_transformers() {
    let _t = crate::Timer::new("cpu_gemma3::passage_perplexity_matches_transformers");
    let (ppl, want, worst) = common::cpu_passage_perplexity(Gemma3, 128);
    eprintln!("perplexity {ppl:.6} (golden {want:.6}), max |dNLL| {worst:.2e}");
    assert!(((ppl - want) / want).abs() < 1e-3, "perplexity {ppl}, golden {want}");
    assert!(worst < 1e-3, "per-token NLL differs by up to {worst}");
}
