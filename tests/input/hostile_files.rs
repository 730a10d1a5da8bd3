//! Hostile GGUF files: a count, length or size that claims more than the file holds is an error
//! naming the key and its value, found before anything is sized from it, in milliseconds and
//! without memory beyond the file's own size; a metadata array costs about its bytes.

use crate::common;
use crate::layout;
use crate::meter;

use meter::Usage;
use std::time::Duration;
use webgpu_llm::arch::Plan;
use webgpu_llm::gguf::{Array, Gguf, GgufError, GgufWriter, Value};
use webgpu_llm::model::{CpuModel, ModelConfig, ModelInfo};
use webgpu_llm::Error;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Far above any case here: an allocation past it fails (and aborts the test) at once.
const CEILING: usize = 1 << 30;
/// Each failing load below takes well under a millisecond of CPU time; the margin is for a slow
/// machine.
const PATIENCE: Duration = Duration::from_secs(1);

/// `f` timed (the thread's CPU time) and metered; fails past `PATIENCE`.
fn run<R>(what: &str, f: impl FnOnce() -> R) -> (R, Usage, Duration) {
    let start = common::thread_cpu_time();
    let (result, usage) = meter::measure(CEILING, f);
    let elapsed = common::thread_cpu_time() - start;
    assert!(elapsed < PATIENCE, "{what}: took {elapsed:?}");
    (result, usage, elapsed)
}

/// `bytes` with the scalar value of `key` set to `value`, in the width the file gives it.
fn with_value(bytes: &[u8], key: &str, value: u64) -> Vec<u8> {
    let field = layout::value_field(bytes, key).unwrap_or_else(|| panic!("{key} is a scalar in the file"));
    assert!(field.width == 8 || value < 1 << (8 * field.width), "{value} does not fit {key}'s {} bytes", field.width);
    let mut out = bytes.to_vec();
    field.write(&mut out, value);
    out
}

/// The default model's header (the bytes before its tensor data) and the file's length.
fn default_header() -> (&'static [u8], u64) {
    let bytes = common::model_bytes();
    (&bytes[..common::model_gguf().data_offset as usize], bytes.len() as u64)
}

fn assert_invalid(err: &Error, key: &str, value: &str) {
    match err {
        Error::InvalidMetadata { key: k, value: v, .. } if k == key && v == value => {
            let msg = err.to_string();
            assert!(msg.contains(key) && msg.contains(value), "the message names both: {msg}");
        }
        other => panic!("expected InvalidMetadata for {key} = {value}, got {other:?}"),
    }
}

#[test]
fn a_block_count_past_the_tensor_count_is_an_early_error_naming_the_key() {
    let whole = common::model_bytes();
    let n_tensors = common::model_gguf().tensors.len() as u64;
    // Before: 10^9 layers aborted on a 216 GB allocation; 10^7 took 39 s and 13.7 GB to fail.
    for layers in [n_tensors + 1, 10_000_000, 1_000_000_000, u32::MAX as u64] {
        let mut file = whole.to_vec();
        let header = with_value(&whole[..common::model_gguf().data_offset as usize], "llama.block_count", layers);
        file[..header.len()].copy_from_slice(&header);
        let gguf = Gguf::parse(&file).unwrap();
        let what = format!("block_count {layers}");
        let (result, usage, elapsed) = run(&what, || CpuModel::load(&gguf, &file).map(drop));
        assert_invalid(&result.unwrap_err(), "llama.block_count", &layers.to_string());
        assert!(usage.peak < 64 * KIB, "{what}: {usage:?}");
        let (info, _, _) = run(&what, || ModelInfo::new(&gguf, file.len() as u64, None));
        assert_invalid(&info.unwrap_err(), "llama.block_count", &layers.to_string());
        eprintln!("{what}: error in {elapsed:?}, peak {} bytes", usage.peak);
    }
}

#[test]
fn a_block_count_past_the_layers_stops_at_the_first_missing_layer() {
    let (header, len) = default_header();
    // As many layers as tensors passes the count check; layer 30 is the first the file lacks.
    let n_tensors = common::model_gguf().tensors.len() as u64;
    let gguf = Gguf::parse_prefix(&with_value(header, "llama.block_count", n_tensors), len).unwrap();
    let (result, usage, _) = run("block_count = tensor count", || Plan::from_gguf(&gguf, None).map(drop));
    match result.unwrap_err() {
        Error::Gguf(GgufError::MissingTensor { name }) => assert_eq!(name, "blk.30.attn_norm.weight"),
        other => panic!("expected the first missing layer's tensor, got {other:?}"),
    }
    // The 30 planned layers, not 272.
    assert!(usage.peak < 64 * KIB, "{usage:?}");
}

