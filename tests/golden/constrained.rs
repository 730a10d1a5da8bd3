//! Structured output on SmolLM2 against an independent truth: transformers' float32 logits with
//! llguidance's Python package computing the allowed tokens at each step, the argmax among them
//! (tests/data/constrained, made by scripts/gen-constrained-refs.py). JSON schemas (required
//! fields, an enum, nested objects, arrays with bounds, a pattern, anyOf), JSON object mode, a
//! regex and a Lark grammar.

use crate::common;
use crate::Timer;

use std::collections::HashMap;
use webgpu_llm::batcher::{BatchEvent, Batcher, RequestId};
use webgpu_llm::constraint::{Constraint, ConstraintSpec, Grammars};
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, StopReason};
use webgpu_llm::gguf::Gguf;
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::model::ModelConfig;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::tokenizer::Tokenizer;
use webgpu_llm::tools::ToolFormat;

fn reference() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/constrained/smollm2.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn spec(case: &serde_json::Value) -> ConstraintSpec {
    let c = &case["constraint"];
    match case["kind"].as_str().unwrap() {
        "json_schema" => ConstraintSpec::JsonSchema(c.clone()),
        "json_object" => ConstraintSpec::JsonObject,
        "regex" => ConstraintSpec::Regex(c.as_str().unwrap().into()),
        "lark" => ConstraintSpec::Lark(c.as_str().unwrap().into()),
        other => panic!("unknown kind {other}"),
    }
}

fn engine(backend: BackendKind) -> Engine {
    let opts = LoadOptions { backend, context_length: Some(512), gpu: GpuOptions::default() };
    pollster::block_on(Engine::load(common::model_bytes(), opts, &mut |_, _| {})).unwrap()
}

/// The model's tokenizer and its constraint compiler without its weights: the masks need no
/// forward pass.
struct Vocab {
    tokenizer: Tokenizer,
    grammars: Grammars,
}

impl Vocab {
    fn compile_constraint(&self, spec: &ConstraintSpec) -> webgpu_llm::error::Result<Constraint> {
        self.grammars.compile(spec)
    }
}

fn vocab() -> Vocab {
    let gguf = Gguf::parse(common::model_bytes()).unwrap();
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
    let grammars =
        Grammars::new(&tokenizer, ModelConfig::from_gguf(&gguf).unwrap().vocab_size, ToolFormat::Hermes).unwrap();
    Vocab { tokenizer, grammars }
}

