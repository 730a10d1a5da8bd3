//! The native CLI as a user runs it, on tiny models: ids with --json, text and stats, beams,
//! split files, usage errors and exit codes, bench's per-step counters, Ctrl-C. The models: the
//! committed tiny qwen2 (llama.cpp's converter; its first reference prompt is text that encodes
//! to the same ids, so its transformers greedy ids are the truth on both backends), the tiny chat
//! model (tests/common/tiny.rs: readable word tokens, ChatML), a tiny gemma3 made here
//! (SentencePiece, sliding windows); where transformers has no answer the CPU reference's own
//! loop over `CpuModel::forward` is it.

use crate::common;
use crate::common::tiny::{self, Xorshift};

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use webgpu_llm::gguf::{Array, GgmlType, Gguf, GgufWriter, Value as GgufValue};
use webgpu_llm::model::{CpuModel, Logits};

fn exe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_webgpu-llm"))
}

/// A committed tiny model (tests/data/arch/<name>/model.gguf).
fn arch(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/arch").join(name).join("model.gguf")
}

/// The model the flag tests name: they are refused before it matters, or after it loads.
fn default_model() -> PathBuf {
    arch("qwen2")
}

fn cli(args: &[&str]) -> Output {
    cli_on(&default_model(), args)
}

fn cli_on(model: &Path, args: &[&str]) -> Output {
    // Bench and generate take --model; unknown subcommands fail before it matters.
    exe().args(args).arg("--model").arg(model).output().expect("the CLI runs")
}

