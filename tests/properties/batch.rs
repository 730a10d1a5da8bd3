//! Batched generation (`Engine::generate_batch`, the `Batcher`) on both backends, on a tiny
//! random chat model: eight prompts run in one batch give the CPU reference's greedy tokens (its
//! own loop over the same file), a sampled sequence in the batch draws what it draws alone with
//! its seed, sequences end on their own, requests join, pause and leave a running batch, the
//! prefix cache forks blocks, the admission queue keeps order, and a batch the KV pool cannot
//! hold is refused before any work.

use crate::common::tiny;
use std::sync::OnceLock;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, StopReason};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::Error;

const BACKENDS: [BackendKind; 2] = [BackendKind::Cpu, BackendKind::Gpu];

fn engine_of(bytes: &[u8], backend: BackendKind, context: usize) -> Engine {
    let opts = LoadOptions { backend, context_length: Some(context), gpu: GpuOptions::default() };
    pollster::block_on(Engine::load(bytes, opts, &mut |_, _| {})).unwrap()
}

fn engine(backend: BackendKind, context: usize) -> Engine {
    engine_of(tiny::chat(), backend, context)
}

fn prompt_ids(i: usize) -> Vec<u32> {
    static PROMPTS: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    PROMPTS.get_or_init(tiny::prompts)[i].clone()
}

fn prompt(i: usize) -> Prompt {
    Prompt::Tokens(prompt_ids(i))
}

/// The CPU reference's first `n` (at most 24) greedy tokens for prompt `i`, EOS not a stop.
fn want(i: usize, n: usize) -> Vec<u32> {
    static WANT: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    WANT.get_or_init(|| tiny::prompts().iter().map(|p| tiny::greedy(tiny::chat(), p, 24).0).collect())[i][..n].to_vec()
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, sampling: SamplingParams::greedy(), ignore_eos: true, ..Default::default() }
}

/// The ids `Engine::generate` gives for `prompt` alone.
fn generate_ids(engine: &mut Engine, prompt: &Prompt, options: &GenerateOptions) -> Vec<u32> {
    let mut ids = Vec::new();
    pollster::block_on(engine.generate(prompt, options, &mut |ev| {
        ids.push(ev.id);
        true
    }))
    .unwrap();
    ids
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

const STEPS: usize = 16;

#[test]
fn eight_prompts_in_one_batch_give_the_reference_greedy_tokens() {
    for backend in BACKENDS {
        let mut e = engine(backend, 1024);
        let requests: Vec<(Prompt, GenerateOptions)> = (0..8).map(|i| (prompt(i), greedy(STEPS))).collect();
        let (ids, stops) = run_batch(&mut e, &requests);
        for (i, got) in ids.iter().enumerate() {
            assert_eq!(got, &want(i, STEPS), "{backend:?}: prompt {i}");
        }
        assert!(stops.iter().all(|&s| s == StopReason::MaxTokens));
        // The engine goes on serving single generations after a batch.
        assert_eq!(
            generate_ids(&mut e, &prompt(0), &greedy(8)),
            want(0, 8),
            "{backend:?}: a generation after the batch"
        );
    }
}

/// The GPU-style kernels (what real GPUs run; lavapipe's own are the CPU-style ones) through the
/// engine, where the other tests take the adapter's own: eight greedy prompts in one batch (rounds
/// of prompt chunks and decode rows), one asking for log-probabilities, give the CPU reference's
/// tokens and the CPU backend's log-probabilities within 1e-3; a generation after the batch and
/// one with prompt-lookup speculation give the reference's tokens too.
#[test]
fn the_gpu_style_kernels_give_the_reference_tokens_through_the_engine() {
    use webgpu_llm::gpu::KernelStyle;
    use webgpu_llm::speculate::{Drafter, Speculation};
    let gpu = GpuOptions { kernels: Some(KernelStyle::Gpu), ..Default::default() };
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(1024), gpu };
    let mut e = pollster::block_on(Engine::load(tiny::chat(), opts, &mut |_, _| {})).unwrap();
    assert_eq!(e.gpu_model().unwrap().gpu.style, KernelStyle::Gpu);
    let logprobs = GenerateOptions { top_candidates: 2, ..greedy(STEPS) };
    let requests: Vec<(Prompt, GenerateOptions)> =
        (0..8).map(|i| (prompt(i), if i == 5 { logprobs.clone() } else { greedy(STEPS) })).collect();
    // Each sequence's ids and log-probabilities.
    let batch = |e: &mut Engine| {
        let mut out = vec![(Vec::new(), Vec::new()); requests.len()];
        pollster::block_on(e.generate_batch(&requests, &mut |seq, ev| {
            out[seq].0.push(ev.id);
            out[seq].1.extend(ev.logprob.as_ref().map(|l| l.logprob));
            true
        }))
        .unwrap();
        out
    };
    let got = batch(&mut e);
    for (i, (ids, _)) in got.iter().enumerate() {
        assert_eq!(ids, &want(i, STEPS), "prompt {i} in the batch");
    }
    let reference = batch(&mut engine(BackendKind::Cpu, 1024));
    assert_eq!(got[5].1.len(), STEPS);
    for (k, (g, r)) in got[5].1.iter().zip(&reference[5].1).enumerate() {
        assert!((g - r).abs() < 1e-3, "token {k}'s logprob: {g} against the CPU backend's {r}");
    }
    assert_eq!(generate_ids(&mut e, &prompt(0), &greedy(8)), want(0, 8), "a generation after the batch");
    let lookup =
        GenerateOptions { speculate: Some(Speculation { drafter: Drafter::Lookup, draft_tokens: 3 }), ..greedy(STEPS) };
    assert_eq!(generate_ids(&mut e, &prompt(4), &lookup), want(4, STEPS), "prompt-lookup speculation");
}

