//! The engine compiled to wasm, in headless Chromium's WebGPU: a greedy generation from the
//! default model equals the golden ids, and the seeded RNG gives the published sequence. The
//! model is fetched from WEBGPU_LLM_TEST_MODEL_URL (set at build time by scripts/test, which
//! serves models/ with CORS on 127.0.0.1).
#![cfg(target_arch = "wasm32")]

use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;
use wasm_bindgen_test::*;
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::{Rng, SamplingParams};

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
    let want: Vec<u32> =
        case["generated_ids"].as_array().unwrap()[..8].iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(ids, want);
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
