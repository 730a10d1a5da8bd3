//! Speculative decoding never changes greedy output: on both backends, with both drafters, golden
//! prompts give transformers' greedy tokens, and a repetitive prompt — where prompt lookup's
//! drafts are accepted — gives plain greedy decoding's tokens with fewer forward passes. With
//! sampling it keeps the distribution: tokens drawn with it and without it over many seeds are
//! compared by a chi-square test whose power is shown on a distribution that differs.

use crate::common;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, Stats};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::speculate::{Drafter, Speculation};
use webgpu_llm::Error;

const BACKENDS: [BackendKind; 2] = [BackendKind::Cpu, BackendKind::Gpu];

fn engine(backend: BackendKind) -> Engine {
    let opts = LoadOptions { backend, context_length: Some(512), gpu: GpuOptions::default() };
    pollster::block_on(Engine::load(common::model_bytes(), opts, &mut |_, _| {})).unwrap()
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

const STEPS: usize = 10;

#[test]
fn golden_prompts_give_the_golden_greedy_tokens_with_either_drafter() {
    let cases = common::golden("generations.json")["cases"].as_array().unwrap().clone();
    let picked = ["raw_capital_france", "raw_fibonacci", "chat_gravity"];
    for backend in BACKENDS {
        let mut e = engine(backend);
        for drafter in [Drafter::Lookup, Drafter::Layers(8)] {
            let spec = Speculation { drafter, draft_tokens: 4 };
            for case in cases.iter().filter(|c| picked.contains(&c["name"].as_str().unwrap())) {
                let prompt = Prompt::Tokens(common::ids(&case["prompt_ids"]));
                let (ids, stats) = run(&mut e, &prompt, &options(STEPS, Some(spec)));
                assert_eq!(
                    ids,
                    common::ids(&case["generated_ids"])[..STEPS],
                    "{backend:?} {drafter:?}: {}",
                    case["name"]
                );
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
fn prompt_lookup_on_a_repetitive_prompt_keeps_the_greedy_tokens_in_fewer_passes() {
    let text =
        "The cat sat on the mat. The dog sat on the rug. The cat sat on the mat. The dog sat on the rug. The cat";
    let prompt = Prompt::Text(text.into());
    for backend in BACKENDS {
        let mut e = engine(backend);
        let (plain, _) = run(&mut e, &prompt, &options(16, None));
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

/// Chi-square critical values at significance 0.001, by degrees of freedom 1..=10.
const CHI2_001: [f64; 10] = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59];

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
/// 400 seeded generations each of a repetitive prompt (prompt lookup drafts after every token),
/// at temperature 1 with top-k 4; the 2nd and 3rd tokens (the ones drafted and checked) compared
/// by a two-sample chi-square test at significance 0.001 (a false alarm once in a thousand
/// seeds' choices). Power: the same test, same size, must tell plain sampling at temperature 1
/// from plain sampling at temperature 0.5 — mass moved onto the likeliest tokens, the shift a
/// wrong accept rule makes (keeping every draft moves mass onto the drafts) — and does.
/// About 1,200 short generations: minutes on a 2-core machine, so it runs on request
/// (`cargo test --release --test speculate -- --ignored`), not in `scripts/test`.
#[test]
#[ignore]
fn speculative_sampling_draws_tokens_as_plain_sampling_does() {
    let mut e = engine(BackendKind::Cpu);
    let prompt = Prompt::Text("one two three four, one two three four, one two three four, one two".into());
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
        let all_layers = options(8, Some(Speculation { drafter: Drafter::Layers(30), draft_tokens: 2 }));
        let err =
            pollster::block_on(e.generate(&Prompt::Text("Hello".into()), &all_layers, &mut |_| true)).unwrap_err();
        assert!(matches!(err, Error::InvalidOption { name: "speculate", .. }), "{backend:?}: {err}");
    }
}

#[test]
fn a_draft_model_with_the_same_tokenizer_keeps_the_golden_tokens_and_another_tokenizer_is_refused() {
    let cases = common::golden("generations.json")["cases"].as_array().unwrap().clone();
    let mut e = engine(BackendKind::Gpu);
    let spec = Speculation { drafter: Drafter::Model, draft_tokens: 4 };
    // Without a draft model: a typed error before any work.
    let err = pollster::block_on(e.generate(&Prompt::Text("Hello".into()), &options(4, Some(spec)), &mut |_| true))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidOption { name: "speculate", .. }), "{err}");
    // Gemma's tokenizer is not SmolLM2's: refused, saying how they differ.
    let gemma = {
        let opts = LoadOptions { backend: BackendKind::Cpu, context_length: Some(64), gpu: GpuOptions::default() };
        pollster::block_on(Engine::load(common::Reference::Gemma3.bytes(), opts, &mut |_, _| {})).unwrap()
    };
    let err = e.set_draft_model(gemma).unwrap_err();
    assert!(matches!(err, Error::InvalidOption { name: "draft model", .. }), "{err}");
    assert!(err.to_string().contains("262144 tokens, not 49152"), "{err}");
    // The model as its own draft model (a second copy, with its own cache): its drafts are the
    // model's own greedy tokens, so they are accepted (bar rounding between the draft's decode
    // steps and the verifying pass's rows) and the output is transformers' greedy tokens.
    e.set_draft_model(engine(BackendKind::Gpu)).unwrap();
    for case in cases.iter().filter(|c| ["raw_fibonacci", "chat_gravity"].contains(&c["name"].as_str().unwrap())) {
        let prompt = Prompt::Tokens(common::ids(&case["prompt_ids"]));
        let (ids, stats) = run(&mut e, &prompt, &options(STEPS, Some(spec)));
        assert_eq!(ids, common::ids(&case["generated_ids"])[..STEPS], "{}", case["name"]);
        let sp = stats.speculation.expect("speculation stats");
        assert!(sp.drafted > 0 && sp.accepted * 10 >= sp.drafted * 9, "{}: {sp:?}", case["name"]);
        assert!(sp.passes * 2 < STEPS, "{}: up to 5 tokens a pass: {sp:?}", case["name"]);
    }
}