#[test]
fn sequences_of_a_batch_keep_their_own_sampling_stops_and_lengths() {
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
    // Prompt 7 ends at its EOS after 7 tokens (the model's EOS moved to its 8th greedy token);
    // the others run to their limits.
    let (eos, eos_at) = (7, 7);
    let (bytes, _) = tiny::chat_ending_at(&prompt_ids(eos), eos_at);
    let stops_at_eos = GenerateOptions { ignore_eos: false, ..greedy(30) };
    for backend in BACKENDS {
        let mut e = engine_of(&bytes, backend, 1024);
        let want_sampled = generate_ids(&mut e, &prompt(1), &sampled);
        let want_penalized = generate_ids(&mut e, &prompt(2), &penalized);
        let requests = vec![
            (prompt(1), sampled.clone()),
            (prompt(eos), stops_at_eos.clone()),
            (prompt(2), penalized.clone()),
            (prompt(3), greedy(5)),
        ];
        let (ids, stops) = run_batch(&mut e, &requests);
        assert_eq!(ids[0], want_sampled, "{backend:?}: a sampled sequence draws what it draws alone");
        assert_eq!(ids[1], want(eos, eos_at), "{backend:?}: greedy to EOS");
        assert_eq!(ids[2], want_penalized, "{backend:?}: penalties apply per sequence");
        assert_eq!(ids[3], want(3, 5), "{backend:?}: its own token limit");
        assert_eq!(stops, [StopReason::MaxTokens, StopReason::Eos, StopReason::MaxTokens, StopReason::MaxTokens]);
    }
}

