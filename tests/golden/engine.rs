//! The engine's own loops on SmolLM2 against transformers: `Engine::generate` of a golden chat
//! to its end-of-sequence token, and the log-probabilities the batcher gives the server's
//! `logprobs` (tests/server checks their OpenAI shapes on a tiny model).

use crate::common;
use crate::Timer;

use std::collections::HashMap;
use webgpu_llm::batcher::{BatchEvent, Batcher, RequestId};
use webgpu_llm::chat::Message;
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, StopReason};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;

fn engine(backend: BackendKind) -> Engine {
    let opts = LoadOptions { backend, context_length: Some(1024), gpu: GpuOptions::default() };
    pollster::block_on(Engine::load(common::model_bytes(), opts, &mut |_, _| {})).unwrap()
}

fn golden_case(name: &str) -> serde_json::Value {
    common::golden("generations.json")["cases"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap().clone()
}

fn messages(case: &serde_json::Value) -> Vec<Message> {
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

/// The chat template's prompt ids, the greedy ids and text up to the golden EOS, which stops
/// generation; on the GPU (the adapter's own path, greedy decoding pipelined) and the CPU.
#[test]
fn chat_generation_stops_at_eos_with_the_golden_text() {
    let case = golden_case("chat_capital_france");
    let messages = messages(&case);
    assert_eq!(messages, vec![Message::new("user", "What is the capital of France?")]);
    for backend in [BackendKind::Gpu, BackendKind::Cpu] {
        let _t = Timer::new(&format!("chat_capital_france to EOS on {backend:?}"));
        let mut e = engine(backend);
        assert_eq!(e.prompt_tokens(&Prompt::Chat(messages.clone()), None).unwrap(), common::ids(&case["prompt_ids"]));
        let (mut ids, mut text) = (Vec::new(), String::new());
        let opts = GenerateOptions { max_tokens: 64, sampling: SamplingParams::greedy(), ..Default::default() };
        let stats = pollster::block_on(e.generate(&Prompt::Chat(messages.clone()), &opts, &mut |ev| {
            ids.push(ev.id);
            text.push_str(&ev.text);
            true
        }))
        .unwrap();
        let eos_at = case["first_eos_index"].as_u64().unwrap() as usize;
        assert_eq!(ids, common::ids(&case["generated_ids"])[..eos_at], "{backend:?}");
        assert_eq!(text, case["greedy_text_before_first_eos"].as_str().unwrap(), "{backend:?}");
        assert_eq!(stats.stop_reason, StopReason::Eos, "{backend:?}");
        assert_eq!(stats.prompt_tokens, case["n_prompt_tokens"].as_u64().unwrap() as usize, "{backend:?}");
        assert_eq!(stats.generated_tokens, eos_at, "{backend:?}");
    }
}

/// What a request of the server's `logprobs` gets from the batcher: per token its id, text,
/// log-probability and the alternatives' log-probabilities, most likely first.
#[derive(Default)]
struct Logprobs {
    ids: Vec<u32>,
    text: String,
    tokens: String,
    chosen: Vec<f64>,
    tops: Vec<Vec<f64>>,
}

/// The server's `logprobs` test, natively: a chat (`logprobs: true, top_logprobs: 5`) and a raw
/// completion (`logprobs: 3`) of 6 greedy tokens, `temperature: 0` with the server's other
/// sampling defaults, batched together as the server runs them, each event's log-probability
/// and alternatives as serve.rs turns them into OpenAI's (the candidates' ln(prob)); at the
/// recorded steps (0-2) the chosen token's and the alternatives' log-probabilities within the
/// server test's 0.1 of transformers' log-softmax on the GPU (f16 KV cache), 1e-3 on the CPU
/// reference.
#[test]
fn batcher_logprobs_match_transformers() {
    let chat = golden_case("chat_capital_france");
    let raw = golden_case("raw_capital_france");
    let requests = [
        (&chat, Prompt::Chat(messages(&chat)), 5),
        (&raw, Prompt::Text(raw["prompt_text"].as_str().unwrap().into()), 3),
    ];
    for (backend, tolerance) in [(BackendKind::Gpu, 0.1), (BackendKind::Cpu, 1e-3)] {
        let _t = Timer::new(&format!("batcher logprobs on {backend:?}"));
        let mut e = engine(backend);
        let mut b = Batcher::new(&e, 128);
        let mut got: HashMap<RequestId, Logprobs> = HashMap::new();
        let ids: Vec<RequestId> = requests
            .iter()
            .map(|(_, prompt, k)| {
                let sampling = SamplingParams { temperature: 0.0, ..Default::default() };
                let opts = GenerateOptions { max_tokens: 6, sampling, top_candidates: *k, ..Default::default() };
                let id = b.enqueue(Batcher::prepare(&e, prompt, &opts).unwrap());
                got.insert(id, Logprobs::default());
                id
            })
            .collect();
        let mut done = 0;
        while !b.is_empty() {
            pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
                let g = got.get_mut(&id).unwrap();
                match ev {
                    BatchEvent::Token(t) => {
                        g.text.push_str(&t.text);
                        if let Some(lp) = &t.logprob {
                            g.ids.push(t.id);
                            g.tokens.push_str(&lp.token);
                            g.chosen.push(lp.logprob as f64);
                            g.tops.push(t.candidates.iter().map(|c| c.prob.ln() as f64).collect());
                        }
                    }
                    BatchEvent::Done(s) => {
                        assert_eq!(s.stop_reason, StopReason::MaxTokens);
                        done += 1;
                    }
                    BatchEvent::Failed(err) => panic!("{backend:?}: request {id} failed: {err}"),
                    BatchEvent::Beams(_) => panic!("{backend:?}: request {id} is no beam search"),
                }
                true
            }))
            .unwrap();
        }
        assert_eq!(done, 2);
        for ((case, _, k), id) in requests.iter().zip(&ids) {
            let name = case["name"].as_str().unwrap();
            let g = &got[id];
            assert_eq!(g.chosen.len(), 6, "{backend:?} {name}: a logprob per token");
            assert_eq!(g.ids, common::ids(&case["generated_ids"])[..6], "{backend:?} {name}: greedy ids");
            assert_eq!(g.tokens, g.text, "{backend:?} {name}: the tokens' texts are the text");
            let (mut compared, mut worst) = (0, 0f64);
            for rec in case["top_logprobs"].as_array().unwrap() {
                let step = rec["step"].as_u64().unwrap() as usize;
                let want = common::floats(&rec["logprobs"]);
                assert_eq!(g.tops[step].len(), *k, "{backend:?} {name} step {step}");
                let diff = (g.chosen[step] - want[0]).abs();
                worst = worst.max(diff);
                assert!(
                    diff < tolerance,
                    "{backend:?} {name} step {step}: logprob {}, golden {}",
                    g.chosen[step],
                    want[0]
                );
                for (got, want) in g.tops[step].iter().zip(&want) {
                    let diff = (got - want).abs();
                    worst = worst.max(diff);
                    assert!(diff < tolerance, "{backend:?} {name} step {step}: {:?}, golden {want}", g.tops[step]);
                }
                compared += 1;
            }
            assert_eq!(compared, 3, "{name}: the recorded steps");
            eprintln!("{backend:?} {name}: max |logprob - golden| over {compared} steps: {worst:.2e}");
        }
    }
}
