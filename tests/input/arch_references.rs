//! The other architectures' layer plans — qwen2 (q/k/v biases), qwen3 (q/k norms, head_dim
//! apart from d_model), phi3 (fused qkv and gate|up, partial rotary), llama 3 RoPE scaling
//! (rope_freqs.weight), mistral, smollm3 (NoPE layers) and gemma2 (soft-capping of scores and
//! logits, alternating sliding layers), the mixtures of experts (qwen3moe, qwen35moe, gpt-oss, its
//! MXFP4 experts, lfm2moe), the hybrids (lfm2, qwen35) and Gemma 4 (gemma4, and gemma4e with the
//! real E2B/E4B head sizes, 256 and 512) — on the CPU reference and on the GPU, against transformers.
//! The models are small random-weight ones converted by llama.cpp's own converter; the data and
//! the script that made it are in tests/data/arch/ (see its README).

use std::path::PathBuf;
use webgpu_llm::gguf::Gguf;
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, KernelStyle, Readback};
use webgpu_llm::model::{CpuModel, Logits};
use webgpu_llm::sampling::argmax;

const MODELS: [&str; 17] = [
    "qwen2",
    "qwen3",
    "phi3",
    "llama3",
    "mistral",
    "smollm3",
    "gemma2",
    "qwen3moe",
    "lfm2",
    "qwen3yarn",
    "gptoss",
    "qwen35",
    "qwen35moe",
    "gemma4",
    "lfm2moe",
    "gptossmxfp4",
    "gemma4e",
];

struct Reference {
    name: &'static str,
    bytes: Vec<u8>,
    json: serde_json::Value,
}

impl Reference {
    fn load(name: &'static str) -> Self {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/arch").join(name);
        let bytes = std::fs::read(dir.join("model.gguf")).expect("committed model");
        let json = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        Self { name, bytes, json }
    }
    fn gguf(&self) -> Gguf {
        Gguf::parse(&self.bytes).expect("the reference model parses")
    }
    fn cases(&self) -> &Vec<serde_json::Value> {
        self.json["cases"].as_array().unwrap()
    }
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn max_diff(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max)
}

/// A model that runs one token position after another and returns its logits: the CPU
/// reference or the GPU model.
trait Runner {
    fn vocab(&self) -> usize;
    /// Runs `tokens` at `start..` and returns the last position's logits.
    fn run(&mut self, tokens: &[u32], start: usize) -> Vec<f32>;
}

struct Cpu(CpuModel, webgpu_llm::model::CpuKvCache);

impl Runner for Cpu {
    fn vocab(&self) -> usize {
        self.0.config.vocab_size
    }
    fn run(&mut self, tokens: &[u32], start: usize) -> Vec<f32> {
        if start == 0 {
            self.1 = self.0.new_cache();
        }
        self.0.forward(&mut self.1, tokens, Logits::Last).unwrap()
    }
}

impl Runner for GpuModel {
    fn vocab(&self) -> usize {
        self.config.vocab_size
    }
    fn run(&mut self, tokens: &[u32], start: usize) -> Vec<f32> {
        let mut logits = vec![0f32; self.config.vocab_size];
        pollster::block_on(self.step(tokens, start, Readback::Logits(&mut logits))).unwrap();
        logits
    }
}