#[test]
fn a_batch_the_kv_pool_cannot_hold_is_refused_before_any_work() {
    let mut e = engine(BackendKind::Gpu, 64);
    let prompt = prompt(0);
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

/// Continuous batching (`Batcher`): requests that join a running batch between steps, one left
/// out of several steps (its reader behind) and one cancelled midway each give what they give
/// alone, and every KV block is back in the pool at the end.
#[test]
fn requests_joining_pausing_and_leaving_a_running_batch_give_the_reference_tokens() {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use webgpu_llm::batcher::{BatchEvent, Batcher, RequestId};
    for backend in BACKENDS {
        let mut e = engine(backend, 1024);
        let free_at_start = e.gpu_model().map(|m| m.pool().free_blocks());
        // A small prefill budget: prompts take several rounds, beside running decodes.
        let mut b = Batcher::new(&e, 16);
        let ids: RefCell<HashMap<RequestId, Vec<u32>>> = RefCell::default();
        let done: RefCell<HashMap<RequestId, StopReason>> = RefCell::default();
        let mut which: HashMap<RequestId, usize> = HashMap::new();
        let admit = |b: &mut Batcher, e: &mut Engine, i: usize, n: usize, which: &mut HashMap<RequestId, usize>| {
            let p = Batcher::prepare(e, &prompt(i), &greedy(n)).unwrap();
            let id = b.admit(e, p).map_err(|(e, _)| e).unwrap();
            which.insert(id, i);
            id
        };
        let round = |b: &mut Batcher, e: &mut Engine, paused: Option<RequestId>, cancel: Option<RequestId>| {
            pollster::block_on(b.step(e, &mut |id| Some(id) != paused, &mut |id, ev| match ev {
                BatchEvent::Token(t) => {
                    ids.borrow_mut().entry(id).or_default().push(t.id);
                    Some(id) != cancel
                }
                BatchEvent::Done(s) => {
                    done.borrow_mut().insert(id, s.stop_reason);
                    true
                }
                BatchEvent::Failed(err) => panic!("{err}"),
                BatchEvent::Beams(_) => panic!("no beam search here"),
            }))
            .unwrap()
        };
        let first = admit(&mut b, &mut e, 1, 16, &mut which);
        for _ in 0..3 {
            round(&mut b, &mut e, None, None);
        }
        let second = admit(&mut b, &mut e, 4, 16, &mut which);
        let third = admit(&mut b, &mut e, 3, 16, &mut which);
        // The second waits (its reader behind) for 4 rounds once it has its first token.
        for _ in 0..4 {
            round(&mut b, &mut e, Some(second), None);
        }
        // The third is cancelled at its next token.
        let mut rounds = 0;
        while !done.borrow().contains_key(&third) {
            round(&mut b, &mut e, None, Some(third));
            rounds += 1;
            assert!(rounds < 10, "{backend:?}: the cancelled request does not end");
        }
        let fourth = admit(&mut b, &mut e, 6, 16, &mut which);
        // A fifth leaves by `cancel` (its client gone) after two rounds.
        let fifth = admit(&mut b, &mut e, 0, 16, &mut which);
        round(&mut b, &mut e, None, None);
        round(&mut b, &mut e, None, None);
        let stats = b.cancel(&mut e, fifth).expect("the fifth is running");
        assert_eq!(stats.stop_reason, StopReason::Aborted);
        assert!(b.cancel(&mut e, fifth).is_none(), "cancelled twice");
        let mut rounds = 0;
        while !b.is_empty() {
            round(&mut b, &mut e, None, None);
            rounds += 1;
            assert!(rounds < 100, "{backend:?}: the batch does not end");
        }
        let (ids, done) = (ids.into_inner(), done.into_inner());
        for id in [first, second, fourth] {
            let i = which[&id];
            // ignore_eos: each runs its 16 tokens.
            assert_eq!(ids[&id], want(i, 16), "{backend:?}: prompt {i}");
            assert_eq!(done[&id], StopReason::MaxTokens);
        }
        assert_eq!(done[&third], StopReason::Aborted, "{backend:?}");
        let n = ids[&third].len();
        assert_eq!(ids[&third], want(3, n), "{backend:?}: the cancelled request's tokens");
        assert!(n < 16);
        assert!(!done.contains_key(&fifth), "{backend:?}: a cancelled request reports nothing more");
        let fifth_ids = ids.get(&fifth).cloned().unwrap_or_default();
        assert_eq!(fifth_ids, want(0, fifth_ids.len()), "{backend:?}: the fifth's tokens before it left");
        // Ended requests' sequences stay as the prefix cache until the batch is cleared.
        b.clear(&mut e);
        assert_eq!(e.gpu_model().map(|m| m.pool().free_blocks()), free_at_start, "{backend:?}: blocks left taken");
    }
}

/// One request run to its end in `b`: its ids and stats.
fn run_one(
    b: &mut webgpu_llm::batcher::Batcher,
    e: &mut Engine,
    prompt: &Prompt,
    n: usize,
) -> (Vec<u32>, webgpu_llm::engine::Stats) {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    let p = Batcher::prepare(e, prompt, &greedy(n)).unwrap();
    b.admit(e, p).map_err(|(e, _)| e).unwrap();
    let mut ids = Vec::new();
    let mut stats = None;
    while !b.is_empty() {
        pollster::block_on(b.step(e, &mut |_| true, &mut |_, ev| {
            match ev {
                BatchEvent::Token(t) => ids.push(t.id),
                BatchEvent::Done(s) => stats = Some(s),
                BatchEvent::Failed(err) => panic!("{err}"),
                BatchEvent::Beams(_) => panic!("no beam search here"),
            }
            true
        }))
        .unwrap();
    }
    (ids, stats.expect("the request ended"))
}

/// The prefix cache is shared by running requests too (a prompt a running request has
/// prefilled is not prefilled again), and, in a pool the cache has filled, evicts its least
/// recently used blocks for a request that needs them: it is admitted at once, never refused,
/// and the blocks used last are the ones still cached.
#[test]
fn the_prefix_cache_serves_running_requests_and_gives_way_to_a_request_that_needs_the_room() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    let mut e = engine(BackendKind::Gpu, 256); // 16 blocks of 16 tokens
    let pool = |e: &Engine| e.gpu_model().unwrap().pool().clone();
    let mut b = Batcher::new(&e, 512);
    // A runs; once its prompt is in, B with the same prompt starts from A's blocks.
    let p = Batcher::prepare(&e, &prompt(4), &greedy(8)).unwrap();
    let a = b.admit(&mut e, p).map_err(|(e, _)| e).unwrap();
    type Ids = std::collections::HashMap<u64, Vec<u32>>;
    type Done = std::collections::HashMap<u64, webgpu_llm::engine::Stats>;
    let (mut ids, mut stats) = (Ids::new(), Done::new());
    fn step(b: &mut Batcher, e: &mut Engine, ids: &mut Ids, stats: &mut Done) {
        pollster::block_on(b.step(e, &mut |_| true, &mut |id, ev| {
            match ev {
                BatchEvent::Token(t) => ids.entry(id).or_default().push(t.id),
                BatchEvent::Done(s) => drop(stats.insert(id, s)),
                other => panic!("request {id}: {other:?}"),
            }
            true
        }))
        .unwrap();
    }
    step(&mut b, &mut e, &mut ids, &mut stats);
    let bt = 16;
    let len = prompt_ids(4).len();
    assert_eq!(pool(&e).cached_blocks(), len / bt, "A's full prompt blocks are registered once prefilled");
    let p = Batcher::prepare(&e, &prompt(4), &greedy(8)).unwrap();
    let second = b.admit(&mut e, p).map_err(|(e, _)| e).unwrap();
    while !b.is_empty() {
        step(&mut b, &mut e, &mut ids, &mut stats);
    }
    for id in [a, second] {
        assert_eq!(ids[&id], want(4, 8), "request {id}");
    }
    assert_eq!(stats[&a].prefilled_tokens, len);
    assert_eq!(stats[&second].prefilled_tokens, len - (len - 1) / bt * bt, "B prefilled only past A's whole blocks");
    // Fill the cache: every prompt run in turn leaves its blocks.
    for i in 0..8 {
        let (ids, _) = run_one(&mut b, &mut e, &prompt(i), 4);
        assert_eq!(ids, want(i, 4), "prompt {i}");
    }
    let p = pool(&e);
    assert_eq!(p.free_blocks(), p.blocks(), "every block idle or free once the requests ended");
    let cached = p.cached_blocks();
    assert!(cached >= 12, "the cache holds most of the pool: {cached} of {} blocks", p.blocks());
    // A request with a 200-token prompt (13 blocks): admitted at once, evicting the oldest.
    let mut long: Vec<u32> = Vec::new();
    while long.len() < 200 {
        long.extend(prompt_ids(7 - long.len() % 8));
    }
    long.truncate(200);
    let p = Batcher::prepare(&e, &Prompt::Tokens(long.clone()), &greedy(4)).unwrap();
    let admitted = b.admit(&mut e, p).map_err(|(e, _)| e);
    assert!(admitted.is_ok(), "a request the cache's idle blocks make room for is admitted: {admitted:?}");
    while !b.is_empty() {
        step(&mut b, &mut e, &mut ids, &mut stats);
    }
    assert_eq!(ids[&admitted.unwrap()], tiny::greedy(tiny::chat(), &long, 4).0, "the long prompt's tokens");
    let p = pool(&e);
    assert!(p.cached_blocks() < cached + 13, "blocks were evicted: {} cached", p.cached_blocks());
    // Its own blocks are the most recent: its prompt is cached whole (bar the last block).
    assert_eq!(p.cached_prefix(&long).0, long.len() / bt * bt);
}

