//! The native CLI as a user runs it: golden ids with --json, stats on stderr, usage errors.

use crate::common;

use std::process::{Command, Output};

fn cli(args: &[&str]) -> Output {
    cli_on(&common::model_path(), args)
}

fn cli_on(model: &std::path::Path, args: &[&str]) -> Output {
    // Bench and generate take --model; unknown subcommands fail before it matters.
    Command::new(env!("CARGO_BIN_EXE_webgpu-llm")).args(args).arg("--model").arg(model).output().expect("the CLI runs")
}

/// stdout of a `--json` run: one object per line.
fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

#[test]
fn json_greedy_generation_prints_the_golden_ids() {
    let case = common::golden("generations.json")["cases"][0].clone();
    assert_eq!(case["name"], "raw_capital_france");
    let out = cli(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--backend",
        "cpu",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = json_lines(&out);
    let (tokens, last) = lines.split_at(lines.len() - 1);
    let ids: Vec<u32> = tokens.iter().map(|t| t["id"].as_u64().unwrap() as u32).collect();
    assert_eq!(ids, common::ids(&case["generated_ids"])[..16]);
    let text: String = tokens.iter().map(|t| t["text"].as_str().unwrap()).collect();
    assert!(case["greedy_text"].as_str().unwrap().starts_with(&text));
    let stats = &last[0]["stats"];
    assert_eq!((stats["prompt_tokens"].as_u64(), stats["generated_tokens"].as_u64()), (Some(5), Some(16)));
}

/// `--beams 2 --ignore-eos --json`: one line with both beams, best first, as transformers' beam
/// search (../shared/golden/beam.json, raw_capital_france, `fixed` with 2 beams).
#[test]
fn beam_search_prints_the_golden_beams_as_one_json_line() {
    let golden = common::golden("beam.json");
    let case = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "raw_capital_france" && c["num_beams"] == 2)
        .unwrap();
    let out = cli(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--beams",
        "2",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--json",
        "--backend",
        "cpu",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1, "one line");
    let beams = lines[0]["beams"].as_array().unwrap();
    let want = case["beams"].as_array().unwrap();
    assert_eq!(beams.len(), 2);
    for (got, want) in beams.iter().zip(want) {
        assert_eq!(common::ids(&got["ids"]), common::ids(&want["ids"]));
        assert_eq!(got["text"], want["text"]);
        assert!((got["score"].as_f64().unwrap() - want["score"].as_f64().unwrap()).abs() < 1e-3);
    }
}