/// Every case: the whole logit vector at the last prompt position, then 16 greedy tokens with
/// their top-20 logits, all within `tol`; a token may differ only where the reference's top-1 /
/// top-2 margin is within 2 tol (then the comparison of that case ends).
fn check(r: &Reference, model: &mut dyn Runner, tol: f64, what: &str) -> f64 {
    let mut worst = 0f64;
    for (ci, case) in r.cases().iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let greedy = ids(&case["greedy_ids"]);
        let margins = floats(&case["top1_top2_margins"]);
        let mut logits = model.run(&prompt, 0);
        assert_eq!(logits.len(), model.vocab());
        let d = max_diff(&logits, &floats(&case["logits_step0"]));
        assert!(d < tol, "{} {what} case {ci}: step-0 logits differ by {d}", r.name);
        worst = worst.max(d);
        for (step, &want) in greedy.iter().enumerate() {
            let top = &case["top20"][step];
            assert_eq!(top["step"].as_u64(), Some(step as u64));
            for (&id, w) in ids(&top["ids"]).iter().zip(floats(&top["logits"])) {
                let d = (logits[id as usize] as f64 - w).abs();
                worst = worst.max(d);
                assert!(
                    d < tol,
                    "{} {what} case {ci} step {step}: logit of {id} is {}, reference {w}",
                    r.name,
                    logits[id as usize]
                );
            }
            let next = argmax(&logits);
            if next != want {
                assert!(
                    margins[step] < 2.0 * tol,
                    "{} {what} case {ci}: greedy token {step} is {next}, reference {want}",
                    r.name
                );
                break;
            }
            logits = model.run(&[next], prompt.len() + step);
        }
    }
    worst
}