#[test]
fn a_prompt_that_starts_as_an_ended_one_did_forks_its_blocks_and_gives_the_same_tokens() {
    use webgpu_llm::batcher::Batcher;
    // Prompts 4 and 5 share their first tokens (the system turn and "<|im_start|>user\n"), by
    // hand count.
    let shared = prompt_ids(4).iter().zip(prompt_ids(5)).take_while(|(a, b)| **a == *b).count();
    assert_eq!(shared, 24 + 6);
    // The next turn of prompt 4: its prompt, its 12 reference tokens, then prompt 5's user turn.
    let mut next_turn = prompt_ids(4);
    next_turn.extend(want(4, 12));
    next_turn.extend(&prompt_ids(5)[24..]);
    let mut turns = Vec::new();
    for backend in BACKENDS {
        let mut e = engine(backend, 1024);
        let free_at_start = e.gpu_model().map(|m| m.pool().free_blocks());
        // Block-sized reuse on the GPU (the CPU backend keeps no prefix cache).
        let block = |n: usize| if backend == BackendKind::Gpu { n / 16 * 16 } else { 0 };
        let mut b = Batcher::new(&e, 512);
        let (ids, s) = run_one(&mut b, &mut e, &Prompt::Tokens(prompt_ids(4)), 12);
        assert_eq!(ids, want(4, 12), "{backend:?}: the first request");
        assert_eq!(s.prefilled_tokens, s.prompt_tokens, "{backend:?}: nothing to reuse yet");
        // Prompt 5 shares 30 tokens with prompt 4: one block of them is reused.
        let (ids, s) = run_one(&mut b, &mut e, &Prompt::Tokens(prompt_ids(5)), 8);
        assert_eq!(ids, want(5, 8), "{backend:?}: a request sharing the system prompt");
        assert_eq!(s.prefilled_tokens, s.prompt_tokens - block(shared), "{backend:?}");
        // Prompt 4 again (a regenerated answer): all but its last token's block is reused.
        let (ids, s) = run_one(&mut b, &mut e, &Prompt::Tokens(prompt_ids(4)), 8);
        assert_eq!(ids, want(4, 8), "{backend:?}: the same prompt again");
        assert_eq!(s.prefilled_tokens, s.prompt_tokens - block(prompt_ids(4).len() - 1), "{backend:?}");
        // The next turn: prompt 4 and its answer come from the cache, written by its prefill
        // and its decode steps (the first request's prompt and 11 positions).
        let (ids, s) = run_one(&mut b, &mut e, &Prompt::Tokens(next_turn.clone()), 8);
        assert_eq!(s.prefilled_tokens, s.prompt_tokens - block(prompt_ids(4).len() + 11), "{backend:?}");
        turns.push(ids);
        b.clear(&mut e);
        assert_eq!(e.gpu_model().map(|m| m.pool().free_blocks()), free_at_start, "{backend:?}: blocks left taken");
    }
    // The GPU's next turn over forked blocks gives the CPU backend's tokens, and both the CPU
    // reference's own loop's.
    assert_eq!(turns[1], turns[0], "the next turn: GPU (from the prefix cache) against the CPU backend");
    assert_eq!(turns[0], tiny::greedy(tiny::chat(), &next_turn, 8).0, "the next turn against the CPU reference");
}

#[test]
fn enqueued_requests_wait_for_a_row_in_order_and_a_cancelled_one_never_runs() {
    use std::collections::HashMap;
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    let mut e = engine(BackendKind::Gpu, 1024);
    let mut b = Batcher::new(&e, 512);
    b.limit_rows(2);
    let ids: Vec<_> = (0..5).map(|i| b.enqueue(Batcher::prepare(&e, &prompt(i), &greedy(6)).unwrap())).collect();
    assert_eq!((b.len(), b.waiting()), (0, 5));
    let stats = b.cancel(&mut e, ids[3]).expect("a waiting request");
    assert_eq!((stats.stop_reason, stats.generated_tokens), (StopReason::Aborted, 0));
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut first_token_round = HashMap::new();
    let mut round = 0;
    while !b.is_empty() {
        pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
            match ev {
                BatchEvent::Token(t) => {
                    first_token_round.entry(id).or_insert(round);
                    got.entry(id).or_default().push(t.id);
                }
                BatchEvent::Done(s) => assert_eq!(s.stop_reason, StopReason::MaxTokens),
                BatchEvent::Failed(err) => panic!("{err}"),
                BatchEvent::Beams(_) => panic!("no beam search here"),
            }
            true
        }))
        .unwrap();
        assert!(b.len() <= 2, "at most two rows run");
        round += 1;
        assert!(round < 50, "the queue does not drain");
    }
    assert!(!got.contains_key(&ids[3]), "the cancelled request ran");
    for i in [0, 1, 2, 4] {
        assert_eq!(got[&ids[i]], want(i, 6), "prompt {i}");
    }
    // In order: the third starts only once the first two have ended, the fifth after it.
    assert!(
        first_token_round[&ids[2]] > first_token_round[&ids[1]]
            && first_token_round[&ids[4]] >= first_token_round[&ids[2]]
    );
    b.clear(&mut e);
}

