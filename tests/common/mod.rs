//! Shared by the integration tests: where the golden data and the default model are, loaded once.
#![allow(dead_code)]

use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;
use webgpu_llm::gguf::Gguf;
use webgpu_llm::model::CpuModel;

pub fn golden_dir() -> PathBuf {
    std::env::var_os("GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/golden"))
}

pub fn golden(name: &str) -> Value {
    let path = golden_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden file is valid JSON")
}

pub fn model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The default model's bytes; the tests need it (scripts/fetch-model puts it there).
pub fn model_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        std::fs::read(model_path())
            .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-model first", model_path().display()))
    })
}

pub fn model_gguf() -> &'static Gguf {
    static GGUF: OnceLock<Gguf> = OnceLock::new();
    GGUF.get_or_init(|| Gguf::parse(model_bytes()).expect("the default model parses"))
}

pub fn cpu_model() -> &'static CpuModel {
    static MODEL: OnceLock<CpuModel> = OnceLock::new();
    MODEL.get_or_init(|| CpuModel::load(model_gguf(), model_bytes()).expect("the default model loads"))
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("array of ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

pub fn floats(v: &Value) -> Vec<f64> {
    v.as_array().expect("array of numbers").iter().map(|x| x.as_f64().expect("number")).collect()
}

/// -log softmax(row)[target], in f64 from f32 logits (as the golden NLLs were computed).
pub fn nll(row: &[f32], target: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_sum = row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln() + max;
    log_sum - row[target as usize] as f64
}