#[test]
fn head_width_and_rope_values_that_do_not_fit_the_tensors_are_errors_naming_the_key() {
    let (header, len) = default_header();
    let big = [1_000_000_000, u32::MAX as u64];
    let mut cases: Vec<(&str, u64)> = vec![
        ("llama.attention.head_count", 0),
        ("llama.attention.head_count", 3), // 3 heads of 192: 576 wide, but 3 % 3 kv heads is fine
        ("llama.attention.head_count_kv", 0),
        ("llama.attention.head_count_kv", 2),
        ("llama.embedding_length", 0),
        ("llama.embedding_length", 577),
        ("llama.feed_forward_length", 0),
        ("llama.feed_forward_length", 1535),
        ("llama.context_length", 0),
        ("llama.rope.dimension_count", 0),
        ("llama.rope.dimension_count", 63),
        ("llama.rope.dimension_count", 66),
        ("llama.vocab_size", 0),
        ("llama.vocab_size", 49153),
    ];
    for key in [
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.rope.dimension_count",
        "llama.vocab_size",
    ] {
        cases.extend(big.map(|v| (key, v)));
    }
    for (key, value) in cases {
        let gguf = Gguf::parse_prefix(&with_value(header, key, value), len).unwrap();
        let what = format!("{key} = {value}");
        let (result, usage, _) = run(&what, || Plan::from_gguf(&gguf, None).map(drop));
        let err = result.expect_err(&what);
        if (key, value) == ("llama.attention.head_count", 3) {
            // 3 heads of 192 values fill the 576 inputs of attn_output, but not attn_q's shape.
            assert!(matches!(err, Error::Gguf(GgufError::UnexpectedShape { .. })), "{what}: {err:?}");
        } else {
            assert_invalid(&err, key, &value.to_string());
        }
        assert!(usage.peak < 64 * KIB, "{what}: {usage:?}");
    }
}

#[test]
fn a_head_size_that_does_not_fit_the_tensors_is_an_error_naming_key_length() {
    // The tiny Qwen 3 states its head size: 4 heads of 32.
    let bytes = std::fs::read("tests/data/arch/qwen3/model.gguf").unwrap();
    for value in [0, 31, 1 << 20, u32::MAX as u64] {
        let gguf = Gguf::parse(&with_value(&bytes, "qwen3.attention.key_length", value)).unwrap();
        let what = format!("key_length {value}");
        let (result, usage, _) = run(&what, || ModelConfig::from_gguf(&gguf).map(drop));
        assert_invalid(&result.unwrap_err(), "qwen3.attention.key_length", &value.to_string());
        assert!(usage.peak < 4 * KIB, "{what}: {usage:?}");
    }
    let gguf = Gguf::parse(&with_value(&bytes, "qwen3.attention.value_length", 1 << 30)).unwrap();
    assert_invalid(&ModelConfig::from_gguf(&gguf).unwrap_err(), "qwen3.attention.value_length", "1073741824");
}

#[test]
fn the_largest_context_gives_exact_model_figures_without_overflow() {
    let (header, len) = default_header();
    let gguf = Gguf::parse_prefix(&with_value(header, "llama.context_length", u32::MAX as u64), len).unwrap();
    let info = ModelInfo::new(&gguf, len, Some(usize::MAX)).unwrap();
    assert_eq!(info.context, u32::MAX as usize);
    // 30 layers, K and V of 3 heads of 64, in f32.
    assert_eq!(info.kv_bytes_f32, 30 * 2 * 192 * u32::MAX as u64 * 4);
}

/// Bytes of a file whose only metadata is `value` under "a".
fn file_with(value: Value) -> Vec<u8> {
    let mut w = GgufWriter::new(3);
    w.metadata("a", value);
    w.to_bytes()
}

/// Parses `bytes`; returns the array under "a" with what parsing cost.
fn parse_metered(bytes: &[u8]) -> (Gguf, Usage) {
    let (gguf, usage, _) = run("parse", || Gguf::parse(bytes).unwrap());
    (gguf, usage)
}

#[test]
fn a_ten_million_element_u8_array_costs_its_bytes_not_thirty_times_them() {
    // Before: 32 bytes per element (the Value enum), 320 MB for this 10 MB file.
    let n = 10_000_000;
    let bytes = file_with(Value::List(Array::U8((0..n).map(|i| i as u8).collect())));
    let (gguf, usage) = parse_metered(&bytes);
    let a = gguf.get_array("a").unwrap().unwrap();
    assert_eq!((a.len(), a.get(n - 1).unwrap().as_u64()), (n, Some((n - 1) as u8 as u64)));
    assert!(usage.peak <= bytes.len() + 64 * KIB, "{usage:?} for {} bytes", bytes.len());
    assert!(usage.largest <= bytes.len(), "{usage:?}");
    eprintln!("u8 array of {n}: file {} bytes, parse peak {} bytes", bytes.len(), usage.peak);
}