/// Blocks on demand: `max_tokens` bounds a request and reserves nothing, so five requests
/// whose longest lengths add up to more than the pool all start at once; as they grow past the
/// pool, the most recently admitted is preempted (its blocks freed), waits at the head of the
/// queue and is recomputed from its tokens, and every request still gives the CPU reference's
/// tokens (a sampled one what it draws alone, with its seed). No request is refused.
#[test]
fn requests_that_outgrow_the_pool_are_preempted_and_recomputed_with_the_same_tokens() {
    use std::collections::HashMap;
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    // 96 tokens: six blocks of 16. Each request's prompt (5 to 12 tokens) fits one block and
    // it runs to 24 tokens: two blocks at its longest, ten for the five.
    let mut e = engine(BackendKind::Gpu, 96);
    let blocks = e.gpu_model().unwrap().pool().blocks();
    assert_eq!(blocks, 6);
    let sampled = GenerateOptions {
        max_tokens: 24,
        sampling: SamplingParams { temperature: 0.9, top_k: 40, seed: 21, ..SamplingParams::default() },
        ignore_eos: true,
        ..Default::default()
    };
    // Raw prompts of 4 to 12 tokens; the last one sampled.
    let prompts: Vec<Vec<u32>> = vec![
        prompt_ids(0),
        prompt_ids(2),
        vec![tiny::IM_START, 400, 401, 402],
        vec![tiny::IM_START, 500, 1501, 502, 7, 1900],
        prompt_ids(2)[..9].to_vec(),
    ];
    let sampled_one = prompts.len() - 1;
    let options = |i: usize| if i == sampled_one { sampled.clone() } else { greedy(24) };
    // What each gives alone (`Engine::generate`, its own loop, on the same GPU: the CPU
    // reference's greedy tokens part from the GPU's at a near tie of prompt 2's 23rd token).
    let alone: Vec<Vec<u32>> =
        (0..prompts.len()).map(|i| generate_ids(&mut e, &Prompt::Tokens(prompts[i].clone()), &options(i))).collect();
    assert_eq!(alone[0], want(0, 24), "the GPU alone against the CPU reference");
    let mut b = Batcher::new(&e, usize::MAX);
    let mut which = HashMap::new();
    for (i, p) in prompts.iter().enumerate() {
        assert!(p.len() < 16, "prompt {i} fits one block");
        let p = Batcher::prepare(&e, &Prompt::Tokens(p.clone()), &options(i)).unwrap();
        which.insert(b.enqueue(p), i);
    }
    let mut ids: HashMap<usize, Vec<u32>> = HashMap::new();
    let (mut rounds, mut all_started_at) = (0, None);
    while !b.is_empty() {
        pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
            match ev {
                BatchEvent::Token(t) => ids.entry(which[&id]).or_default().push(t.id),
                BatchEvent::Done(s) => assert_eq!(s.stop_reason, StopReason::MaxTokens),
                BatchEvent::Failed(err) => panic!("request {} failed: {err}", which[&id]),
                BatchEvent::Beams(_) => panic!("no beam search here"),
            }
            true
        }))
        .unwrap();
        rounds += 1;
        if all_started_at.is_none() && ids.len() == prompts.len() {
            all_started_at = Some(rounds);
        }
        assert!(rounds < 500, "the batch does not end");
    }
    assert_eq!(all_started_at, Some(1), "all five start in the first round: max_tokens reserves nothing");
    assert!(b.preemptions() > 0, "ten blocks' worth of requests in six: some were preempted");
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(&ids[&i], want, "prompt {i}");
    }
    b.clear(&mut e);
    assert_eq!(e.gpu_model().unwrap().pool().free_blocks(), blocks, "every block back in the pool");
}

/// A beam search and a speculating request (prompt lookup) run in the batch: the beams and the
/// drafts are rows of the same steps as four greedy streams, which get a token every round while
/// they run (and each gives what it gives alone); the search gives what it gives alone
/// (`Engine::beam_search`), the speculating request the reference's tokens. The streams' round
/// times with and without them are printed.
#[test]
fn a_beam_search_runs_beside_streams_that_keep_getting_a_token_every_round() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    use webgpu_llm::beam::{BeamOptions, EarlyStopping};
    use webgpu_llm::speculate::{Drafter, Speculation};
    for backend in BACKENDS {
        let mut e = engine(backend, 1024);
        let options = BeamOptions {
            beams: 3,
            max_tokens: 10,
            stop_ids: Vec::new(),
            length_penalty: 1.0,
            early_stopping: EarlyStopping::Heuristic,
        };
        let alone = pollster::block_on(e.beam_search(&prompt(1), &options)).unwrap();
        assert_eq!(alone.len(), 3);
        let mut round_ms = [Vec::new(), Vec::new()];
        for with_beams in [false, true] {
            let mut b = Batcher::new(&e, usize::MAX);
            let streams: Vec<_> =
                (0..4).map(|i| b.enqueue(Batcher::prepare(&e, &prompt(i + 2), &greedy(STEPS)).unwrap())).collect();
            let search = with_beams.then(|| b.enqueue(Batcher::prepare_beams(&e, &prompt(1), &options).unwrap()));
            // And a speculating request (prompt lookup, 4 drafts a step) beside them.
            let lookup = Speculation { drafter: Drafter::Lookup, draft_tokens: 4 };
            let speculating = with_beams.then(|| {
                let o = GenerateOptions { speculate: Some(lookup), ..greedy(STEPS) };
                b.enqueue(Batcher::prepare(&e, &prompt(0), &o).unwrap())
            });
            let mut spec_ids = Vec::new();
            let mut ids = vec![Vec::new(); 4];
            let mut found = None;
            for round in 0..STEPS {
                let counts: Vec<usize> = ids.iter().map(Vec::len).collect();
                let start = std::time::Instant::now();
                pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
                    match ev {
                        BatchEvent::Token(t) if Some(id) == speculating => spec_ids.push(t.id),
                        BatchEvent::Token(t) => ids[streams.iter().position(|&s| s == id).unwrap()].push(t.id),
                        BatchEvent::Beams(beams) => {
                            assert_eq!(Some(id), search);
                            found = Some(beams);
                        }
                        BatchEvent::Done(_) => {}
                        BatchEvent::Failed(err) => panic!("{backend:?}: {err}"),
                    }
                    true
                }))
                .unwrap();
                round_ms[with_beams as usize].push(start.elapsed().as_secs_f64() * 1e3);
                assert!(
                    ids.iter().zip(&counts).all(|(g, c)| g.len() == c + 1),
                    "{backend:?}: round {round}: a stream went without its token"
                );
            }
            b.clear(&mut e);
            for (i, got) in ids.iter().enumerate() {
                assert_eq!(got, &want(i + 2, STEPS), "{backend:?}: stream {i}");
            }
            if with_beams {
                assert_eq!(spec_ids, want(0, spec_ids.len()), "{backend:?}: the speculating request");
                assert!(spec_ids.len() >= STEPS, "{backend:?}: speculation kept pace: {} tokens", spec_ids.len());
                let found = found.expect("the search ended within the streams' rounds");
                for (k, ((h, text), (a, a_text))) in found.iter().zip(&alone).enumerate() {
                    assert_eq!((&h.ids, text), (&a.ids, a_text), "{backend:?}: beam {k}");
                    assert!((h.score - a.score).abs() < 1e-9, "{backend:?}: beam {k}: {} vs {}", h.score, a.score);
                }
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (without, with) = (median(&mut round_ms[0]), median(&mut round_ms[1]));
        println!(
            "{backend:?}: the four streams' round time p50 {without:.2} ms alone, {with:.2} ms beside a 3-beam search and a speculating request"
        );
    }
}

