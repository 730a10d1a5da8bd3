//! Speculative decoding never changes greedy output: on both backends, with every drafter (prompt
//! lookup, the model's first layers, a draft model), prompts of a tiny random chat model give the
//! CPU reference's greedy tokens (its own loop over the same file), and a prompt whose answer
//! repeats — where prompt lookup's drafts are accepted — gives plain greedy decoding's tokens
//! with fewer forward passes. With sampling it keeps the distribution: tokens drawn with it and
//! without it over many seeds are compared by a chi-square test whose power is shown on a
//! distribution that differs.

use crate::common::tiny;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, Stats};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::speculate::{Drafter, Speculation};
use webgpu_llm::Error;

const BACKENDS: [BackendKind; 2] = [BackendKind::Cpu, BackendKind::Gpu];

fn engine_of(bytes: &[u8], backend: BackendKind) -> Engine {
    let opts = LoadOptions { backend, context_length: Some(512), gpu: GpuOptions::default() };
    pollster::block_on(Engine::load(bytes, opts, &mut |_, _| {})).unwrap()
}

fn engine(backend: BackendKind) -> Engine {
    engine_of(tiny::chat(), backend)
}

/// Prompts 1, 3 and 7 of `tiny::prompts()` with the CPU reference's greedy answers.
fn cases() -> Vec<(Prompt, Vec<u32>)> {
    let prompts = tiny::prompts();
    [1, 3, 7]
        .iter()
        .map(|&i| (Prompt::Tokens(prompts[i].clone()), tiny::greedy(tiny::chat(), &prompts[i], STEPS).0))
        .collect()
}

fn options(max_tokens: usize, speculate: Option<Speculation>) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        speculate,
        ..Default::default()
    }
}

fn run(e: &mut Engine, prompt: &Prompt, o: &GenerateOptions) -> (Vec<u32>, Stats) {
    // From an empty cache, so each run prefills its whole prompt.
    pollster::block_on(e.generate(&Prompt::Tokens(vec![1]), &options(1, None), &mut |_| true)).unwrap();
    let (mut ids, mut positions, mut origins) = (Vec::new(), Vec::new(), Vec::new());
    let stats = pollster::block_on(e.generate(prompt, o, &mut |ev| {
        ids.push(ev.id);
        positions.push(ev.position);
        origins.push(ev.speculation.clone());
        true
    }))
    .unwrap();
    // Each token says whether it was an accepted draft, and an own token which drafts it replaced:
    // together, what the pass counters say.
    match stats.speculation {
        Some(sp) => {
            assert!(origins.iter().all(Option::is_some), "every token's origin");
            let accepted = origins.iter().flatten().filter(|o| o.accepted).count();
            let rejected: usize = origins.iter().flatten().map(|o| o.rejected.len()).sum();
            assert_eq!((accepted, rejected), (sp.accepted, sp.drafted - sp.accepted), "tokens' origins vs {sp:?}");
        }
        None => assert!(origins.iter().all(Option::is_none)),
    }
    // Each token's position: the prompt and the tokens before it, however many one pass kept.
    let first = stats.prompt_tokens + 1;
    assert_eq!(positions, (first..first + ids.len()).collect::<Vec<_>>(), "token positions");
    (ids, stats)
}

const STEPS: usize = 16;

