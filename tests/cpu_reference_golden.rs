//! The CPU f32 reference forward pass against Hugging Face transformers (golden data): greedy
//! continuations token for token, top-20 logits, and the passage's perplexity.

mod common;

use webgpu_llm::model::Logits;
use webgpu_llm::sampling::argmax;

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

/// Every golden generation: 64 greedy tokens identical, and the top-20 logits at each recorded
/// step (step 0 is the last prompt position) within LOGIT_TOLERANCE.
#[test]
fn greedy_generations_and_logits_match_transformers() {
    let model = common::cpu_model();
    let golden = common::golden("generations.json");
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    let mut max_diff = 0f64;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt = common::ids(&case["prompt_ids"]);
        let expected = common::ids(&case["generated_ids"]);
        let top: Vec<&serde_json::Value> = case["top_logits"].as_array().unwrap().iter().collect();

        let mut cache = model.new_cache();
        let mut logits = model.forward(&mut cache, &prompt, Logits::Last).unwrap();
        let mut generated = Vec::new();
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
            generated.push(next);
            assert_eq!(next, want, "{name}: greedy token {step} differs; so far {generated:?}");
            logits = model.forward(&mut cache, &[next], Logits::Last).unwrap();
        }
    }
    eprintln!("max |logit - golden| over all recorded steps: {max_diff:.2e}");
}

/// Teacher-forced perplexity over the passage, run through the KV cache in chunks.
#[test]
fn passage_perplexity_matches_transformers() {
    let model = common::cpu_model();
    let golden = common::golden("perplexity.json");
    let ids = common::ids(&golden["ids"]);
    let golden_nll = common::floats(&golden["nll"]);
    let mut cache = model.new_cache();
    let vocab = model.config.vocab_size;
    let mut nll = Vec::with_capacity(ids.len() - 1);
    for (c, chunk) in ids.chunks(200).enumerate() {
        let logits = model.forward(&mut cache, chunk, Logits::All).unwrap();
        for (t, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(&target) = ids.get(c * 200 + t + 1) else { break };
            nll.push(common::nll(row, target));
        }
    }
    assert_eq!(nll.len(), golden_nll.len());
    let worst = nll.iter().zip(&golden_nll).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-3, "per-token NLL differs by up to {worst}");
    let ppl = (nll.iter().sum::<f64>() / nll.len() as f64).exp();
    let want = golden["perplexity"].as_f64().unwrap();
    assert!(((ppl - want) / want).abs() < 1e-3, "perplexity {ppl}, golden {want}");
    eprintln!("perplexity {ppl:.6} (golden {want:.6}), max |dNLL| {worst:.2e}");
}