/// A beam search takes a row a beam: with two rows, a 2-beam search leaves no room, so a
/// greedy request enqueued after it waits for it (it was admitted as one request and its rows
/// ran past the step's, which panicked); a search with more beams than rows is refused.
#[test]
fn a_beam_search_takes_a_row_a_beam_and_a_request_after_it_waits_for_room() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    use webgpu_llm::beam::{BeamOptions, EarlyStopping};
    for backend in BACKENDS {
        let mut e = engine(backend, 1024);
        let options = BeamOptions {
            beams: 2,
            max_tokens: 6,
            stop_ids: Vec::new(),
            length_penalty: 1.0,
            early_stopping: EarlyStopping::Heuristic,
        };
        let alone = pollster::block_on(e.beam_search(&prompt(0), &options)).unwrap();
        let mut b = Batcher::new(&e, usize::MAX);
        b.limit_rows(2);
        let search = b.enqueue(Batcher::prepare_beams(&e, &prompt(0), &options).unwrap());
        let stream = b.enqueue(Batcher::prepare(&e, &prompt(2), &greedy(8)).unwrap());
        let three = BeamOptions { beams: 3, ..options.clone() };
        let refused = b.enqueue(Batcher::prepare_beams(&e, &prompt(0), &three).unwrap());
        let (mut ids, mut found, mut failed) = (Vec::new(), None, None);
        let mut rounds = 0;
        while !b.is_empty() {
            pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
                match ev {
                    BatchEvent::Token(t) if id == stream => {
                        assert!(found.is_some(), "{backend:?}: the stream ran beside the search's two rows");
                        ids.push(t.id);
                    }
                    BatchEvent::Beams(beams) if id == search => found = Some(beams),
                    BatchEvent::Failed(err) if id == refused => failed = Some(err),
                    BatchEvent::Done(_) => {}
                    other => panic!("{backend:?}: request {id}: {other:?}"),
                }
                true
            }))
            .unwrap();
            rounds += 1;
            assert!(rounds < 100, "{backend:?}: the batch does not end");
        }
        let found = found.expect("the search ended");
        let same: Vec<_> = found.iter().map(|(h, t)| (&h.ids, t)).collect();
        assert_eq!(same, alone.iter().map(|(h, t)| (&h.ids, t)).collect::<Vec<_>>(), "{backend:?}");
        assert_eq!(ids, want(2, 8), "{backend:?}: the stream after the search");
        assert!(
            matches!(failed, Some(webgpu_llm::Error::InvalidOption { name: "beams", .. })),
            "{backend:?}: {failed:?}"
        );
    }
}