/// stdout of a `--json` run: one object per line.
fn json_lines(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// A model file in the temporary directory, removed when dropped.
struct TempModel(PathBuf);

impl TempModel {
    fn new(tag: &str, bytes: &[u8]) -> Self {
        let path = std::env::temp_dir().join(format!("webgpu-llm-cli-{tag}-{}.gguf", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        Self(path)
    }
}

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The tiny qwen2's first transformers reference case: its prompt ids, 16 greedy ids, and the
/// prompt as text (it encodes to those ids: `<|im_start|>` is one special token).
struct QwenCase {
    prompt: &'static str,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
}

fn qwen2_case() -> QwenCase {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/arch/qwen2/reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let case = &reference["cases"][0];
    let case = QwenCase {
        prompt: "<|im_start|>^ onC of",
        prompt_ids: common::ids(&case["prompt_ids"]),
        greedy_ids: common::ids(&case["greedy_ids"]),
    };
    // Transformers' margins of this case are 0.105 at least: no path's rounding flips a token.
    let bytes = std::fs::read(arch("qwen2")).unwrap();
    let tokenizer = webgpu_llm::tokenizer::Tokenizer::from_gguf(&Gguf::parse(&bytes).unwrap()).unwrap();
    assert_eq!(tokenizer.encode(case.prompt).unwrap(), case.prompt_ids, "the text is the reference prompt");
    assert_eq!(case.greedy_ids.len(), 16);
    case
}

/// The tiny chat model's file.
fn chat_model(tag: &str) -> TempModel {
    TempModel::new(tag, tiny::chat())
}

#[test]
fn json_greedy_generation_prints_the_reference_ids() {
    let case = qwen2_case();
    let out = cli(&["generate", "--prompt", case.prompt, "--max-tokens", "16", "--temperature", "0"]
        .into_iter()
        .chain(["--backend", "cpu", "--json"])
        .collect::<Vec<_>>());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = json_lines(&out);
    let (tokens, last) = lines.split_at(lines.len() - 1);
    let ids: Vec<u32> = tokens.iter().map(|t| t["id"].as_u64().unwrap() as u32).collect();
    assert_eq!(ids, case.greedy_ids);
    let text: String = tokens.iter().map(|t| t["text"].as_str().unwrap()).collect();
    let bytes = std::fs::read(arch("qwen2")).unwrap();
    assert!(tiny::decode(&bytes, &case.greedy_ids).starts_with(&text), "{text:?}");
    let stats = &last[0]["stats"];
    assert_eq!((stats["prompt_tokens"].as_u64(), stats["generated_tokens"].as_u64()), (Some(5), Some(16)));
}

/// Beam search by its definition, over the CPU reference's logits (each hypothesis run again
/// from the start): with no stop ids (`--ignore-eos`) every hypothesis runs `steps` tokens, so
/// transformers' search keeps, each step, the `beams` best continuations of all beams by summed
/// log-probability, and scores each by that sum over its length (length penalty 1). Returns the
/// hypotheses (ids, score), best first, and the smallest margin by which a decision was made
/// (kept against dropped, and the final order).
fn reference_beams(bytes: &[u8], prompt: &[u32], beams: usize, steps: usize) -> (Vec<(Vec<u32>, f64)>, f64) {
    let gguf = Gguf::parse(bytes).unwrap();
    let model = CpuModel::load(&gguf, bytes).unwrap();
    let mut running: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 0.0)];
    let mut margin = f64::INFINITY;
    for _ in 0..steps {
        let mut candidates = Vec::new();
        for (ids, score) in &running {
            let tokens: Vec<u32> = prompt.iter().chain(ids).copied().collect();
            let logits = model.forward(&mut model.new_cache(), &tokens, Logits::Last).unwrap();
            let max = logits.iter().fold(f32::NEG_INFINITY, |a, &l| a.max(l)) as f64;
            let log_sum = logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln() + max;
            for (id, &l) in logits.iter().enumerate() {
                let mut next = ids.clone();
                next.push(id as u32);
                candidates.push((next, score + l as f64 - log_sum));
            }
        }
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
        margin = margin.min(candidates[beams - 1].1 - candidates[beams].1);
        candidates.truncate(beams);
        running = candidates;
    }
    for pair in running.windows(2) {
        margin = margin.min(pair[0].1 - pair[1].1);
    }
    (running.into_iter().map(|(ids, sum)| (ids, sum / steps as f64)).collect(), margin)
}

/// `--beams 2 --ignore-eos --json`: one line with both beams, best first, with their ids, text
/// and scores, as the beam search defined above finds them, on the CPU and on the GPU (its f32
/// path).
#[test]
fn beam_search_prints_the_reference_beams_as_one_json_line() {
    let model = chat_model("beams");
    let prompt = "The capital of France is";
    let prompt_ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let (want, margin) = reference_beams(tiny::chat(), &prompt_ids, 2, 24);
    // Every decision by far more than f32 rounding (0.023 here; 48 decisions at ranks 2 and 3 of
    // 4096 candidates are closer than the f16 path's rounding, so the GPU takes the f32 path).
    assert!(margin > 1e-3, "a beam decided by {margin}: take another prompt");
    for backend in ["cpu", "gpu"] {
        let out = exe()
            .args(["generate", "--prompt", prompt, "--beams", "2", "--max-tokens", "24", "--ignore-eos", "--json"])
            .args(["--backend", backend, "--model"])
            .arg(&model.0)
            .env(webgpu_llm::gpu::FORCE_F32_ENV, "1")
            .output()
            .expect("the CLI runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 1, "one line");
        let beams = lines[0]["beams"].as_array().unwrap();
        assert_eq!(beams.len(), 2);
        for (got, (ids, score)) in beams.iter().zip(&want) {
            assert_eq!(&common::ids(&got["ids"]), ids, "{backend}");
            assert_eq!(got["text"], tiny::decode(tiny::chat(), ids), "{backend}");
            assert!((got["score"].as_f64().unwrap() - score).abs() < 1e-3, "{backend}: {got} against {score}");
        }
    }
}

/// Greedy ids of `prompt` from the CLI on `model`, as JSON lines, with the stats line.
fn greedy_ids(model: &Path, prompt: &str, n: usize, backend: &str) -> (Vec<u32>, Value) {
    let out = exe()
        .args(["generate", "--prompt", prompt, "--temperature", "0", "--json", "--ignore-eos", "--backend", backend])
        .args(["--max-tokens", &n.to_string(), "--model"])
        .arg(model)
        .output()
        .expect("the CLI runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut lines = json_lines(&out);
    let stats = lines.pop().unwrap()["stats"].clone();
    (lines.iter().map(|t| t["id"].as_u64().unwrap() as u32).collect(), stats)
}

/// An A/B switch set to a value it does not know is refused by name, not read as its default.
#[test]
fn unknown_switch_values_are_refused_naming_the_variable() {
    for (var, value) in [
        ("WEBGPU_LLM_UNROLL_ROWS", "yes"),
        ("WEBGPU_LLM_KERNELS", "fast"),
        ("WEBGPU_LLM_INT8", "on"),
        ("WEBGPU_LLM_COOP", "yes"),
    ] {
        let out = exe()
            .env(var, value)
            .args(["generate", "--backend", "gpu", "--prompt", "x", "--max-tokens", "1", "--model"])
            .arg(default_model())
            .output()
            .expect("the CLI runs");
        let err = String::from_utf8_lossy(&out.stderr);
        // Bad usage (exit code 2), as a flag's bad value.
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(&format!("{var}=\"{value}\"")), "{err}");
    }
}

#[test]
fn a_split_model_runs_from_its_first_parts_name() {
    let dir = std::env::temp_dir().join(format!("webgpu-llm-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = common::split_in_two(&std::fs::read(arch("qwen2")).unwrap(), 10);
    let first = dir.join("qwen2-00001-of-00002.gguf");
    std::fs::write(&first, a).unwrap();
    std::fs::write(dir.join("qwen2-00002-of-00002.gguf"), b).unwrap();
    let case = qwen2_case();
    for backend in ["cpu", "gpu"] {
        assert_eq!(greedy_ids(&first, case.prompt, 16, backend).0, case.greedy_ids, "{backend}");
    }
    std::fs::remove_file(dir.join("qwen2-00002-of-00002.gguf")).unwrap();
    let out = cli_on(&first, &["generate", "--prompt", "x", "--max-tokens", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("qwen2-00002-of-00002.gguf"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Words of the tiny gemma3's vocabulary, `▁` for a space (with every prefix of each, so that
/// SentencePiece's merges build them); the prompt's are first.
const GEMMA_WORDS: &str =
    "The ▁capital ▁of ▁France ▁is ▁Paris ▁the ▁city ▁and ▁a ▁river ▁old ▁in ▁north ▁light ▁was ▁sea";

/// A tiny gemma3: 6 layers (five with a sliding window of 4 keys and their own RoPE, then a
/// global one), 4 query heads of 32 over 1 KV head (q is 128 wide, the model 64), q/k norms,
/// post-attention and post-FFN norms, GELU, the embedding scaled by sqrt(64) and tied to the
/// output; a SentencePiece vocabulary (byte fallback, no space prefix, BOS added, as Gemma's).
/// Returns the file and the prompt "The capital of France is" as its ids, by hand.
fn tiny_gemma3() -> (Vec<u8>, Vec<u32>) {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].map(String::from).to_vec();
    let mut types = vec![3, 3, 3, 2];
    tokens.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
    types.extend([6; 256]);
    let mut pieces: Vec<String> = vec!["\u{2581}".into()];
    pieces.extend(('a'..='z').chain('A'..='Z').chain(",.!?".chars()).map(String::from));
    // And 300 two-letter words.
    let letter = |i: u32| char::from(b'a' + (i % 26) as u8);
    let words: Vec<String> = GEMMA_WORDS
        .split(' ')
        .map(String::from)
        .chain((0..300).map(|i| format!("\u{2581}{}{}", letter(i), letter(i / 26))))
        .collect();
    for w in &words {
        let ends: Vec<usize> = w.char_indices().map(|(i, c)| i + c.len_utf8()).collect();
        for &end in &ends[1..] {
            if !pieces.contains(&w[..end].to_string()) {
                pieces.push(w[..end].to_string());
            }
        }
    }
    // Longer pieces score higher (their merges come first).
    let mut scores = vec![0f32; tokens.len()];
    scores.extend(pieces.iter().map(|p| p.chars().count() as f32));
    types.extend(vec![1; pieces.len()]);
    tokens.extend(pieces);
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;
    let prompt =
        [2, id("The"), id("\u{2581}capital"), id("\u{2581}of"), id("\u{2581}France"), id("\u{2581}is")].to_vec();
    let vocab = tokens.len() as u64;

    let (layers, d, heads, head_dim, ffn) = (6u64, 64u64, 4u64, 32u64, 128u64);
    let q = heads * head_dim;
    let mut w = GgufWriter::new(3);
    let u32v = |v: u64| GgufValue::U32(v as u32);
    w.metadata("general.architecture", GgufValue::String("gemma3".into()))
        .metadata("general.name", GgufValue::String("tiny random gemma3".into()))
        .metadata("gemma3.block_count", u32v(layers))
        .metadata("gemma3.context_length", u32v(1024))
        .metadata("gemma3.embedding_length", u32v(d))
        .metadata("gemma3.feed_forward_length", u32v(ffn))
        .metadata("gemma3.attention.head_count", u32v(heads))
        .metadata("gemma3.attention.head_count_kv", u32v(1))
        .metadata("gemma3.attention.key_length", u32v(head_dim))
        .metadata("gemma3.attention.value_length", u32v(head_dim))
        .metadata("gemma3.attention.sliding_window", u32v(4))
        .metadata("gemma3.rope.freq_base", GgufValue::F32(1e6))
        .metadata("gemma3.attention.layer_norm_rms_epsilon", GgufValue::F32(1e-6))
        .metadata("tokenizer.ggml.model", GgufValue::String("llama".into()))
        .metadata("tokenizer.ggml.tokens", GgufValue::List(Array::from(tokens.clone())))
        .metadata("tokenizer.ggml.scores", GgufValue::List(Array::F32(scores)))
        .metadata("tokenizer.ggml.token_type", GgufValue::List(Array::I32(types)))
        .metadata("tokenizer.ggml.bos_token_id", u32v(2))
        .metadata("tokenizer.ggml.eos_token_id", u32v(1))
        .metadata("tokenizer.ggml.unknown_token_id", u32v(3))
        .metadata("tokenizer.ggml.padding_token_id", u32v(0))
        .metadata("tokenizer.ggml.add_bos_token", GgufValue::Bool(true))
        .metadata("tokenizer.ggml.add_space_prefix", GgufValue::Bool(false));
    let mut rng = Xorshift(0x853c_49e6_748f_ea9b);
    let f32s = GgmlType::F32;
    w.tensor("token_embd.weight", &[d, vocab], f32s, rng.weights(d * vocab, 0.1));
    w.tensor("output_norm.weight", &[d], f32s, rng.norm(d, 1.5, 4.5));
    for i in 0..layers {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        for (name, dims, std) in [
            ("attn_q", vec![d, q], 0.08),
            ("attn_k", vec![d, head_dim], 0.08),
            ("attn_v", vec![d, head_dim], 0.08),
            ("attn_output", vec![q, d], 0.3),
            ("ffn_gate", vec![d, ffn], 0.08),
            ("ffn_up", vec![d, ffn], 0.08),
            ("ffn_down", vec![ffn, d], 0.3),
        ] {
            let n = dims.iter().product();
            w.tensor(&b(name), &dims, f32s, rng.weights(n, std));
        }
        for (name, n) in [
            ("attn_norm", d),
            ("attn_q_norm", head_dim),
            ("attn_k_norm", head_dim),
            ("post_attention_norm", d),
            ("ffn_norm", d),
            ("post_ffw_norm", d),
        ] {
            w.tensor(&b(name), &[n], f32s, rng.norm(n, 0.5, 1.5));
        }
    }
    (w.to_bytes(), prompt)
}

/// The gemma3 architecture through the CLI on the GPU: the text is encoded with SentencePiece
/// and BOS, and the greedy ids are the CPU reference's (across the sliding windows).
#[test]
fn a_gemma3_model_through_the_cli_on_the_gpu_gives_the_cpu_references_ids() {
    let (bytes, prompt) = tiny_gemma3();
    let (want, margins) = tiny::greedy(&bytes, &prompt, 16);
    let smallest = margins.iter().fold(f32::INFINITY, |a, &m| a.min(m));
    eprintln!("the CPU reference's greedy ids {want:?}, margins {smallest} and up");
    assert!(smallest > 0.05, "a greedy token decided by {smallest}: take another seed");
    let model = TempModel::new("gemma3", &bytes);
    let (ids, stats) = greedy_ids(&model.0, "The capital of France is", 16, "gpu");
    assert_eq!(stats["prompt_tokens"].as_u64(), Some(prompt.len() as u64), "BOS and 5 words");
    assert_eq!(ids, want);
}

const QUESTION: &str = "What is the capital of France?";

/// Text on stdout as it streams, EOS ending it; the stats line last on stderr.
#[test]
fn plain_output_streams_text_and_reports_stats_on_stderr() {
    let prompt = tiny::chat_prompt(&[("user", QUESTION)]);
    let (bytes, _) = tiny::chat_ending_at(&prompt, 7);
    let (want, _) = tiny::greedy(&bytes, &prompt, 7);
    let model = TempModel::new("plain", &bytes);
    let out =
        cli_on(&model.0, &["generate", "--prompt", QUESTION, "--chat", "--max-tokens", "32", "--temperature", "0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{}\n", tiny::decode(&bytes, &want)));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("on gpu: "), "the default backend: {err}");
    let last = err.lines().last().unwrap();
    let prompt_tokens = format!("prompt tokens: {}", prompt.len());
    for field in [prompt_tokens.as_str(), "generated tokens: 7", "TTFT", "prefill", "decode", "tok/s", "stop: Eos"] {
        assert!(last.contains(field), "stats line {last:?} lacks {field}");
    }
}

#[test]
fn bad_arguments_get_a_usage_message_not_a_panic() {
    for args in [vec!["generate"], vec!["generate", "--prompt", "x", "--max-tokens", "lots"], vec!["frobnicate"]] {
        let out = cli(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("Usage"), "{args:?}: {err}");
        assert!(!err.contains("panicked"));
    }
}

/// Bad flag values end with exit code 2 and a one-line message naming the flag, before the model
/// is loaded (no "loading" line), in well under a second.
#[test]
fn bad_flag_values_are_refused_before_loading_with_exit_code_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["generate", "--prompt", "x", "--top-p", "1.5"], "top_p"),
        // A negative number is a value, then refused as invalid.
        (&["generate", "--prompt", "x", "--temperature", "-1"], "temperature = -1"),
        (&["generate", "--prompt", "x", "--repetition-penalty", "1e-38"], "repetition_penalty"),
        (&["generate", "--prompt", "x", "--stop", ""], "stop"),
        (&["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
        (&["generate", "--prompt", "x", "--context-length", "0"], "--context-length"),
        (
            &["generate", "--prompt", "x", "--context-length", "64", "--max-tokens", "18446744073709551615"],
            "18446744073709551615",
        ),
        (&["generate", "--prompt", "x", "--beams", "0"], "--beams"),
        (&["generate", "--prompt", "x", "--beams", "33"], "beams = 33"),
        (&["generate", "--prompt", "x", "--beams", "2", "--length-penalty", "NaN"], "length penalty"),
        (&["generate", "--prompt", "x", "--length-penalty", "2"], "--beams"),
        // Beam search takes neither stop strings nor speculation: refused, not dropped.
        (&["generate", "--prompt", "x", "--beams", "2", "--stop", "a"], "stop"),
        (&["generate", "--prompt", "x", "--beams", "2", "--speculate", "lookup"], "beams"),
        (&["bench", "--prompt-tokens", "0"], "--prompt-tokens"),
        (
            &["bench", "--context-length", "64", "--prompt-tokens", "18446744073709551610"],
            "--prompt-tokens + --gen-tokens",
        ),
    ];
    for (args, named) in cases {
        let start = std::time::Instant::now();
        let out = cli(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(named), "{args:?} should name {named}: {err}");
        assert!(!err.contains("loading") && !err.contains("panicked"), "{args:?}: {err}");
        assert!(start.elapsed().as_secs_f64() < 5.0, "{args:?} took {:?}", start.elapsed());
    }
}

#[test]
fn an_unknown_synthetic_shape_is_refused_with_the_shapes_there_are() {
    let out_file = std::env::temp_dir().join(format!("webgpu-llm-never-written-{}.gguf", std::process::id()));
    let cases: &[&[&str]] =
        &[&["bench", "--synthetic", "3b"], &["synthetic", "70b", "--out", out_file.to_str().expect("a UTF-8 path")]];
    for args in cases {
        let out = exe().args(*args).output().expect("the CLI runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("1b (Llama 3.2 1B's shape) or 8b (Llama 3 8B's)"), "{args:?}: {err}");
        assert!(!err.contains("making") && !err.contains("panicked"), "{args:?}: {err}");
    }
    assert!(!out_file.exists(), "nothing is written for an unknown shape");
}

/// Checks that need the model's own context: still exit code 2, the error on a line of its own
/// (not glued to the progress line), and no panic for numbers near u64::MAX.
#[test]
fn numbers_past_the_models_context_are_refused_after_loading_on_a_line_of_their_own() {
    for args in [
        &["generate", "--prompt", "x", "--backend", "cpu", "--max-tokens", "18446744073709551615"][..],
        &["bench", "--backend", "cpu", "--prompt-tokens", "18446744073709551610"][..],
    ] {
        let out = cli(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        // (bench's sum overflows: refused before loading.)
        assert_eq!(err.contains("loaded"), args[0] == "generate", "{args:?}: {err}");
        assert!(err.lines().any(|l| l.starts_with("error: ") && l.contains("context")), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_missing_model_file_is_named() {
    let out = exe().args(["generate", "--prompt", "x", "--model", "/nonexistent/model.gguf"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn a_file_that_is_not_gguf_is_an_error_not_a_panic() {
    let path = std::env::temp_dir().join(format!("not-a-model-{}.gguf", std::process::id()));
    std::fs::write(&path, b"<html>404 not found</html>").unwrap();
    let out = exe().args(["generate", "--prompt", "x", "--model"]).arg(&path).output().unwrap();
    std::fs::remove_file(&path).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("not a GGUF file"), "{err}");
}

#[test]
fn the_gpu_is_the_default_backend_and_prints_the_reference_ids() {
    let case = qwen2_case();
    let out = cli(&["generate", "--prompt", case.prompt, "--max-tokens", "16", "--temperature", "0", "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("on gpu: "), "the adapter is named on stderr: {err}");
    let ids: Vec<u32> = json_lines(&out).iter().filter_map(|l| l["id"].as_u64()).map(|id| id as u32).collect();
    assert_eq!(ids, case.greedy_ids);
}

/// 20 prompt tokens, then 40 decode steps (past two 16-token KV blocks): each step one
/// submission, nothing created, the 4 bytes of a token id read back.
#[test]
fn bench_reports_one_submission_no_allocation_and_four_bytes_per_decode_step() {
    let model = chat_model("bench");
    let out = cli_on(&model.0, &["bench", "--prompt-tokens", "20", "--gen-tokens", "40"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for field in ["prefill:", "TTFT", "decode:", "TPOT", "backend:"] {
        assert!(text.contains(field), "bench output lacks {field}: {text}");
    }
    let step = text.lines().find(|l| l.starts_with("per decode step:")).expect("a per-step line");
    for want in [
        "1.00 submissions",
        "0.00 buffers created",
        "0.00 bind groups created",
        "0.00 pipelines created",
        " 4 bytes read back",
    ] {
        assert!(step.contains(want), "{step:?} lacks {want:?}");
    }
}

/// An error found while the weights load (here: a tensor no layer plan uses) ends the progress
/// line first: `error:` starts a line of its own.
#[test]
fn an_error_during_loading_is_printed_on_a_line_of_its_own() {
    let bytes = std::fs::read(default_model()).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let mut w = GgufWriter::new(3);
    for (k, v) in &g.metadata {
        w.metadata(k, v.clone());
    }
    for t in &g.tensors {
        w.tensor(&t.name, &t.shape, t.ty, t.data(&bytes).to_vec());
    }
    w.tensor("blk.0.attn_gate.weight", &[8], GgmlType::F32, vec![0; 32]);
    let model = TempModel::new("extra-tensor", &w.to_bytes());
    let out = cli_on(&model.0, &["generate", "--prompt", "x", "--backend", "cpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("loading weights"), "{err}");
    assert!(err.lines().any(|l| l.starts_with("error: ") && l.contains("blk.0.attn_gate.weight")), "{err}");
}

/// Ctrl-C while generating stops it like an abort: the text so far and the stats line are
/// printed, exit code 130 (128 + SIGINT).
#[cfg(unix)]
#[test]
fn sigint_prints_what_was_generated_and_the_stats() {
    use std::io::Read;
    let model = chat_model("sigint");
    // 4000 JSON lines are more than the pipe holds (64 KiB): the tiny model cannot finish before
    // the signal, the CLI waits on the full pipe until this test reads again.
    let mut child = exe()
        .args(["generate", "--prompt", "Once upon a time", "--backend", "cpu", "--max-tokens", "4000", "--ignore-eos"])
        .args(["--temperature", "0", "--json", "--context-length", "4096", "--model"])
        .arg(&model.0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a few tokens, then interrupt.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while seen.iter().filter(|&&b| b == b'\n').count() < 3 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "the CLI ended before generating");
        seen.extend_from_slice(&buf[..n]);
    }
    let killed = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    // The handler's thread sets the flag while the CLI still waits to write.
    std::thread::sleep(std::time::Duration::from_millis(300));
    stdout.read_to_end(&mut seen).unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    let text = String::from_utf8_lossy(&seen);
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let tokens = text.lines().count() - 1;
    eprintln!("{tokens} tokens before the interrupt took effect");
    assert_eq!(last["stats"]["stop_reason"], "Aborted", "{text}");
    assert_eq!(last["stats"]["generated_tokens"].as_u64(), Some(tokens as u64));
    assert!((3..4000).contains(&tokens), "{tokens} tokens");
    assert!(err.contains("stop: Aborted"), "{err}");
}

/// A flag error's last line on stderr is the error itself (what a script reading the last line
/// gets), after the usage of the command it was for, not the top-level one.
#[test]
fn a_flag_errors_last_line_is_the_error_after_its_commands_usage() {
    for (args, named, command) in [
        (&["generate", "--prompt", "x", "--context-length", "0"][..], "--context-length", "generate"),
        (&["bench", "--batch", "lots"][..], "--batch", "bench"),
        (&["serve", "--port", "http"][..], "--port", "serve"),
    ] {
        let out = cli(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with("error:") && last.contains(named), "{args:?}: last line {last:?} of {err}");
        assert!(err.contains(&format!("Usage: webgpu-llm {command}")), "{args:?}: {err}");
        assert!(!err.contains("Usage: webgpu-llm <COMMAND>"), "{args:?}: the top-level usage: {err}");
    }
}

/// `--prompt-file FILE` (and `-`, standard input) takes a prompt longer than a command line
/// holds (here 200 KiB, past Linux's 128 KiB argument limit): the context-overflow error names
/// its token count, which only reading all of it gives; a short file gives the same text as
/// `--prompt`; a missing file fails before the model loads.
#[test]
fn prompt_files_and_standard_input_carry_prompts_past_the_command_line() {
    let model = arch("llama3");
    let dir = std::env::temp_dir().join(format!("webgpu-llm-prompt-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "Once upon a time").unwrap();
    let flags = ["--max-tokens", "6", "--temperature", "0", "--backend", "cpu"];
    let by_flag = cli_on(&model, &[&["generate", "--prompt", "Once upon a time"][..], &flags].concat());
    let by_file = cli_on(&model, &[&["generate", "--prompt-file", short.to_str().unwrap()][..], &flags].concat());
    assert!(by_flag.status.success(), "{}", String::from_utf8_lossy(&by_flag.stderr));
    assert_eq!(by_file.stdout, by_flag.stdout, "{}", String::from_utf8_lossy(&by_file.stderr));
    // Standard input.
    let mut child = exe()
        .args(["generate", "--prompt-file", "-", "--model"])
        .arg(&model)
        .args(flags)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"Once upon a time").unwrap();
    let by_stdin = child.wait_with_output().unwrap();
    assert_eq!(by_stdin.stdout, by_flag.stdout, "{}", String::from_utf8_lossy(&by_stdin.stderr));
    // 200 KiB of words: read whole (the overflow counts its tokens), never an argv error.
    let long = dir.join("long.txt");
    std::fs::write(&long, "word ".repeat(40 << 10)).unwrap();
    let out = cli_on(&model, &["generate", "--prompt-file", long.to_str().unwrap(), "--backend", "cpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("context") && err.contains("prompt"), "{err}");
    let missing = cli_on(&model, &["generate", "--prompt-file", dir.join("none.txt").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success() && err.contains("none.txt") && !err.contains("loading"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model path that is a FIFO is refused at once ("not a regular file"), not waited on.
#[cfg(unix)]
#[test]
fn a_fifo_as_the_model_is_refused_at_once() {
    let fifo = std::env::temp_dir().join(format!("webgpu-llm-fifo-{}", std::process::id()));
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path and a mode.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let start = std::time::Instant::now();
    let out = cli_on(&fifo, &["generate", "--prompt", "x"]);
    let _ = std::fs::remove_file(&fifo);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not a regular file"), "{err}");
    assert!(start.elapsed().as_secs() < 10, "took {:?}", start.elapsed());
}