/// llguidance in Rust allows the same tokens as llguidance in Python at every step of every
/// reference output: the count and the sum of the allowed ids, and the ids themselves at step 0.
#[test]
fn masks_match_python_llguidance_at_every_step() {
    let r = reference();
    let e = vocab();
    let mut mask = Vec::new();
    for case in r["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut c = e.compile_constraint(&spec(case)).unwrap();
        let greedy = common::ids(&case["greedy_ids"]);
        let counts = case["allowed_counts"].as_array().unwrap();
        let sums = case["allowed_id_sums"].as_array().unwrap();
        for (step, &token) in greedy.iter().enumerate() {
            c.fill_mask(&mut mask).unwrap();
            let allowed: Vec<u64> =
                (0..mask.len() * 32).filter(|&i| mask[i / 32] >> (i % 32) & 1 == 1).map(|i| i as u64).collect();
            assert_eq!(allowed.len() as u64, counts[step].as_u64().unwrap(), "{name} step {step}: allowed tokens");
            assert_eq!(
                allowed.iter().sum::<u64>(),
                sums[step].as_u64().unwrap(),
                "{name} step {step}: sum of allowed ids"
            );
            assert_eq!(c.allowed(), allowed.len());
            if step == 0 {
                assert_eq!(
                    allowed,
                    case["step0_mask"]["allowed_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_u64().unwrap())
                        .collect::<Vec<_>>(),
                    "{name}"
                );
            }
            assert!(!c.is_done(), "{name} step {step}: done before the reference's last token");
            c.accept(token).unwrap();
        }
        // The grammar is complete: only the end of sequence may follow.
        assert!(c.is_done(), "{name}: not complete after the reference's tokens");
        c.fill_mask(&mut mask).unwrap();
        let allowed: Vec<u32> =
            (0..mask.len() as u32 * 32).filter(|&i| mask[i as usize / 32] >> (i % 32) & 1 == 1).collect();
        let mut stops = e.tokenizer.stop_ids.clone();
        stops.sort();
        assert_eq!(allowed, stops, "{name}: after the output, the stop tokens alone");
    }
}

/// Constrained greedy decoding gives the reference's tokens, then the end of sequence (only stop
/// tokens follow a complete grammar), cases in one batch beside an unconstrained request, which
/// gives its own greedy tokens (constrained rows leave the others alone). The cases are split
/// between the GPU (its own path: constrained rows read their logits back) and the CPU, each
/// case on one (the masks are the same on both: the test above).
#[test]
fn constrained_greedy_decoding_gives_the_reference_tokens_in_one_batch() {
    let r = reference();
    let on_gpu = ["lark_answer", "regex_yes_no", "pattern_anyof", "person_flat"];
    for backend in [BackendKind::Gpu, BackendKind::Cpu] {
        let _t = Timer::new(&format!("constrained greedy on {backend:?}"));
        let mut e = engine(backend);
        let mut b = Batcher::new(&e, 128);
        let mut want: HashMap<RequestId, (String, Vec<u32>, bool)> = HashMap::new();
        let mine =
            |c: &&serde_json::Value| on_gpu.contains(&c["name"].as_str().unwrap()) == (backend == BackendKind::Gpu);
        for case in r["cases"].as_array().unwrap().iter().filter(mine) {
            let prompt = Prompt::Tokens(common::ids(&case["prompt_ids"]));
            let greedy = common::ids(&case["greedy_ids"]);
            // One case also reports its log-probabilities: in the distribution drawn from, where
            // the grammar allows one token it has probability 1.
            let top_candidates = if case["name"] == "lark_answer" { 2 } else { 0 };
            let opts = GenerateOptions {
                max_tokens: greedy.len() + 4,
                sampling: SamplingParams::greedy(),
                constraint: Some(spec(case)),
                top_candidates,
                ..Default::default()
            };
            let id = b.enqueue(Batcher::prepare(&e, &prompt, &opts).unwrap());
            want.insert(id, (case["name"].as_str().unwrap().to_string(), greedy, true));
            if let Some(free) = case.get("unconstrained_greedy_ids") {
                let free = common::ids(free);
                let opts = GenerateOptions {
                    max_tokens: free.len(),
                    sampling: SamplingParams::greedy(),
                    ..Default::default()
                };
                let id = b.enqueue(Batcher::prepare(&e, &prompt, &opts).unwrap());
                want.insert(id, (format!("{} unconstrained", case["name"].as_str().unwrap()), free, false));
            }
        }
        let mut got: HashMap<RequestId, (Vec<u32>, Option<StopReason>)> = HashMap::new();
        let mut logprobs: HashMap<RequestId, Vec<f32>> = HashMap::new();
        while !b.is_empty() {
            pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
                let g = got.entry(id).or_default();
                match ev {
                    BatchEvent::Token(t) => {
                        g.0.push(t.id);
                        if let Some(lp) = &t.logprob {
                            logprobs.entry(id).or_default().push(lp.logprob);
                        }
                    }
                    BatchEvent::Done(s) => g.1 = Some(s.stop_reason),
                    BatchEvent::Failed(err) => panic!("{backend:?}: {} failed: {err}", want[&id].0),
                    BatchEvent::Beams(_) => unreachable!(),
                }
                true
            }))
            .unwrap();
        }
        // Every case on one backend, and a free request beside them on each.
        let constrained = want.values().filter(|w| w.2).count();
        assert_eq!(constrained, if backend == BackendKind::Gpu { on_gpu.len() } else { 7 - on_gpu.len() });
        assert!(want.len() > constrained);
        if backend == BackendKind::Gpu {
            let case = r["cases"].as_array().unwrap().iter().find(|c| c["name"] == "lark_answer").unwrap();
            let (id, _) = want.iter().find(|(_, w)| w.0 == "lark_answer").unwrap();
            let counts = case["allowed_counts"].as_array().unwrap();
            let lps = &logprobs[id];
            assert_eq!(lps.len(), counts.len(), "a log-probability for each token");
            for (step, (lp, n)) in lps.iter().zip(counts).enumerate() {
                assert!(lp.is_finite() && *lp <= 0.0, "step {step}: {lp}");
                if n.as_u64() == Some(1) {
                    assert_eq!(*lp, 0.0, "step {step}: the one token allowed");
                }
            }
        }
        for (id, (name, ids, constrained)) in &want {
            let (got_ids, stop) = &got[id];
            assert_eq!(got_ids, ids, "{backend:?}: {name}");
            let end = if *constrained { StopReason::Eos } else { StopReason::MaxTokens };
            assert_eq!(*stop, Some(end), "{backend:?}: {name}");
        }
    }
}