/// Speculation runs in the batch: a speculating request's drafts (prompt lookup, passes of the
/// model's first 2 layers in its own sequence, or a draft model — here a second copy of the
/// model — in a sequence of its own in the draft model's pool) are rows of the same steps as
/// three greedy streams, which get a token every round; it gives the CPU reference's greedy
/// tokens (with lookup in fewer passes than tokens: its drafts accepted), and the streams theirs.
/// With the draft model, two speculating requests run at once (each with its own draft
/// sequence).
#[test]
fn a_speculating_request_runs_beside_streams_that_keep_getting_a_token_every_round() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    use webgpu_llm::speculate::{Drafter, Speculation};
    // A prompt whose reference answer cycles (lookup drafts it from the answer's start).
    let mut ids = tiny::chat_prompt(&[("user", "What is the capital of France?")]);
    ids.extend(tiny::greedy(tiny::chat(), &ids, 15).0);
    let (want_spec, _) = tiny::greedy(tiny::chat(), &ids, STEPS);
    let drafters = [Drafter::Lookup, Drafter::Layers(2), Drafter::Model];
    for (backend, drafter) in BACKENDS.into_iter().flat_map(|b| drafters.map(|d| (b, d))) {
        let mut e = engine(backend, 1024);
        if drafter == Drafter::Model {
            e.set_draft_model(engine(backend, 1024)).unwrap();
        }
        let mut b = Batcher::new(&e, usize::MAX);
        let streams: Vec<_> =
            (0..3).map(|i| b.enqueue(Batcher::prepare(&e, &prompt(i + 2), &greedy(STEPS + 4)).unwrap())).collect();
        let spec = Speculation { drafter, draft_tokens: 4 };
        let options = GenerateOptions { speculate: Some(spec), ..greedy(STEPS) };
        let copies = if drafter == Drafter::Model { 2 } else { 1 };
        let speculating: Vec<_> = (0..copies)
            .map(|_| b.enqueue(Batcher::prepare(&e, &Prompt::Tokens(ids.clone()), &options).unwrap()))
            .collect();
        let (mut got, mut spec_ids, mut stats) = (vec![Vec::new(); 3], vec![Vec::new(); copies], vec![None; copies]);
        while stats.iter().any(Option::is_none) {
            let counts: Vec<usize> = got.iter().map(Vec::len).collect();
            pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
                let spec = speculating.iter().position(|&s| s == id);
                match (ev, spec) {
                    (BatchEvent::Token(t), Some(k)) => spec_ids[k].push(t.id),
                    (BatchEvent::Token(t), None) => got[streams.iter().position(|&s| s == id).unwrap()].push(t.id),
                    (BatchEvent::Done(s), Some(k)) => stats[k] = Some(s),
                    (BatchEvent::Done(_), None) => {}
                    (other, _) => panic!("{backend:?}: {other:?}"),
                }
                true
            }))
            .unwrap();
            assert!(got.iter().zip(&counts).all(|(g, c)| g.len() == c + 1), "{backend:?}: a stream missed a round");
        }
        b.clear(&mut e);
        for (ids, stats) in spec_ids.iter().zip(stats) {
            assert_eq!(ids, &want_spec, "{backend:?} {drafter:?}: the speculating request's tokens");
            let sp = stats.unwrap().speculation.expect("speculation figures");
            match drafter {
                Drafter::Lookup => assert!(sp.accepted > 0 && sp.passes < STEPS, "{backend:?}: {sp:?}"),
                // The model as its own draft model: its drafts are the model's own greedy
                // tokens (bar rounding between a decode step and a batched check).
                Drafter::Model => assert!(sp.drafted > 0 && sp.accepted * 10 >= sp.drafted * 9, "{backend:?}: {sp:?}"),
                Drafter::Layers(_) => assert!(sp.draft_passes > 0 && sp.drafted > 0, "{backend:?} {drafter:?}: {sp:?}"),
                Drafter::Mtp => unreachable!("the tiny llama has no MTP head"),
            }
        }
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g, &want(i + 2, g.len()), "{backend:?}: stream {i}");
        }
    }
}

/// One batch of every kind of request — greedy, sampled (top-p), penalized, logprobs (the whole
/// row read back), speculative (prompt lookup) and a beam search — gives each request what it
/// gives alone in a batch of its own on a fresh engine: the same ids (same seed, same tokens),
/// the same log-probabilities, the same hypotheses.
#[test]
fn a_batch_of_every_kind_of_request_gives_each_what_it_gives_alone() {
    use webgpu_llm::batcher::{BatchEvent, Batcher, Prepared};
    use webgpu_llm::beam::{BeamOptions, EarlyStopping};
    use webgpu_llm::speculate::{Drafter, Speculation};
    let sampled = |seed, temperature| SamplingParams { seed, temperature, top_p: 0.9, ..SamplingParams::default() };
    let kinds: Vec<(usize, GenerateOptions)> = vec![
        (0, greedy(10)),
        (1, GenerateOptions { sampling: sampled(7, 0.9), ..greedy(10) }),
        (
            2,
            GenerateOptions {
                sampling: SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.5, ..sampled(3, 0.7) },
                ..greedy(10)
            },
        ),
        (3, GenerateOptions { sampling: sampled(5, 1.0), top_candidates: 3, ..greedy(10) }),
        (
            4,
            GenerateOptions {
                speculate: Some(Speculation { drafter: Drafter::Lookup, draft_tokens: 3 }),
                ..greedy(10)
            },
        ),
    ];
    let beams = BeamOptions {
        beams: 3,
        max_tokens: 6,
        stop_ids: Vec::new(),
        length_penalty: 1.0,
        early_stopping: EarlyStopping::Heuristic,
    };
    type Out = (Vec<u32>, Vec<Option<f32>>, Vec<Vec<u32>>);
    // Runs `requests` (the beam search when `None`) in one batch: each one's ids, logprobs and
    // hypotheses.
    let run = |backend, requests: &[Option<usize>]| -> Vec<Out> {
        let mut e = engine(backend, 1024);
        let mut b = Batcher::new(&e, usize::MAX);
        let ids: Vec<_> = requests
            .iter()
            .map(|r| {
                let p: Prepared = match r {
                    Some(k) => Batcher::prepare(&e, &prompt(kinds[*k].0), &kinds[*k].1).unwrap(),
                    None => Batcher::prepare_beams(&e, &prompt(5), &beams).unwrap(),
                };
                b.enqueue(p)
            })
            .collect();
        let mut out: Vec<Out> = vec![(Vec::new(), Vec::new(), Vec::new()); requests.len()];
        let mut ended = 0;
        while ended < requests.len() {
            pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
                let o = &mut out[ids.iter().position(|&i| i == id).unwrap()];
                match ev {
                    BatchEvent::Token(t) => {
                        o.0.push(t.id);
                        o.1.push(t.logprob.as_ref().map(|l| l.logprob));
                    }
                    BatchEvent::Beams(found) => {
                        o.2 = found.into_iter().map(|(h, _)| h.ids).collect();
                        ended += 1;
                    }
                    BatchEvent::Done(_) => ended += 1,
                    BatchEvent::Failed(err) => panic!("{backend:?}: {err}"),
                }
                true
            }))
            .unwrap();
        }
        out
    };
    for backend in BACKENDS {
        let all: Vec<Option<usize>> = (0..kinds.len()).map(Some).chain([None]).collect();
        let together = run(backend, &all);
        // The CPU backend and CPU-style kernels (lavapipe's) give a row the same bits in a batch
        // and alone. GPU-style kernels (a real GPU's, or WEBGPU_LLM_KERNELS=gpu) sum in another
        // order in a batch's tiled product than in a single row's gemv: the same ids and
        // hypotheses, log-probabilities within 1e-3 (an f16 KV cache's rounding of a value).
        let exact = backend == BackendKind::Cpu
            || engine(backend, 64).gpu_model().is_some_and(|m| m.gpu.style == webgpu_llm::gpu::KernelStyle::Cpu);
        for (i, r) in all.iter().enumerate() {
            let alone = run(backend, &[*r]).remove(0);
            let what = format!("{backend:?}: request {i} ({r:?}) in the batch vs alone");
            if exact {
                assert_eq!(together[i], alone, "{what}");
            } else {
                assert_eq!((&together[i].0, &together[i].2), (&alone.0, &alone.2), "{what}");
                for (a, b) in together[i].1.iter().zip(&alone.1) {
                    let close = match (a, b) {
                        (Some(a), Some(b)) => (a - b).abs() < 1e-3,
                        (a, b) => a.is_none() && b.is_none(),
                    };
                    assert!(close, "{what}: logprob {a:?} vs {b:?}");
                }
            }
        }
        assert!(together[3].1.iter().all(Option::is_some), "{backend:?}: the logprobs request has them");
        assert_eq!(together[0].0, want(0, 10), "{backend:?}: greedy is the CPU reference's");
        assert_eq!(together[4].0, want(4, 10), "{backend:?}: speculation keeps greedy's tokens");
        assert_eq!(together[5].2.len(), 3, "{backend:?}: three hypotheses");
    }
}