#[test]
fn arrays_of_every_kind_cost_at_most_twice_their_bytes() {
    let n = 1_000_000;
    let strings: Vec<String> = (0..n).map(|i| format!("{:x}", i % 4096)).collect();
    let cases = [
        ("i32", Value::List(Array::I32((0..n as i32).collect()))),
        ("f64", Value::List(Array::F64((0..n).map(|i| i as f64).collect()))),
        ("bool", Value::List(Array::Bool((0..n).map(|i| i % 3 == 0).collect()))),
        ("strings", Value::List(Array::from(strings))),
        // Nested arrays cost an element each (32 bytes) for the 12 bytes of an empty one.
        ("nested", Value::List(Array::Array(vec![Array::U8(Vec::new()); n / 10]))),
    ];
    for (what, value) in cases {
        let bytes = file_with(value.clone());
        let (gguf, usage) = parse_metered(&bytes);
        assert_eq!(gguf.get("a"), Some(&value), "{what}");
        let bound = if what == "nested" { 3 * bytes.len() } else { 2 * bytes.len() };
        assert!(usage.peak <= bound, "{what}: {usage:?} for {} bytes", bytes.len());
        eprintln!("{what}: file {} bytes, parse peak {} bytes", bytes.len(), usage.peak);
    }
}

#[test]
fn counts_past_a_header_prefix_allocate_nothing_before_failing() {
    // The page parses the first MiB of a header, then more as it asks; a count that the whole
    // file could hold but the prefix cannot must cost no more than the prefix before it fails.
    // Before: a tensor count of 4 million reserved 328 MB, a metadata count 478 MB.
    let whole = common::model_bytes();
    let len = whole.len() as u64;
    let mut tried = 0;
    for prefix in [&whole[..MIB], &whole[..common::model_gguf().data_offset as usize]] {
        let counts = layout::fields(prefix).into_iter().filter(|f| {
            matches!(f.kind, layout::Kind::TensorCount | layout::Kind::KvCount | layout::Kind::ArrayLength { .. })
        });
        for field in counts {
            // The most items of 24, 13, 8 and 1 bytes the rest of the file could hold.
            let rest = len - field.offset as u64 - 8;
            for count in [rest / 24, rest / 13, rest / 8, rest] {
                let mut bytes = prefix.to_vec();
                field.write(&mut bytes, count);
                let what = format!("{:?} at {} = {count} in {} bytes", field.kind, field.offset, prefix.len());
                let (result, usage, _) = run(&what, || Gguf::parse_prefix(&bytes, len).map(drop));
                assert!(result.is_err(), "{what} parsed");
                assert!(usage.largest <= prefix.len(), "{what}: {usage:?}");
                assert!(usage.peak <= 2 * prefix.len(), "{what}: {usage:?}");
                tried += 1;
            }
        }
    }
    // Tensor and metadata counts of both prefixes, and the arrays.
    assert!(tried >= 2 * 2 * 4 + 4, "{tried}");
}

/// Before the bound: these 0.5 MB of tokens took 1.3 s and 370 MB.
#[test]
fn sentencepiece_merges_cost_about_the_vocabulary_not_its_cube() {
    // "a", "aa", ..., 1000 a's: token k splits k - 1 ways into two tokens of the vocabulary, so
    // the merges hold m^2 / 2 pairs of m^3 / 3 bytes.
    let m = 1000;
    let mut w = GgufWriter::new(3);
    w.metadata("tokenizer.ggml.model", Value::String("llama".into()));
    w.metadata("tokenizer.ggml.tokens", Value::List(Array::from((1..=m).map(|k| "a".repeat(k)).collect::<Vec<_>>())));
    w.metadata("tokenizer.ggml.scores", Value::List(Array::F32((0..m).map(|i| i as f32).collect())));
    let bytes = w.to_bytes();
    let gguf = Gguf::parse(&bytes).unwrap();
    let (result, usage, elapsed) =
        run("SentencePiece merges", || webgpu_llm::tokenizer::Tokenizer::from_gguf(&gguf).map(drop));
    let err = result.expect_err("a vocabulary of 1000 a-runs is refused");
    assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");
    // The fuzzer's bound (tests/fuzz_load.rs).
    assert!(usage.peak <= 16 * bytes.len() + 16 * MIB, "{usage:?} for {} bytes in {elapsed:?}", bytes.len());
}