#[test]
fn prompts_give_the_reference_greedy_tokens_with_either_drafter() {
    let cases = cases();
    for backend in BACKENDS {
        let mut e = engine(backend);
        for drafter in [Drafter::Lookup, Drafter::Layers(2)] {
            let spec = Speculation { drafter, draft_tokens: 4 };
            for (n, (prompt, want)) in cases.iter().enumerate() {
                let (ids, stats) = run(&mut e, prompt, &options(STEPS, Some(spec)));
                assert_eq!(&ids, want, "{backend:?} {drafter:?}: case {n}");
                let sp = stats.speculation.expect("speculation stats");
                assert!(sp.accepted <= sp.drafted && sp.passes <= STEPS, "{sp:?}");
                if drafter != Drafter::Lookup {
                    assert!(
                        sp.drafted > 0 && sp.draft_passes > 0,
                        "{backend:?} {drafter:?}: self-speculation drafts every pass: {sp:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn prompt_lookup_on_a_repeating_answer_keeps_the_greedy_tokens_in_fewer_passes() {
    // The reference's answer to this prompt falls into a cycle of five tokens after its sixth:
    // lookup finds each next token earlier in the text.
    let prompt_ids = tiny::chat_prompt(&[("user", "What is the capital of France?")]);
    let (want, _) = tiny::greedy(tiny::chat(), &prompt_ids, 16);
    assert_eq!(want[6..11], want[11..16], "the answer repeats");
    let prompt = Prompt::Tokens(prompt_ids);
    for backend in BACKENDS {
        let mut e = engine(backend);
        let (plain, _) = run(&mut e, &prompt, &options(16, None));
        assert_eq!(plain, want, "{backend:?}: plain greedy decoding");
        for k in [1, 4, 7] {
            let spec = Speculation { drafter: Drafter::Lookup, draft_tokens: k };
            let (ids, stats) = run(&mut e, &prompt, &options(16, Some(spec)));
            assert_eq!(ids, plain, "{backend:?} K {k}");
            let sp = stats.speculation.unwrap();
            assert!(
                sp.accepted > 0 && sp.passes < 15,
                "{backend:?} K {k}: drafts of repeated text are accepted: {sp:?}"
            );
        }
    }
}

/// Chi-square critical values at significance 0.001, by degrees of freedom 1..=30.
const CHI2_001: [f64; 30] = [
    10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70, 39.25,
    40.79, 42.31, 43.82, 45.32, 46.80, 48.27, 49.73, 51.18, 52.62, 54.05, 55.48, 56.89, 58.30, 59.70,
];

/// The two-sample chi-square statistic of two samples of tokens of equal size, categories with
/// fewer than 10 draws in both together merged into one; with its degrees of freedom.
fn chi_square(a: &[u32], b: &[u32]) -> (f64, usize) {
    let mut counts = std::collections::BTreeMap::<u32, (f64, f64)>::new();
    a.iter().for_each(|&t| counts.entry(t).or_default().0 += 1.0);
    b.iter().for_each(|&t| counts.entry(t).or_default().1 += 1.0);
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut rare = (0.0, 0.0);
    for (_, (x, y)) in counts {
        if x + y < 10.0 {
            rare = (rare.0 + x, rare.1 + y);
        } else {
            cells.push((x, y));
        }
    }
    if rare.0 + rare.1 > 0.0 {
        cells.push(rare);
    }
    // Equal sample sizes: sum (x - y)^2 / (x + y).
    let stat = cells.iter().map(|(x, y)| (x - y).powi(2) / (x + y)).sum();
    (stat, cells.len().saturating_sub(1))
}

/// The tokens at positions 1 and 2 of `runs` generations (seeds from `seed0`), and the summed
/// speculation stats.
fn sample_runs(
    e: &mut Engine,
    prompt: &Prompt,
    temperature: f32,
    speculate: Option<Speculation>,
    seed0: u64,
    runs: u64,
) -> (Vec<u32>, Vec<u32>, usize, usize) {
    let (mut second, mut third, mut drafted, mut accepted) = (Vec::new(), Vec::new(), 0, 0);
    for seed in seed0..seed0 + runs {
        let o = GenerateOptions {
            max_tokens: 3,
            sampling: SamplingParams {
                temperature,
                top_k: 4,
                top_p: 1.0,
                min_p: 0.0,
                seed,
                ..SamplingParams::default()
            },
            ignore_eos: true,
            speculate,
            ..Default::default()
        };
        let mut ids = Vec::new();
        let stats = pollster::block_on(e.generate(prompt, &o, &mut |ev| {
            ids.push(ev.id);
            true
        }))
        .unwrap();
        second.push(ids[1]);
        third.push(ids[2]);
        if let Some(sp) = stats.speculation {
            drafted += sp.drafted;
            accepted += sp.accepted;
        }
    }
    (second, third, drafted, accepted)
}

/// Speculative sampling against plain sampling, on the CPU backend (the exact f32 reference):
/// 400 seeded generations each of a repetitive prompt (prompt lookup drafts after most tokens),
/// at temperature 1 with top-k 4; the 2nd and 3rd tokens (the ones drafted and checked) compared
/// by a two-sample chi-square test at significance 0.001 (a false alarm once in a thousand
/// seeds' choices). Power: the same test, same size, must tell plain sampling at temperature 1
/// from plain sampling at temperature 0.5 — mass moved onto the likeliest tokens, the shift a
/// wrong accept rule makes (keeping every draft moves mass onto the drafts) — and does.
/// About 1,200 short generations of the tiny model: seconds.
#[test]
fn speculative_sampling_draws_tokens_as_plain_sampling_does() {
    let mut e = engine(BackendKind::Cpu);
    // A question and the first 15 tokens of the reference's answer, which cycle: the tokens
    // drawn next are mostly the cycle's, which prompt lookup finds earlier and drafts.
    let mut ids = tiny::chat_prompt(&[("user", "What is the capital of France?")]);
    ids.extend(tiny::greedy(tiny::chat(), &ids, 15).0);
    let prompt = Prompt::Tokens(ids);
    let spec = Speculation { drafter: Drafter::Lookup, draft_tokens: 3 };
    let runs = 400;
    let (p2, p3, _, _) = sample_runs(&mut e, &prompt, 1.0, None, 0, runs);
    let (s2, s3, drafted, accepted) = sample_runs(&mut e, &prompt, 1.0, Some(spec), 100_000, runs);
    assert!(accepted > 0 && accepted < drafted, "both the accept and the resample branch ran: {accepted} of {drafted}");
    for (what, a, b) in [("2nd token", &p2, &s2), ("3rd token", &p3, &s3)] {
        let (stat, df) = chi_square(a, b);
        eprintln!("{what}: chi-square {stat:.2} with {df} degrees of freedom (critical {})", CHI2_001[df.max(1) - 1]);
        assert!(df >= 1 && stat < CHI2_001[df - 1], "{what}: chi-square {stat:.2} with {df} degrees of freedom");
    }
    let (c2, _, _, _) = sample_runs(&mut e, &prompt, 0.5, None, 200_000, runs);
    let (stat, df) = chi_square(&p2, &c2);
    assert!(df >= 1 && stat > CHI2_001[df - 1], "the test tells temperature 1 from 0.5: chi-square {stat:.2}, {df} df");
    eprintln!(
        "speculative vs plain sampling: {accepted} of {drafted} drafts kept; control chi-square {stat:.1} ({df} df)"
    );
}

#[test]
fn speculation_refuses_bad_settings_before_any_work() {
    let spec = Speculation { drafter: Drafter::Lookup, draft_tokens: 4 };
    let with_candidates = GenerateOptions { top_candidates: 5, speculate: Some(spec), ..Default::default() };
    assert!(matches!(with_candidates.validate(), Err(Error::InvalidOption { name: "speculate", .. })));
    let too_many = options(8, Some(Speculation { draft_tokens: 40, ..spec }));
    assert!(matches!(too_many.validate(), Err(Error::InvalidOption { name: "draft tokens", .. })));
    for backend in BACKENDS {
        let mut e = engine(backend);
        let layers = tiny::CHAT.layers as usize;
        let all_layers = options(8, Some(Speculation { drafter: Drafter::Layers(layers), draft_tokens: 2 }));
        let err =
            pollster::block_on(e.generate(&Prompt::Text("Hello".into()), &all_layers, &mut |_| true)).unwrap_err();
        assert!(matches!(err, Error::InvalidOption { name: "speculate", .. }), "{backend:?}: {err}");
    }
}

#[test]
fn a_draft_model_with_the_same_tokenizer_keeps_the_reference_tokens_and_another_tokenizer_is_refused() {
    let mut e = engine(BackendKind::Gpu);
    let spec = Speculation { drafter: Drafter::Model, draft_tokens: 4 };
    // Without a draft model: a typed error before any work.
    let err = pollster::block_on(e.generate(&Prompt::Text("Hello".into()), &options(4, Some(spec)), &mut |_| true))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidOption { name: "speculate", .. }), "{err}");
    // Another vocabulary, or the same size with one token spelled otherwise: refused, saying how.
    let smaller = tiny::Tiny { vocab: 1024, ..tiny::CHAT }.bytes();
    let err = e.set_draft_model(engine_of(&smaller, BackendKind::Cpu)).unwrap_err();
    assert!(matches!(err, Error::InvalidOption { name: "draft model", .. }), "{err}");
    assert!(err.to_string().contains("1024 tokens, not 2048"), "{err}");
    let renamed = tiny::CHAT.bytes_with(|tokens| tokens[300] = "\u{120}renamed".into());
    let err = e.set_draft_model(engine_of(&renamed, BackendKind::Cpu)).unwrap_err();
    assert!(err.to_string().contains("its token 300 is \"Ġrenamed\""), "{err}");
    // The model as its own draft model (a second copy, with its own cache): its drafts are the
    // model's own greedy tokens, so they are accepted (bar rounding between the draft's decode
    // steps and the verifying pass's rows) and the output is the reference's greedy tokens.
    e.set_draft_model(engine(BackendKind::Gpu)).unwrap();
    for (n, (prompt, want)) in cases().iter().enumerate() {
        let (ids, stats) = run(&mut e, prompt, &options(STEPS, Some(spec)));
        assert_eq!(&ids, want, "case {n}");
        let sp = stats.speculation.expect("speculation stats");
        assert!(sp.drafted > 0 && sp.accepted * 10 >= sp.drafted * 9, "case {n}: {sp:?}");
        assert!(sp.passes * 2 < STEPS, "case {n}: up to 5 tokens a pass: {sp:?}");
    }
    // Another model with the same tokenizer (other weights): most drafts are rejected, and the
    // output is still the reference's.
    let other = tiny::Tiny { seed: 7, ..tiny::CHAT }.bytes();
    e.set_draft_model(engine_of(&other, BackendKind::Gpu)).unwrap();
    for (n, (prompt, want)) in cases().iter().enumerate() {
        let (ids, stats) = run(&mut e, prompt, &options(STEPS, Some(spec)));
        assert_eq!(&ids, want, "another draft model, case {n}");
        let sp = stats.speculation.expect("speculation stats");
        assert!(sp.drafted > sp.accepted, "another draft model, case {n}: some drafts rejected: {sp:?}");
    }
}