/// A decode step of more than 32 rows (`GpuOptions::max_batch`, here 72) runs the wide pass
/// (tiled matrix products for the projections and the LM head, each row's own attention): 72
/// requests at once (one-token prompts: each is a row of the first decode step, and the tiny
/// model's 2048-token pool holds a block of each), one decode step of all 72 rows, each giving the CPU reference's greedy tokens, and a sampled
/// request among them drawing what it draws alone.
#[test]
fn seventy_two_rows_a_step_give_the_reference_tokens() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    const ROWS: usize = 72;
    let opts = LoadOptions {
        backend: BackendKind::Gpu,
        context_length: Some(2048),
        gpu: GpuOptions { max_batch: Some(ROWS), kv_tokens: Some(4096), ..GpuOptions::default() },
    };
    let mut e = pollster::block_on(Engine::load(tiny::chat(), opts, &mut |_, _| {})).unwrap();
    assert_eq!(e.gpu_model().unwrap().max_batch(), ROWS);
    // The pool holds 4096 tokens for all sequences; each still at most the 2048 of the context.
    assert_eq!((e.gpu_model().unwrap().pool().blocks(), e.context_length()), (256, 2048));
    // Eight one-token prompts, and the reference's 8 tokens after each.
    let short: Vec<Vec<u32>> = (0..8).map(|i| vec![100 + 37 * i as u32]).collect();
    let reference: Vec<Vec<u32>> = short.iter().map(|p| tiny::greedy(tiny::chat(), p, 8).0).collect();
    let sampled = GenerateOptions {
        sampling: SamplingParams { seed: 11, temperature: 0.9, top_p: 0.9, ..SamplingParams::default() },
        ..greedy(8)
    };
    let run = |e: &mut Engine, requests: &[(usize, &GenerateOptions)]| -> (Vec<Vec<u32>>, usize) {
        let mut b = Batcher::new(e, usize::MAX);
        let ids: Vec<_> = requests
            .iter()
            .map(|(i, o)| b.enqueue(Batcher::prepare(e, &Prompt::Tokens(short[*i].clone()), o).unwrap()))
            .collect();
        let mut got = vec![Vec::new(); requests.len()];
        let mut widest = 0;
        while !b.is_empty() {
            let rows = pollster::block_on(b.step(e, &mut |_| true, &mut |id, ev| {
                match ev {
                    BatchEvent::Token(t) => got[ids.iter().position(|&i| i == id).unwrap()].push(t.id),
                    BatchEvent::Done(_) => {}
                    other => panic!("{other:?}"),
                }
                true
            }))
            .unwrap();
            widest = widest.max(rows);
        }
        (got, widest)
    };
    let (alone, _) = run(&mut e, &[(3, &sampled)]);
    let g = greedy(8);
    let requests: Vec<(usize, &GenerateOptions)> =
        (0..ROWS).map(|i| if i == ROWS - 1 { (3, &sampled) } else { (i % 8, &g) }).collect();
    let (got, widest) = run(&mut e, &requests);
    assert_eq!(widest, ROWS, "every request a row of one decode step");
    for (i, g) in got[..ROWS - 1].iter().enumerate() {
        assert_eq!(g, &reference[i % 8], "request {i}");
    }
    assert_eq!(got[ROWS - 1], alone[0], "the sampled request in the wide batch vs alone");
}
