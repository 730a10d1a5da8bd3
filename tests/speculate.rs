//! Speculative decoding never changes greedy output: on both backends, with both drafters, golden
//! prompts give transformers' greedy tokens, and a repetitive prompt — where prompt lookup's
//! drafts are accepted — gives plain greedy decoding's tokens with fewer forward passes.

mod common;

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
    let mut ids = Vec::new();
    let stats = pollster::block_on(e.generate(prompt, o, &mut |ev| {
        ids.push(ev.id);
        true
    }))
    .unwrap();
    (ids, stats)
}

const STEPS: usize = 12;

#[test]
fn golden_prompts_give_the_golden_greedy_tokens_with_either_drafter() {
    let cases = common::golden("generations.json")["cases"].as_array().unwrap().clone();
    let picked = ["raw_capital_france", "raw_fibonacci", "chat_haiku_sea", "chat_gravity"];
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

#[test]
fn speculation_refuses_sampling_and_bad_settings_before_any_work() {
    let spec = Speculation { drafter: Drafter::Lookup, draft_tokens: 4 };
    let sampled = GenerateOptions {
        sampling: SamplingParams { temperature: 0.8, ..SamplingParams::default() },
        speculate: Some(spec),
        ..Default::default()
    };
    assert!(matches!(sampled.validate(), Err(Error::InvalidOption { name: "speculate", .. })));
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