/// Greedy ids of `prompt` from the CLI on `model` (CPU backend), as JSON lines.
fn greedy_ids(model: &std::path::Path, prompt: &str, n: usize, backend: &str) -> Vec<u32> {
    let out = Command::new(env!("CARGO_BIN_EXE_webgpu-llm"))
        .args(["generate", "--prompt", prompt, "--temperature", "0", "--json", "--ignore-eos", "--backend", backend])
        .args(["--max-tokens", &n.to_string(), "--model"])
        .arg(model)
        .output()
        .expect("the CLI runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = json_lines(&out);
    lines[..lines.len() - 1].iter().map(|t| t["id"].as_u64().unwrap() as u32).collect()
}

#[test]
fn a_split_model_runs_from_its_first_parts_name() {
    let dir = std::env::temp_dir().join(format!("webgpu-llm-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = common::split_in_two(common::model_bytes(), 100);
    let first = dir.join("smollm2-00001-of-00002.gguf");
    std::fs::write(&first, a).unwrap();
    std::fs::write(dir.join("smollm2-00002-of-00002.gguf"), b).unwrap();
    let case = common::golden("generations.json")["cases"][0].clone();
    let ids = greedy_ids(&first, "The capital of France is", 8, "cpu");
    assert_eq!(ids, common::ids(&case["generated_ids"])[..8]);
    std::fs::remove_file(dir.join("smollm2-00002-of-00002.gguf")).unwrap();
    let out = cli_on(&first, &["generate", "--prompt", "x", "--max-tokens", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("smollm2-00002-of-00002.gguf"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gemma3_greedy_generation_through_the_cli_gives_the_golden_ids() {
    let case = common::Reference::Gemma3.golden("generations.json")["cases"][0].clone();
    let ids = greedy_ids(&common::Reference::Gemma3.model_path(), "The capital of France is", 8, "gpu");
    assert_eq!(ids, common::ids(&case["generated_ids"])[..8]);
}

#[test]
fn plain_output_streams_text_and_reports_stats_on_stderr() {
    let out = cli(&[
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "32",
        "--temperature",
        "0",
    ]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "The capital of France is Paris.\n");
    let err = String::from_utf8(out.stderr).unwrap();
    let last = err.lines().last().unwrap();
    for field in ["prompt tokens: 37", "generated tokens: 7", "TTFT", "prefill", "decode", "tok/s"] {
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
        let out = Command::new(env!("CARGO_BIN_EXE_webgpu-llm")).args(*args).output().expect("the CLI runs");
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
        assert!(err.lines().any(|l| l.starts_with("error: ") && l.contains("context")), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_missing_model_file_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_webgpu-llm"))
        .args(["generate", "--prompt", "x", "--model", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn a_file_that_is_not_gguf_is_an_error_not_a_panic() {
    let path = std::env::temp_dir().join(format!("not-a-model-{}.gguf", std::process::id()));
    std::fs::write(&path, b"<html>404 not found</html>").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_webgpu-llm"))
        .args(["generate", "--prompt", "x", "--model"])
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("not a GGUF file"), "{err}");
}

#[test]
fn the_gpu_is_the_default_backend_and_prints_the_golden_ids() {
    let case = common::golden("generations.json")["cases"][0].clone();
    let out = cli(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("on gpu: "), "the adapter is named on stderr: {err}");
    let ids: Vec<u32> = json_lines(&out).iter().filter_map(|l| l["id"].as_u64()).map(|id| id as u32).collect();
    assert_eq!(ids, common::ids(&case["generated_ids"])[..16]);
}

#[test]
fn bench_reports_one_submission_no_allocation_and_four_bytes_per_decode_step() {
    let out = cli(&["bench", "--prompt-tokens", "20", "--gen-tokens", "6"]);
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
    use webgpu_llm::gguf::{GgmlType, Gguf, GgufWriter};
    let bytes = common::model_bytes();
    let g = Gguf::parse(bytes).unwrap();
    let mut w = GgufWriter::new(3);
    for (k, v) in &g.metadata {
        w.metadata(k, v.clone());
    }
    for t in &g.tensors {
        w.tensor(&t.name, &t.shape, t.ty, t.data(bytes).to_vec());
    }
    w.tensor("blk.0.attn_gate.weight", &[8], GgmlType::F32, vec![0; 32]);
    let path = std::env::temp_dir().join(format!("extra-tensor-{}.gguf", std::process::id()));
    std::fs::write(&path, w.to_bytes()).unwrap();
    let out = cli_on(&path, &["generate", "--prompt", "x", "--backend", "cpu"]);
    std::fs::remove_file(&path).unwrap();
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
    let mut child = Command::new(env!("CARGO_BIN_EXE_webgpu-llm"))
        .args(["generate", "--prompt", "Once upon a time", "--backend", "cpu", "--max-tokens", "2000", "--ignore-eos"])
        .args(["--temperature", "0", "--json", "--context-length", "4096", "--model"])
        .arg(common::model_path())
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
    stdout.read_to_end(&mut seen).unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    let text = String::from_utf8_lossy(&seen);
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let tokens = text.lines().count() - 1;
    assert_eq!(last["stats"]["stop_reason"], "Aborted", "{text}");
    assert_eq!(last["stats"]["generated_tokens"].as_u64(), Some(tokens as u64));
    assert!((3..2000).contains(&tokens), "{tokens} tokens");
    assert!(err.contains("stop: Aborted"), "{err}");
}