/// What a constraint cannot be ends in an error naming the field, in bounded time: a schema
/// llguidance refuses, an unsatisfiable one, a broken regex and grammar, what would exhaust the
/// stack (a schema of 10^4 properties, nesting past 64 in a schema, a regex or a grammar);
/// a regex with catastrophic backtracking in a backtracking engine (llguidance's is
/// derivative-based) and references nested 60 deep compile and give a mask at once; chains of
/// 20000 references or rules do not crash.
#[test]
fn hostile_constraints_end_in_clear_errors_in_bounded_time() {
    let e = vocab();
    let props: serde_json::Map<String, serde_json::Value> =
        (0..10_000).map(|i| (format!("p{i}"), serde_json::json!({"type": "integer"}))).collect();
    let names: Vec<String> = props.keys().cloned().collect();
    let mut nested = serde_json::json!({"type": "integer"});
    for _ in 0..100 {
        nested = serde_json::json!({"type": "array", "items": nested});
    }
    let bad = [
        ConstraintSpec::JsonSchema(serde_json::json!({"type": "object", "properties": {"a": {"type": "strin"}}})),
        ConstraintSpec::JsonSchema(serde_json::json!({"type": "integer", "minimum": 5, "maximum": 1})),
        ConstraintSpec::Regex("(unclosed".into()),
        ConstraintSpec::Lark("start: undefined_rule".into()),
        ConstraintSpec::JsonSchema(serde_json::json!({"type": "object", "properties": props, "required": names})),
        ConstraintSpec::JsonSchema(nested),
        ConstraintSpec::Regex(format!("{}a{}", "(".repeat(5000), ")".repeat(5000))),
        ConstraintSpec::Lark(format!("start: {}\"a\"{}", "(".repeat(5000), ")".repeat(5000))),
    ];
    for spec in &bad {
        let err = e.compile_constraint(spec).err().unwrap_or_else(|| panic!("{spec:?} compiled"));
        assert_eq!(err.code(), "invalid-constraint", "{err}");
        assert!(err.to_string().starts_with(&format!("invalid {}", spec.field())), "{err}");
    }
    let mut mask = Vec::new();
    let mut c = e.compile_constraint(&ConstraintSpec::Regex("(a+)+b".into())).unwrap();
    c.fill_mask(&mut mask).unwrap();
    assert!(c.allowed() > 0);
    let mut defs = serde_json::Map::new();
    for i in 0..60 {
        defs.insert(
            format!("d{i}"),
            serde_json::json!({"type": "array", "items": {"$ref": format!("#/$defs/d{}", i + 1)}}),
        );
    }
    defs.insert("d60".into(), serde_json::json!({"type": "integer"}));
    let deep = serde_json::json!({"$ref": "#/$defs/d0", "$defs": defs});
    let mut c = e.compile_constraint(&ConstraintSpec::JsonSchema(deep)).unwrap();
    c.fill_mask(&mut mask).unwrap();
    // Only tokens of brackets can start an array of arrays.
    let allowed: Vec<u32> =
        (0..mask.len() as u32 * 32).filter(|&i| mask[i as usize / 32] >> (i % 32) & 1 == 1).collect();
    assert!(!allowed.is_empty());
    for id in allowed {
        let text = e.tokenizer.decode(&[id]).unwrap();
        assert!(text.starts_with('[') && text.chars().all(|c| c == '['), "{id}: {text:?}");
    }
    // Chains that are long but shallow: 20000 references each to the next, 20000 Lark rules
    // each naming the next. llguidance compiles them recursively (past this thread's stack);
    // they compile on the compiler's own thread, or fail with an error, never a crash.
    let mut defs = serde_json::Map::new();
    for i in 0..20_000 {
        defs.insert(format!("d{i}"), serde_json::json!({"$ref": format!("#/$defs/d{}", i + 1)}));
    }
    defs.insert("d20000".into(), serde_json::json!({"type": "integer"}));
    let chain = serde_json::json!({"$ref": "#/$defs/d0", "$defs": defs});
    let rules: String = (0..20_000).map(|i| format!("r{i}: r{}\n", i + 1)).collect();
    let lark = format!("start: r0\n{rules}r20000: \"a\"\n");
    for spec in [ConstraintSpec::JsonSchema(chain), ConstraintSpec::Lark(lark)] {
        match e.compile_constraint(&spec) {
            Ok(mut c) => c.fill_mask(&mut mask).unwrap(),
            Err(err) => assert_eq!(err.code(), "invalid-constraint", "{err}"),
        }
    }
}
