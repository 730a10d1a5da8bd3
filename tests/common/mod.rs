//! Shared by the integration tests: where the golden data and the default model are, loaded once.
#![allow(dead_code)]

use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;
use webgpu_llm::gguf::{Gguf, GgufWriter, Value as GgufValue};

pub mod tiny;
use webgpu_llm::model::CpuModel;

/// The calling thread's CPU time so far. The tests' time limits (a hostile file, template or
/// mutated header must be dealt with quickly) count it rather than wall time: scripts/test runs
/// its stages side by side, and a busy machine must not fail a check of work that was not slow.
pub fn thread_cpu_time() -> std::time::Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

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

/// A reference model: its GGUF (fetched by scripts/fetch-model) and its golden folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference {
    /// SmolLM2-135M-Instruct Q4_1, llama architecture: the default model.
    SmolLm2,
    /// Gemma 3 270M Q4_K_M: K-quants, gemma3 architecture, SentencePiece.
    Gemma3,
}

impl Reference {
    pub fn model_path(self) -> PathBuf {
        let name = match self {
            Self::SmolLm2 => "SmolLM2-135M-Instruct.Q4_1.gguf",
            Self::Gemma3 => "gemma-3-270m-q4_k_m.gguf",
        };
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models").join(name)
    }

    pub fn golden(self, name: &str) -> Value {
        match self {
            Self::SmolLm2 => golden(name),
            Self::Gemma3 => golden(&format!("gemma3-270m/{name}")),
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    pub fn bytes(self) -> &'static [u8] {
        static BYTES: [OnceLock<Vec<u8>>; 2] = [OnceLock::new(), OnceLock::new()];
        BYTES[self.index()].get_or_init(|| {
            std::fs::read(self.model_path())
                .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-model all first", self.model_path().display()))
        })
    }

    pub fn gguf(self) -> &'static Gguf {
        static GGUF: [OnceLock<Gguf>; 2] = [OnceLock::new(), OnceLock::new()];
        GGUF[self.index()].get_or_init(|| Gguf::parse(self.bytes()).expect("the reference model parses"))
    }

    pub fn cpu_model(self) -> &'static CpuModel {
        static MODEL: [OnceLock<CpuModel>; 2] = [OnceLock::new(), OnceLock::new()];
        MODEL[self.index()]
            .get_or_init(|| CpuModel::load(self.gguf(), self.bytes()).expect("the reference model loads"))
    }
}

pub fn model_path() -> PathBuf {
    Reference::SmolLm2.model_path()
}

/// The default model's bytes; the tests need it (scripts/fetch-model puts it there).
pub fn model_bytes() -> &'static [u8] {
    Reference::SmolLm2.bytes()
}

pub fn model_gguf() -> &'static Gguf {
    Reference::SmolLm2.gguf()
}

pub fn cpu_model() -> &'static CpuModel {
    Reference::SmolLm2.cpu_model()
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

/// `bytes` (a GGUF file) split as llama.cpp's gguf-split does: part 1 holds the metadata and
/// the first `first` tensors, part 2 the rest; both carry split.no / split.count.
pub fn split_in_two(bytes: &[u8], first: usize) -> (Vec<u8>, Vec<u8>) {
    let g = Gguf::parse(bytes).unwrap();
    let mut parts = [GgufWriter::new(3), GgufWriter::new(3)];
    let mut keys: Vec<_> = g.metadata.iter().collect();
    keys.sort_by_key(|(k, _)| k.as_str());
    for (k, v) in keys {
        parts[0].metadata(k, v.clone());
    }
    parts[0].metadata("split.tensors.count", GgufValue::I32(g.tensors.len() as i32));
    for (i, p) in parts.iter_mut().enumerate() {
        p.metadata("split.no", GgufValue::U16(i as u16)).metadata("split.count", GgufValue::U16(2));
    }
    for (i, t) in g.tensors.iter().enumerate() {
        parts[(i >= first) as usize].tensor(&t.name, &t.shape, t.ty, t.data(bytes).to_vec());
    }
    (parts[0].to_bytes(), parts[1].to_bytes())
}

