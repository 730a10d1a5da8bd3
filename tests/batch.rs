//! Batched generation (`Engine::generate_batch`) on both backends: every golden prompt run in one
//! batch gives transformers' greedy tokens, a sampled sequence in the batch draws what it draws
//! alone with its seed, sequences end on their own, and a batch the KV pool cannot hold is
//! refused before any work.

mod common;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, StopReason};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::Error;

const BACKENDS: [BackendKind; 2] = [BackendKind::Cpu, BackendKind::Gpu];

fn engine(backend: BackendKind, context: usize) -> Engine {
    let opts = LoadOptions { backend, context_length: Some(context), gpu: GpuOptions::default() };
    pollster::block_on(Engine::load(common::model_bytes(), opts, &mut |_, _| {})).unwrap()
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, sampling: SamplingParams::greedy(), ignore_eos: true, ..Default::default() }
}

/// Each sequence's ids and stop reason.
fn run_batch(engine: &mut Engine, requests: &[(Prompt, GenerateOptions)]) -> (Vec<Vec<u32>>, Vec<StopReason>) {
    let mut ids = vec![Vec::new(); requests.len()];
    let stats = pollster::block_on(engine.generate_batch(requests, &mut |seq, ev| {
        ids[seq].push(ev.id);
        true
    }))
    .unwrap();
    (ids, stats.iter().map(|s| s.stop_reason).collect())
}

const STEPS: usize = 20;

#[test]
fn every_golden_prompt_in_one_batch_gives_the_golden_greedy_tokens() {
    let cases = common::golden("generations.json")["cases"].as_array().unwrap().clone();
    for backend in BACKENDS {
        let mut e = engine(backend, 1024);
        let requests: Vec<(Prompt, GenerateOptions)> =
            cases.iter().map(|c| (Prompt::Tokens(common::ids(&c["prompt_ids"])), greedy(STEPS))).collect();
        let (ids, stops) = run_batch(&mut e, &requests);
        for (case, got) in cases.iter().zip(&ids) {
            let want = &common::ids(&case["generated_ids"])[..STEPS];
            assert_eq!(got, want, "{backend:?}: {}", case["name"]);
        }
        assert!(stops.iter().all(|&s| s == StopReason::MaxTokens));
        // The engine goes on serving single generations after a batch.
        let case = &cases[0];
        let mut alone = Vec::new();
        pollster::block_on(e.generate(&Prompt::Tokens(common::ids(&case["prompt_ids"])), &greedy(8), &mut |ev| {
            alone.push(ev.id);
            true
        }))
        .unwrap();
        assert_eq!(alone, common::ids(&case["generated_ids"])[..8], "{backend:?}: a generation after the batch");
    }
}

#[test]
fn sequences_of_a_batch_keep_their_own_sampling_stops_and_lengths() {
    let cases = common::golden("generations.json")["cases"].as_array().unwrap().clone();
    let prompt = |i: usize| Prompt::Tokens(common::ids(&cases[i]["prompt_ids"]));
    let sampled = GenerateOptions {
        max_tokens: 12,
        sampling: SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95, seed: 7, ..SamplingParams::default() },
        ignore_eos: true,
        ..Default::default()
    };
    let penalized = GenerateOptions {
        max_tokens: 10,
        sampling: SamplingParams { temperature: 0.7, repetition_penalty: 1.3, seed: 3, ..SamplingParams::default() },
        ignore_eos: true,
        ..Default::default()
    };
    // chat_capital_france ends at its EOS after 7 tokens; the others run to their limits.
    let eos = cases.iter().position(|c| c["name"] == "chat_capital_france").unwrap();
    let stops_at_eos = GenerateOptions { ignore_eos: false, ..greedy(30) };
    for backend in BACKENDS {
        let mut e = engine(backend, 1024);
        let alone = |e: &mut Engine, p: Prompt, o: &GenerateOptions| {
            let mut ids = Vec::new();
            pollster::block_on(e.generate(&p, o, &mut |ev| {
                ids.push(ev.id);
                true
            }))
            .unwrap();
            ids
        };
        let want_sampled = alone(&mut e, prompt(1), &sampled);
        let want_penalized = alone(&mut e, prompt(2), &penalized);
        let requests = vec![
            (prompt(1), sampled.clone()),
            (prompt(eos), stops_at_eos.clone()),
            (prompt(2), penalized.clone()),
            (prompt(3), greedy(5)),
        ];
        let (ids, stops) = run_batch(&mut e, &requests);
        assert_eq!(ids[0], want_sampled, "{backend:?}: a sampled sequence draws what it draws alone");
        let eos_at = cases[eos]["first_eos_index"].as_u64().unwrap() as usize;
        assert_eq!(ids[1], common::ids(&cases[eos]["generated_ids"])[..eos_at], "{backend:?}: greedy to EOS");
        assert_eq!(ids[2], want_penalized, "{backend:?}: penalties apply per sequence");
        assert_eq!(ids[3], common::ids(&cases[3]["generated_ids"])[..5], "{backend:?}: its own token limit");
        assert_eq!(stops, [StopReason::MaxTokens, StopReason::Eos, StopReason::MaxTokens, StopReason::MaxTokens]);
    }
}

#[test]
fn a_batch_the_kv_pool_cannot_hold_is_refused_before_any_work() {
    let mut e = engine(BackendKind::Gpu, 64);
    let prompt = Prompt::Tokens(vec![504, 3575, 282, 4649, 314]);
    // Three sequences of 5 + 20 tokens need 2 blocks of 16 each: 6 blocks of a 4-block pool.
    let requests = vec![(prompt.clone(), greedy(20)); 3];
    let mut called = false;
    let err = pollster::block_on(e.generate_batch(&requests, &mut |_, _| {
        called = true;
        true
    }))
    .unwrap_err();
    assert!(matches!(err, Error::KvPoolFull { needed_tokens: 96, free_tokens: 64, capacity_tokens: 64 }), "{err}");
    assert!(!called);
    // Two fit, and run.
    let (ids, _) = run_batch(&mut e, &requests[..2]);
    assert_eq!(ids[0], ids[1]);
    assert_eq!(ids[0].len(), 20);
    let empty: Vec<(Prompt, GenerateOptions)> = Vec::new();
    assert!(matches!(
        pollster::block_on(e.generate_batch(&empty, &mut |_, _| true)),
        Err(Error::InvalidOption { name: "batch", .. })
    ));
}
