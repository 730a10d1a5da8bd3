//! The CPU f32 reference forward pass against Hugging Face transformers (golden data): greedy
//! continuations token for token, top-20 logits, and the passage's perplexity.

use crate::common;

const LOGIT_TOLERANCE: f64 = 1e-3;

#[test]
fn model_config_matches_the_golden_architecture() {
    let m = common::cpu_model();
    let a = &common::golden("meta.json")["architecture"];
    let c = &m.config;
    let n = |k: &str| a[k].as_u64().unwrap() as usize;
    assert_eq!(
        (
            c.n_layers,
            c.d_model,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.rope_dim,
            c.ffn_dim,
            c.vocab_size,
            c.context_length
        ),
        (
            n("n_layers"),
            n("d_model"),
            n("n_heads"),
            n("n_kv_heads"),
            n("head_dim"),
            n("rope_dim"),
            n("ffn_dim"),
            n("vocab_size"),
            n("context_length")
        )
    );
    assert_eq!(c.rope_base as f64, a["rope_freq_base"].as_f64().unwrap());
    assert_eq!(c.rms_eps as f64, a["rms_norm_eps"].as_f64().unwrap());
    assert_eq!(c.tied_output, a["tied_embeddings"].as_bool().unwrap());
}

/// Every golden generation: 64 greedy tokens identical (the default model's golden margins are
/// all far above the tolerance), and the top-20 logits at each recorded step (step 0 is the last
/// prompt position) within LOGIT_TOLERANCE.
#[test]
fn greedy_generations_and_logits_match_transformers() {
    let _t = crate::Timer::new("cpu_smollm2::greedy_generations_and_logits_match_transformers");
    let (max_diff, same) = common::check_cpu_generations(common::Reference::SmolLm2, LOGIT_TOLERANCE);
    assert_eq!(same, 8 * 64, "every greedy token identical");
    eprintln!("max |logit - golden| over all recorded steps: {max_diff:.2e}");
}

/// Teacher-forced perplexity over the passage, run through the KV cache in chunks.
#[test]
fn passage_perplexity_matches_transformers() {
    let _t = crate::Timer::new("cpu_smollm2::passage_perplexity_matches_transformers");
    let (ppl, want, worst) = common::cpu_passage_perplexity(common::Reference::SmolLm2, 200);
    assert!(worst < 1e-3, "per-token NLL differs by up to {worst}");
    assert!(((ppl - want) / want).abs() < 1e-3, "perplexity {ppl}, golden {want}");
    eprintln!("perplexity {ppl:.6} (golden {want:.6}), max |dNLL| {worst:.2e}");
}