/// Every golden generation on the CPU reference: greedy tokens identical to the golden ones up
/// to any step where the golden top-1/top-2 margin is within twice `tol` (a flip there is no
/// discrepancy, and the comparison of that generation ends), and the top-20 logits at each
/// recorded step within `tol`. Up to the last recorded step (8) each token is one decode step
/// of the KV-cached loop; the rest (to 64) run in one pass through the same cache over the
/// golden tokens, whose logits at each position are what greedy decoding sees at that step as
/// long as every token before matched (where one did not, the comparison has ended): the same
/// checks as a decode step per token, at a fraction of the passes over the weights (the CPU
/// reads every weight once per pass). Returns the largest logit difference and how many tokens
/// were identical.
pub fn check_cpu_generations(reference: Reference, tol: f64) -> (f64, usize) {
    use webgpu_llm::model::Logits;
    let model = reference.cpu_model();
    let vocab = model.config.vocab_size;
    let golden = reference.golden("generations.json");
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    let (mut max_diff, mut same) = (0f64, 0);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["prompt_ids"]);
        let expected = ids(&case["generated_ids"]);
        let margins = floats(&case["top1_top2_margins"]);
        let top: Vec<&Value> = case["top_logits"].as_array().unwrap().iter().collect();
        let last_recorded = top.iter().map(|t| t["step"].as_u64().unwrap() as usize).max().unwrap();
        // `logits` of `step` (after the prompt and expected[..step]): true while they agree.
        let check = |step: usize, logits: &[f32], max_diff: &mut f64| -> bool {
            if let Some(t) = top.iter().find(|t| t["step"].as_u64() == Some(step as u64)) {
                assert_eq!(t["position"].as_u64().unwrap() as usize, prompt.len() + step - 1);
                for (id, want) in ids(&t["ids"]).iter().zip(floats(&t["logits"])) {
                    let diff = (logits[*id as usize] as f64 - want).abs();
                    *max_diff = max_diff.max(diff);
                    assert!(diff < tol, "{name} step {step}: logit of {id} is {}, golden {want}", logits[*id as usize]);
                }
            }
            let (next, want) = (webgpu_llm::sampling::argmax(logits), expected[step]);
            if next != want {
                let margin = margins[step];
                assert!(margin < 2.0 * tol, "{name}: greedy token {step} is {next}, golden {want} (margin {margin})");
            }
            next == want
        };
        let mut cache = model.new_cache();
        let mut logits = model.forward(&mut cache, &prompt, Logits::Last).unwrap();
        let mut agreed = true;
        for (step, &token) in expected.iter().enumerate().take(last_recorded + 1) {
            assert_eq!(cache.len(), prompt.len() + step);
            agreed = check(step, &logits, &mut max_diff);
            if !agreed {
                break;
            }
            same += 1;
            if step < last_recorded {
                logits = model.forward(&mut cache, &[token], Logits::Last).unwrap();
            }
        }
        let rest = last_recorded + 1..expected.len();
        if agreed && !rest.is_empty() {
            // Row j: the logits of step last_recorded + 1 + j.
            let all = model.forward(&mut cache, &expected[last_recorded..expected.len() - 1], Logits::All).unwrap();
            for (step, row) in rest.zip(all.chunks_exact(vocab)) {
                if !check(step, row, &mut max_diff) {
                    break;
                }
                same += 1;
            }
        }
    }
    (max_diff, same)
}

/// Teacher-forced perplexity of the golden passage on the CPU reference, through the KV cache in
/// chunks; returns it with the golden one and the largest per-token NLL difference.
pub fn cpu_passage_perplexity(reference: Reference, chunk: usize) -> (f64, f64, f64) {
    use webgpu_llm::model::Logits;
    let model = reference.cpu_model();
    let golden = reference.golden("perplexity.json");
    let ids = ids(&golden["ids"]);
    let golden_nll = floats(&golden["nll"]);
    let mut cache = model.new_cache();
    let vocab = model.config.vocab_size;
    let mut nlls = Vec::with_capacity(ids.len() - 1);
    for (c, tokens) in ids.chunks(chunk).enumerate() {
        let logits = model.forward(&mut cache, tokens, Logits::All).unwrap();
        for (t, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(&target) = ids.get(c * chunk + t + 1) else { break };
            nlls.push(nll(row, target));
        }
    }
    assert_eq!(nlls.len(), golden_nll.len());
    let worst = nlls.iter().zip(&golden_nll).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let ppl = (nlls.iter().sum::<f64>() / nlls.len() as f64).exp();
    (ppl, golden["perplexity"].as_f64().unwrap(), worst)
}

/// For a test that measures its whole process (resident memory): true in a child process that
/// runs only the test `name` (the caller then runs its body); elsewhere it runs that child, fails
/// when the child fails, and returns false. Other tests of a binary run on other threads of the
/// same process and would move the figure.
pub fn alone_in_process(name: &str) -> bool {
    const ALONE: &str = "WEBGPU_LLM_TEST_ALONE";
    if std::env::var_os(ALONE).is_some() {
        return true;
    }
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(ALONE, "1")
        .status()
        .unwrap();
    assert!(status.success(), "{name}, run alone in a process: {status}");
    false
}
