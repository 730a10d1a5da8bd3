//! The engine compiled to wasm, in headless Chromium's WebGPU: a greedy generation from the
//! default model equals the golden ids, alone, with three golden prompts in one batch, and with
//! speculative decoding; and the seeded RNG gives the published sequence. The
//! model is fetched from WEBGPU_LLM_TEST_MODEL_URL (set at build time by scripts/test, which
//! serves models/ with CORS on 127.0.0.1).
#![cfg(target_arch = "wasm32")]

use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;
use wasm_bindgen_test::*;
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::{Rng, SamplingParams};
use webgpu_llm::speculate::{Drafter, Speculation};

wasm_bindgen_test_configure!(run_in_browser);

const GENERATIONS: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/golden/generations.json"));

async fn fetch_model() -> Vec<u8> {
    let url =
        option_env!("WEBGPU_LLM_TEST_MODEL_URL").expect("build with WEBGPU_LLM_TEST_MODEL_URL set (scripts/test does)");
    let window = web_sys::window().expect("a browser window");
    let response: web_sys::Response =
        JsFuture::from(window.fetch_with_str(url)).await.expect("the model server answers").dyn_into().unwrap();
    assert!(response.ok(), "GET {url}: HTTP {}", response.status());
    let buffer = JsFuture::from(response.array_buffer().unwrap()).await.unwrap();
    js_sys::Uint8Array::new(&buffer).to_vec()
}

#[wasm_bindgen_test]
async fn greedy_generation_in_the_browser_equals_the_golden_ids() {
    let golden: serde_json::Value = serde_json::from_str(GENERATIONS).unwrap();
    let case = &golden["cases"][0];
    assert_eq!(case["name"], "raw_capital_france");
    let bytes = fetch_model().await;
    let options = LoadOptions { backend: BackendKind::Gpu, context_length: Some(256), gpu: GpuOptions::default() };
    let mut engine = Engine::load(&bytes, options, &mut |_, _| {}).await.unwrap();
    drop(bytes);
    let opts =
        GenerateOptions { max_tokens: 8, sampling: SamplingParams::greedy(), ignore_eos: true, ..Default::default() };
    let mut ids = Vec::new();
    let prompt = Prompt::Text(case["prompt_text"].as_str().unwrap().into());
    engine
        .generate(&prompt, &opts, &mut |ev| {
            ids.push(ev.id);
            true
        })
        .await
        .unwrap();
    let golden_ids = |c: &serde_json::Value, key: &str| -> Vec<u32> {
        c[key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
    };
    assert_eq!(ids, golden_ids(case, "generated_ids")[..8]);

    // Three golden prompts as one batch: each its golden ids.
    let cases = &golden["cases"].as_array().unwrap()[..3];
    let short = GenerateOptions { max_tokens: 6, ..opts.clone() };
    let requests: Vec<(Prompt, GenerateOptions)> =
        cases.iter().map(|c| (Prompt::Tokens(golden_ids(c, "prompt_ids")), short.clone())).collect();
    let mut batch = vec![Vec::new(); cases.len()];
    engine
        .generate_batch(&requests, &mut |seq, ev| {
            batch[seq].push(ev.id);
            true
        })
        .await
        .unwrap();
    for (c, got) in cases.iter().zip(&batch) {
        assert_eq!(got, &golden_ids(c, "generated_ids")[..6], "batched: {}", c["name"]);
    }

    // Speculative decoding with prompt lookup: the golden ids again.
    let speculate = Some(Speculation { drafter: Drafter::Lookup, draft_tokens: 3 });
    let mut spec = Vec::new();
    engine
        .generate(&prompt, &GenerateOptions { speculate, ..opts }, &mut |ev| {
            spec.push(ev.id);
            true
        })
        .await
        .unwrap();
    assert_eq!(spec, golden_ids(case, "generated_ids")[..8], "speculative");
}

#[wasm_bindgen_test]
fn the_seeded_rng_gives_the_same_sequence_as_natively() {
    // From an independent Python implementation of splitmix64 + xoshiro256** (as in tests/sampling.rs).
    let mut rng = Rng::new(42);
    assert_eq!(
        [rng.next_u64(), rng.next_u64(), rng.next_u64()],
        [0x15780b2e0c2ec716, 0x6104d9866d113a7e, 0xae17533239e499a1]
    );
}