#[test]
fn cpu_reference_matches_transformers_on_every_architecture() {
    for name in MODELS {
        let r = Reference::load(name);
        let model = CpuModel::load(&r.gguf(), &r.bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let cache = model.new_cache();
        let mut cpu = Cpu(model, cache);
        let worst = check(&r, &mut cpu, 1e-3, "cpu");
        // Every position of the long prompt from one pass.
        let case = r.cases().last().unwrap();
        let prompt = ids(&case["prompt_ids"]);
        let mut cache = cpu.0.new_cache();
        let all = cpu.0.forward(&mut cache, &prompt, Logits::All).unwrap();
        let want: Vec<f64> = case["all_positions_logits"].as_array().unwrap().iter().flat_map(floats).collect();
        let d = max_diff(&all, &want);
        assert!(d < 1e-3, "{name}: all-position logits differ by {d}");
        eprintln!("{name}: cpu max |logit diff| {:.2e}", worst.max(d));
    }
}

/// Qwen3.5's (and Qwen3.5-MoE's: its head's FFN a mixture) multi-token-prediction head on the CPU against an independent float64 numpy
/// forward pass from the GGUF's tensors (transformers does not run it; see tests/data/arch's
/// README): row j reads the main model's final hidden state at j and the token at j + 1; every
/// row's top-20 logits in each case, every row's whole logits in the last, the head's rows run
/// in two passes (its own cache carried between them).
#[test]
fn the_mtp_head_matches_the_numpy_reference() {
    for name in ["qwen35", "qwen35moe"] {
        mtp_head_matches_the_numpy_reference(name);
    }
}

fn mtp_head_matches_the_numpy_reference(name: &'static str) {
    let r = Reference::load(name);
    let model = CpuModel::load(&r.gguf(), &r.bytes).unwrap();
    let (d, vocab) = (model.config.d_model, model.config.vocab_size);
    assert!(model.has_mtp());
    let mut worst = 0f64;
    for (ci, case) in r.json["mtp"]["cases"].as_array().unwrap().iter().enumerate() {
        let seq = ids(&case["sequence_ids"]);
        let n = seq.len();
        let mut cache = model.new_cache();
        model.forward(&mut cache, &seq, Logits::Last).unwrap();
        let hidden = cache.hidden()[..(n - 1) * d].to_vec();
        let split = 7.min(n - 1);
        let (mut logits, _) = model.mtp_forward(&mut cache, &hidden[..split * d], &seq[1..=split]).unwrap();
        logits.extend(model.mtp_forward(&mut cache, &hidden[split * d..], &seq[split + 1..]).unwrap().0);
        assert_eq!(logits.len(), (n - 1) * vocab);
        for row in case["top20"].as_array().unwrap() {
            let j = row["position"].as_u64().unwrap() as usize;
            assert_eq!(row["input_token"].as_u64(), Some(seq[j + 1] as u64));
            for (&id, w) in ids(&row["ids"]).iter().zip(floats(&row["logits"])) {
                let d = (logits[j * vocab + id as usize] as f64 - w).abs();
                worst = worst.max(d);
                assert!(d < 1e-3, "case {ci} row {j}: MTP logit of {id} is off by {d}");
            }
        }
        let want: Vec<u32> = ids(&case["argmax_ids"]);
        let got: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(got, want, "case {ci}: the MTP head's argmax of every row");
        if let Some(all) = case.get("all_positions_logits") {
            let want: Vec<f64> = all.as_array().unwrap().iter().flat_map(floats).collect();
            let d = max_diff(&logits[..want.len()], &want);
            worst = worst.max(d);
            assert!(d < 1e-3, "case {ci}: the MTP head's logits differ by {d}");
        }
    }
    eprintln!("{name} MTP head on the cpu: max |logit diff| to numpy {worst:.2e}");
}

fn gpu(force_f32: bool, style: Option<KernelStyle>, r: &Reference) -> GpuModel {
    let mut gpu = pollster::block_on(Gpu::new(GpuOptions { force_f32, ..Default::default() }))
        .expect("a GPU adapter (lavapipe in CI)");
    if let Some(style) = style {
        gpu.style = style;
    }
    pollster::block_on(GpuModel::load(gpu, &r.gguf(), &r.bytes[..], 256, &mut |_, _| {}))
        .unwrap_or_else(|e| panic!("{}: {e}", r.name))
}

#[test]
fn gpu_matches_transformers_on_every_architecture_and_path() {
    for name in MODELS {
        let r = Reference::load(name);
        let mut f32_path = gpu(true, None, &r);
        let worst = check(&r, &mut f32_path, 2e-3, "gpu f32 path");
        eprintln!("{name}: gpu f32 path max |logit diff| {worst:.2e}");
        let mut own = gpu(false, None, &r);
        let tol = if own.gpu.f16 { 5e-2 } else { 2e-3 };
        let worst = check(&r, &mut own, tol, "gpu own path");
        eprintln!("{name}: gpu own path (f16 {}) max |logit diff| {worst:.2e}", own.gpu.f16);
        let mut gpu_style = gpu(false, Some(KernelStyle::Gpu), &r);
        let worst = check(&r, &mut gpu_style, tol, "gpu-style kernels");
        eprintln!("{name}: gpu-style kernels max |logit diff| {worst:.2e}");
    }
}

/// The runtime's batched passes (a round's prompt chunks beside decode rows, batched decode
/// steps) on the newer layer plans, on the CPU backend and the GPU's f32 path (whose logits are within 2e-5 of the
/// reference, far below every case's smallest top-1/top-2 margin): the three reference prompts
/// in one batch give transformers' greedy tokens; so they do with speculation (self-speculation
/// on the first layer and prompt lookup: drafts accepted and rejected, so a short convolution's
/// state at rejected positions is written and then written over); and a second batch whose
/// prompts are the first ones plus 8 generated tokens starts from the prefix cache's blocks (a
/// hybrid model's state resumed mid-conversation) and gives the remaining 8. (A pool of 1024
/// tokens: the tiny gpt-oss file's context is 64.)
#[test]
fn batched_generation_gives_the_reference_tokens_on_the_newer_plans() {
    use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
    use webgpu_llm::sampling::SamplingParams;
    use webgpu_llm::speculate::{Drafter, Speculation};
    let backends = [BackendKind::Cpu, BackendKind::Gpu];
    let names =
        ["smollm3", "gemma2", "qwen3moe", "lfm2", "gptoss", "qwen35", "qwen35moe", "gemma4", "lfm2moe", "gptossmxfp4"];
    for (name, backend) in names.into_iter().flat_map(|n| backends.map(|b| (n, b))) {
        let r = Reference::load(name);
        let gpu = GpuOptions { force_f32: true, kv_tokens: Some(1024), ..Default::default() };
        let opts = LoadOptions { backend, context_length: Some(256), gpu };
        let mut engine = pollster::block_on(Engine::load(&r.bytes, opts, &mut |_, _| {})).unwrap();
        let greedy = |n: usize, speculate: Option<Speculation>| GenerateOptions {
            max_tokens: n,
            sampling: SamplingParams::greedy(),
            ignore_eos: true,
            speculate,
            ..Default::default()
        };
        let mut run = |requests: Vec<(Prompt, GenerateOptions)>| {
            let mut got = vec![Vec::new(); requests.len()];
            pollster::block_on(engine.generate_batch(&requests, &mut |seq, ev| {
                got[seq].push(ev.id);
                true
            }))
            .unwrap();
            got
        };
        let cases = r.cases();
        let prompts: Vec<Vec<u32>> = cases.iter().map(|c| ids(&c["prompt_ids"])).collect();
        let want: Vec<Vec<u32>> = cases.iter().map(|c| ids(&c["greedy_ids"])).collect();
        let drafters = [None, Some(Drafter::Layers(1)), Some(Drafter::Lookup)];
        for drafter in drafters {
            let speculate = drafter.map(|drafter| Speculation { drafter, draft_tokens: 3 });
            let requests = prompts.iter().map(|p| (Prompt::Tokens(p.clone()), greedy(16, speculate))).collect();
            let got = run(requests);
            for (ci, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{name} {backend:?} case {ci} in a batch, drafter {drafter:?}");
            }
        }
        let requests = prompts
            .iter()
            .zip(&want)
            .map(|(p, w)| (Prompt::Tokens([&p[..], &w[..8]].concat()), greedy(8, None)))
            .collect();
        for (ci, (g, w)) in run(requests).iter().zip(&want).enumerate() {
            assert_eq!(g[..], w[8..], "{name} {backend:?} case {ci} resumed from the prefix cache");
        }
    }
}

/// A mixture of experts' decode step reads its chosen experts' weights alone: the traffic
/// ledger's weight bytes are, by a count over the file's tensors, every other tensor once, one
/// embedding row, and 2 of the 8 experts' share of each stacked expert tensor.
#[test]
fn a_mixture_of_experts_step_reads_the_chosen_experts_weights_alone() {
    let r = Reference::load("qwen3moe");
    let model = gpu(true, None, &r);
    let gguf = r.gguf();
    let mut want = 0u64;
    for t in &gguf.tensors {
        want += if t.name.contains("_exps.") {
            t.byte_size / 8 * 2
        } else if t.name == "token_embd.weight" {
            t.byte_size / 512
        } else {
            t.byte_size
        };
    }
    let ledger = model.decode_traffic(40);
    assert_eq!(ledger.weights, want, "weight bytes a decode step reads");
    assert_eq!(model.min_decode_traffic(40).weights, want);
}

/// A mixture of experts the plan does not implement is an error naming what: more experts
/// used than there are, shared experts, another gating function, experts in an architecture
/// whose plan has none.
#[test]
fn an_unknown_expert_layout_is_an_error_naming_it() {
    use webgpu_llm::arch::Plan;
    use webgpu_llm::gguf::Value;
    let r = Reference::load("qwen3moe");
    let with = |key: &str, value: Value| {
        let mut g = r.gguf();
        g.metadata.insert(key.into(), value);
        Plan::from_gguf(&g, None).unwrap_err().to_string()
    };
    let cases = [
        ("qwen3moe.expert_used_count", Value::U32(9), "expert_used_count"),
        ("qwen3moe.expert_shared_count", Value::U32(1), "shared experts"),
        ("qwen3moe.expert_gating_func", Value::U32(2), "expert gating function"),
    ];
    for (key, value, what) in cases {
        let msg = with(key, value);
        assert!(msg.contains(what) && msg.contains(key), "{key}: {msg}");
    }
    assert!(Plan::from_gguf(&r.gguf(), None).is_ok());
    let mut g = Reference::load("qwen3").gguf();
    g.metadata.insert("qwen3.expert_count".into(), Value::U32(8));
    let msg = Plan::from_gguf(&g, None).unwrap_err().to_string();
    assert!(msg.contains("mixture of experts") && msg.contains("qwen3.expert_count"), "{msg}");
}

/// `ModelInfo` (what `inspect()` and the page show) counts a mixture of experts' active
/// parameters (every tensor, but 2 of the 8 experts of each stacked expert tensor) and a
/// hybrid's recurrent state beside its KV cache.
#[test]
fn model_info_counts_a_mixtures_active_parameters_and_a_hybrids_state() {
    use webgpu_llm::model::ModelInfo;
    let r = Reference::load("qwen3moe");
    let gguf = r.gguf();
    let info = ModelInfo::new(&gguf, r.bytes.len() as u64, None).unwrap();
    // By hand: 3 layers of gate, up (32 x 64 each) and down (64 x 32) for 8 experts.
    let experts = 3 * 3 * 8 * 32 * 64;
    assert_eq!(info.parameters - info.active_parameters, experts / 8 * 6);
    let dense = ModelInfo::new(&Reference::load("qwen3").gguf(), 0, None).unwrap();
    assert_eq!(dense.active_parameters, dense.parameters);
    assert_eq!(dense.state_bytes, 0);
    // LFM2 at 100 tokens: K and V of its 2 attention layers (2 KV heads of 16), and each
    // position's B * x (64 f32) for its 3 short-convolution layers.
    let hybrid = ModelInfo::new(&Reference::load("lfm2").gguf(), 0, Some(100)).unwrap();
    assert_eq!(hybrid.kv_bytes_f32, 2 * 2 * 32 * 100 * 4);
    assert_eq!(hybrid.state_bytes, 3 * 64 * 100 * 4);
    // Qwen3.5 at 100 tokens: K and V of its 2 attention layers (2 KV heads of 16); for each of
    // its 2 Gated DeltaNet layers, each position's q|k|v (2 x 32 + 64) and k|v|g|beta
    // (32 + 64 + 4 + 4), f32, and a sequence's state (4 value heads of 16 x 16 f32). Its MTP
    // layer (the file's last block) is no part of a token's pass.
    let r = Reference::load("qwen35");
    let hybrid = ModelInfo::new(&r.gguf(), 0, Some(100)).unwrap();
    assert_eq!(hybrid.kv_bytes_f32, 2 * 2 * 32 * 100 * 4);
    assert_eq!(hybrid.state_bytes, 2 * ((128 + 104) * 100 * 4 + 4 * 16 * 16 * 4));
    let mtp: u64 = r.gguf().tensors.iter().filter(|t| t.name.starts_with("blk.4.")).map(|t| t.n_elements()).sum();
    assert!(mtp > 0);
    assert_eq!(hybrid.parameters - hybrid.active_parameters, mtp);
    // Gemma 4 at 100 tokens: K and V of the 3 layers that keep their own: two sliding (2 KV
    // heads of 16) and one full (1 of 32); the 3 KV-shared layers keep none.
    let g = ModelInfo::new(&Reference::load("gemma4").gguf(), 0, Some(100)).unwrap();
    assert_eq!(g.kv_bytes_f32, (2 * 2 * 16 + 32) * 100 * 2 * 4);
}

/// Beam search on the GPU (beams forked in the KV pool: a shared block copied when a beam
/// writes into it, a short convolution's state block with the keys and values) gives the CPU
/// reference's beams on LFM2 (the hybrid) and Qwen3-MoE: each score within 1e-3, the same ids
/// where the scores are apart.
#[test]
fn beams_on_the_hybrid_and_the_mixture_give_the_cpu_beams() {
    use webgpu_llm::beam::{BeamOptions, EarlyStopping};
    use webgpu_llm::engine::{BackendKind, Engine, LoadOptions, Prompt};
    for name in ["lfm2", "qwen3moe", "gptoss", "qwen35", "qwen35moe", "gemma4", "lfm2moe"] {
        let r = Reference::load(name);
        let load = |backend| {
            let gpu = GpuOptions { force_f32: true, kv_tokens: Some(1024), ..Default::default() };
            let opts = LoadOptions { backend, context_length: Some(256), gpu };
            pollster::block_on(Engine::load(&r.bytes, opts, &mut |_, _| {})).unwrap()
        };
        let (mut cpu, mut gpu) = (load(BackendKind::Cpu), load(BackendKind::Gpu));
        for case in r.cases().iter().take(2) {
            let prompt = Prompt::Tokens(ids(&case["prompt_ids"]));
            let options = BeamOptions {
                beams: 4,
                max_tokens: 10,
                stop_ids: vec![],
                length_penalty: 1.0,
                early_stopping: EarlyStopping::Heuristic,
            };
            let want = pollster::block_on(cpu.beam_search(&prompt, &options)).unwrap();
            let got = pollster::block_on(gpu.beam_search(&prompt, &options)).unwrap();
            assert_eq!(got.len(), want.len(), "{name}");
            for (rank, ((g, _), (w, _))) in got.iter().zip(&want).enumerate() {
                assert!((g.score - w.score).abs() < 1e-3, "{name} beam {rank}: {} vs {}", g.score, w.score);
                let apart = want.iter().enumerate().all(|(j, (h, _))| j == rank || (h.score - w.score).abs() > 1e-3);
                if apart {
                    assert_eq!(g.ids, w.ids, "{name} beam {rank}");
                }
            }
        }
    }
}

/// A hybrid's layer kinds that do not add up are errors naming the key: a per-layer KV head
/// count of the wrong length, no attention layer at all, two attention layers' counts apart,
/// a per-layer count in an architecture without short convolutions, a kernel length out of
/// range or missing.
#[test]
fn a_hybrid_layer_layout_that_does_not_add_up_is_an_error_naming_it() {
    use webgpu_llm::arch::Plan;
    use webgpu_llm::gguf::{Array, Value};
    let r = Reference::load("lfm2");
    let with = |key: &str, value: Option<Value>| {
        let mut g = r.gguf();
        match value {
            Some(v) => g.metadata.insert(key.into(), v),
            None => g.metadata.remove(key),
        };
        Plan::from_gguf(&g, None).unwrap_err().to_string()
    };
    let kv = "lfm2.attention.head_count_kv";
    let cases = [
        (kv, Some(Value::List(Array::U32(vec![0, 0, 2, 0]))), "one per layer"),
        (kv, Some(Value::List(Array::U32(vec![0; 5]))), "some layer must have attention"),
        (kv, Some(Value::List(Array::U32(vec![0, 0, 2, 0, 1]))), "different KV head counts"),
        ("lfm2.shortconv.l_cache", Some(Value::U32(1)), "from 2 to 16"),
        ("lfm2.shortconv.l_cache", None, "lfm2.shortconv.l_cache"),
    ];
    for (key, value, what) in cases {
        let msg = with(key, value);
        assert!(msg.contains(what) && msg.contains(key), "{key}: {msg}");
    }
    assert!(Plan::from_gguf(&r.gguf(), None).is_ok());
    let mut g = Reference::load("qwen3").gguf();
    g.metadata.insert("qwen3.attention.head_count_kv".into(), Value::List(Array::U32(vec![2, 2, 2])));
    let msg = Plan::from_gguf(&g, None).unwrap_err().to_string();
    assert!(msg.contains("qwen3.attention.head_count_kv"), "{msg}");
    // Qwen3.5: Gated DeltaNet sizes past what the kernels take (or a state past 2^24 values a
    // layer, which a small file could ask for) are refused naming the key, before anything is
    // allocated; as are more than one MTP layer and M-RoPE sections that leave a pair out.
    let r = Reference::load("qwen35");
    let refused = |key: &str, value: Value, what: &str| {
        let mut g = r.gguf();
        g.metadata.insert(key.into(), value);
        let msg = Plan::from_gguf(&g, None).unwrap_err().to_string();
        assert!(msg.contains(what) && msg.contains(key), "{key}: {msg}");
    };
    refused("qwen35.ssm.state_size", Value::U32(4096), "at most 512");
    refused("qwen35.ssm.time_step_rank", Value::U32(2048), "at most 1024");
    refused("qwen35.ssm.inner_size", Value::U32(4 * 512), "at most 256 values");
    refused("qwen35.ssm.conv_kernel", Value::U32(40), "from 2 to 16");
    refused("qwen35.nextn_predict_layers", Value::U32(2), "multi-token-prediction layers");
    refused("qwen35.rope.dimension_sections", Value::List(Array::I32(vec![1, 1, 1, 0])), "M-RoPE sections");
    assert!(Plan::from_gguf(&r.gguf(), None).is_ok());
}

/// Which layers slide, and their RoPE base, come from the architecture (as llama.cpp hard-codes
/// them): a file whose `attention.sliding_window_pattern` or `rope.freq_base_swa` says otherwise
/// is refused naming the key; one that says the same loads.
#[test]
fn a_sliding_layout_other_than_the_architectures_is_an_error_naming_it() {
    use webgpu_llm::arch::Plan;
    use webgpu_llm::gguf::{Array, Value};
    for name in ["gemma2", "gptoss"] {
        let r = Reference::load(name);
        let arch = r.gguf().get_str("general.architecture").unwrap().unwrap().to_string();
        let with = |key: &str, value: Value| {
            let mut g = r.gguf();
            g.metadata.insert(format!("{arch}.{key}"), value);
            Plan::from_gguf(&g, None).map(|_| ()).map_err(|e| e.to_string())
        };
        assert_eq!(with("attention.sliding_window_pattern", Value::U32(2)), Ok(()), "{name}");
        let flags = Value::List(Array::Bool(vec![true, false, true, false]));
        assert_eq!(with("attention.sliding_window_pattern", flags), Ok(()), "{name}");
        for value in [Value::U32(3), Value::List(Array::Bool(vec![false, true, false, true]))] {
            let msg = with("attention.sliding_window_pattern", value).unwrap_err();
            assert!(msg.contains("attention.sliding_window_pattern"), "{name}: {msg}");
        }
        let base = r.gguf().get_f32(&format!("{arch}.rope.freq_base")).unwrap().unwrap_or(10000.0);
        assert_eq!(with("rope.freq_base_swa", Value::F32(base)), Ok(()), "{name}");
        let msg = with("rope.freq_base_swa", Value::F32(base / 2.0)).unwrap_err();
        assert!(msg.contains("rope.freq_base_swa"), "{name}: {msg}");
    }
}

/// A copy of `r`'s file with each listed tensor's values (F32) multiplied by its factor.
fn doctored(r: &Reference, scale: &[(&str, f32)]) -> Vec<u8> {
    let gguf = r.gguf();
    let mut bytes = r.bytes.clone();
    for &(name, factor) in scale {
        let t = gguf.tensor(name).unwrap_or_else(|| panic!("{name}"));
        let data = t.data(&r.bytes);
        let at = data.as_ptr() as usize - r.bytes.as_ptr() as usize;
        for v in bytes[at..at + data.len()].chunks_exact_mut(4) {
            let x = f32::from_le_bytes(v.try_into().unwrap()) * factor;
            v.copy_from_slice(&x.to_le_bytes());
        }
    }
    bytes
}

/// `speculate: "mtp"` (Qwen3.5's MTP head drafting, on the CPU backend and the GPU's f32 path,
/// whose drafts and counts are the CPU's) keeps the greedy tokens:
/// on the reference model, transformers' (its random head's drafts are rejected, so the Gated
/// DeltaNet's state goes back over rejected positions); and on a copy whose layers write a fifth
/// of what they did into the residual stream (so the model often repeats its input token) and
/// whose head passes the embedding of the token it reads through (so it drafts that token
/// again), drafts are accepted and rejected in each generation, with the tokens of plain
/// greedy decoding of that copy.
#[test]
fn mtp_speculation_keeps_the_greedy_tokens() {
    use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
    use webgpu_llm::sampling::SamplingParams;
    use webgpu_llm::speculate::{Drafter, Speculation};
    let r = Reference::load("qwen35");
    let gguf = r.gguf();
    let d = 64;
    let mut scale: Vec<(String, f32)> = (0..4)
        .flat_map(|i| ["ssm_out", "attn_output", "ffn_down"].map(|t| format!("blk.{i}.{t}.weight")))
        .filter(|n| gguf.tensor(n).is_some())
        .map(|n| (n, 0.2))
        .collect();
    scale.extend(["blk.4.attn_output.weight", "blk.4.ffn_down.weight"].map(|n| (n.to_string(), 0.0)));
    let refs: Vec<(&str, f32)> = scale.iter().map(|(n, f)| (n.as_str(), *f)).collect();
    let mut echo = doctored(&r, &refs);
    // eh_proj ([2d] -> [d], the embedding's half first): the embedding's half the identity.
    let t = gguf.tensor("blk.4.nextn.eh_proj.weight").unwrap();
    let at = t.data(&r.bytes).as_ptr() as usize - r.bytes.as_ptr() as usize;
    for (i, v) in echo[at..at + 4 * 2 * d * d].chunks_exact_mut(4).enumerate() {
        v.copy_from_slice(&(if i % (2 * d) == i / (2 * d) { 1f32 } else { 0.0 }).to_le_bytes());
    }
    let options = |speculate| GenerateOptions {
        max_tokens: 16,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        speculate,
        ..Default::default()
    };
    let mtp = Some(Speculation { drafter: Drafter::Mtp, draft_tokens: 3 });
    // The CPU's figures per (file, case): the GPU's f32 path drafts the same tokens.
    let mut cpu_stats = Vec::new();
    let files = [(&r.bytes, "the reference model"), (&echo, "the echoing copy")];
    for ((file, what), backend) in [BackendKind::Cpu, BackendKind::Gpu].into_iter().flat_map(|b| files.map(|f| (f, b)))
    {
        let gpu = GpuOptions { force_f32: true, ..Default::default() };
        let opts = LoadOptions { backend, context_length: Some(256), gpu };
        let mut engine = pollster::block_on(Engine::load(file, opts, &mut |_, _| {})).unwrap();
        for (ci, case) in r.cases().iter().enumerate() {
            let prompt = Prompt::Tokens(ids(&case["prompt_ids"]));
            let mut run = |o: &GenerateOptions| {
                let (mut out, mut origins) = (Vec::new(), Vec::new());
                let stats = pollster::block_on(engine.generate(&prompt, o, &mut |ev| {
                    out.push(ev.id);
                    origins.push(ev.speculation.clone());
                    true
                }))
                .unwrap();
                (out, (stats.speculation, origins))
            };
            let (plain, _) = run(&options(None));
            let (drafted, (sp, origins)) = run(&options(mtp));
            let sp = sp.expect("speculation stats");
            assert_eq!(drafted, plain, "{what} {backend:?} case {ci}: with MTP drafts ({sp:?})");
            // Each token's origin: an accepted draft, or the drafts (their texts) it replaced.
            match backend {
                BackendKind::Cpu => cpu_stats.push(((what, ci), (sp, origins))),
                BackendKind::Gpu => {
                    let cpu = &cpu_stats.iter().find(|(key, _)| *key == (what, ci)).expect("the CPU ran first").1;
                    assert_eq!((sp, &origins), (cpu.0, &cpu.1), "{what} case {ci}: the GPU's MTP drafts are the CPU's");
                }
            }
            if file == &r.bytes {
                assert_eq!(plain, ids(&case["greedy_ids"]), "case {ci}: transformers' greedy tokens");
                assert!(sp.drafted > 0, "case {ci}: {sp:?}");
            } else {
                assert!(sp.accepted > 0 && sp.accepted < sp.drafted, "{what} case {ci}: {sp:?}");
                assert!(sp.passes < 16, "{what} case {ci}: accepted drafts save passes: {sp:?}");
            }
            eprintln!("qwen35 {what} {backend:?} case {ci}: MTP drafts {sp:?}");
        }
    }
}
