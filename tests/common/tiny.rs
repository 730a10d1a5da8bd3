//! Tiny random-weight llama models made in memory with the crate's GGUF writer, for the
//! properties any model shows (stops, batching, speculation, beams, the KV pool): a few hundred
//! KB, so a GPU test on a software driver takes seconds. The truth for a run on them is the CPU
//! reference (`CpuModel`) on the same bytes, driven here by its own greedy loop (`greedy`), not
//! by the engine under test.
#![allow(dead_code)]

use webgpu_llm::gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use webgpu_llm::model::{CpuModel, Logits};

/// A llama-architecture shape with ChatML special tokens and a byte-level vocabulary.
#[derive(Debug, Clone, Copy)]
pub struct Tiny {
    pub vocab: u64,
    pub layers: u64,
    pub d_model: u64,
    pub ffn: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub context: u32,
    /// Seeds every weight.
    pub seed: u64,
}

/// 2048 tokens (over the 1024 candidates GPU top-p selection reads back), 4 layers (so 2 can
/// draft for the rest), Q8_0 matrices (repacked at upload: 34-byte blocks), GQA 4/2.
pub const CHAT: Tiny =
    Tiny { vocab: 2048, layers: 4, d_model: 64, ffn: 128, heads: 4, kv_heads: 2, context: 4096, seed: 20261201 };

/// Ids of the special tokens (after the 256 byte tokens).
pub const IM_START: u32 = 256;
pub const IM_END: u32 = 257;
pub const ENDOFTEXT: u32 = 258;

/// A word for token `i`: a space ("Ġ" in the byte map) and letters, so that generated text is
/// readable and every token decodes to whole characters.
fn word(mut i: u64) -> String {
    let mut w = String::from("\u{120}");
    loop {
        w.push((b'a' + (i % 26) as u8) as char);
        i /= 26;
        if i == 0 {
            return w;
        }
    }
}

/// The tests' seeded random numbers (xorshift64), for the weights of the models they write.
pub struct Xorshift(pub u64);

impl Xorshift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// `n` F32 values of mean 0 and standard deviation `std` (uniform), as bytes.
    pub fn weights(&mut self, n: u64, std: f32) -> Vec<u8> {
        let a = std * 3f32.sqrt();
        (0..n).flat_map(|_| self.uniform(-a, a).to_le_bytes()).collect()
    }

    /// `n` F32 values uniform in [lo, hi), as bytes.
    pub fn norm(&mut self, n: u64, lo: f32, hi: f32) -> Vec<u8> {
        (0..n).flat_map(|_| self.uniform(lo, hi).to_le_bytes()).collect()
    }
}

/// `n` weights (a multiple of 32) as Q8_0 blocks of standard deviation about `std`: each block an
/// f16 scale then 32 quants uniform in [-127, 127] (standard deviation 73.3).
fn q8_0(rng: &mut Xorshift, n: u64, std: f32) -> Vec<u8> {
    let mut out = Vec::with_capacity((n / 32 * 34) as usize);
    for _ in 0..n / 32 {
        let jitter = 0.75 + 0.5 * (rng.next() % 1000) as f32 / 1000.0;
        out.extend_from_slice(&half::f16::from_f32(std * jitter / 73.3).to_le_bytes());
        for _ in 0..32 {
            out.push(((rng.next() % 255) as i32 - 127) as i8 as u8);
        }
    }
    out
}

/// `n` f32 norm weights uniform in [0.5, 1.5].
fn norm(rng: &mut Xorshift, n: u64) -> Vec<u8> {
    (0..n).flat_map(|_| (0.5 + (rng.next() % 10_000) as f32 / 10_000.0).to_le_bytes()).collect()
}

impl Tiny {
    /// The model's GGUF file.
    pub fn bytes(&self) -> Vec<u8> {
        self.bytes_with(|_| {})
    }

    /// The model's GGUF file, its token strings changed by `edit` first.
    pub fn bytes_with(&self, edit: impl FnOnce(&mut Vec<String>)) -> Vec<u8> {
        let s = self;
        let head_dim = s.d_model / s.heads;
        let mut w = GgufWriter::new(3);
        w.metadata("general.architecture", Value::String("llama".into()))
            .metadata("general.name", Value::String(format!("tiny random llama {}", s.seed)))
            .metadata("llama.block_count", Value::U32(s.layers as u32))
            .metadata("llama.context_length", Value::U32(s.context))
            .metadata("llama.embedding_length", Value::U32(s.d_model as u32))
            .metadata("llama.feed_forward_length", Value::U32(s.ffn as u32))
            .metadata("llama.attention.head_count", Value::U32(s.heads as u32))
            .metadata("llama.attention.head_count_kv", Value::U32(s.kv_heads as u32))
            .metadata("llama.rope.freq_base", Value::F32(10000.0))
            .metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        let mut tokens = webgpu_llm::synthetic::byte_tokens();
        tokens.extend(["<|im_start|>", "<|im_end|>", "<|endoftext|>"].map(String::from));
        let named = tokens.len() as u64;
        tokens.extend((named..s.vocab).map(|i| word(i - named)));
        edit(&mut tokens);
        let types: Vec<i32> = (0..s.vocab).map(|i| if (256..named).contains(&i) { 3 } else { 1 }).collect();
        w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
            .metadata("tokenizer.ggml.pre", Value::String("default".into()))
            .metadata("tokenizer.ggml.tokens", Value::List(Array::from(tokens)))
            .metadata("tokenizer.ggml.token_type", Value::List(Array::I32(types)))
            .metadata("tokenizer.ggml.merges", Value::List(Array::from(Vec::<String>::new())))
            .metadata("tokenizer.ggml.bos_token_id", Value::U32(IM_START))
            .metadata("tokenizer.ggml.eos_token_id", Value::U32(IM_END))
            .metadata("tokenizer.ggml.padding_token_id", Value::U32(ENDOFTEXT));

        let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15 ^ s.seed);
        let (d, kv) = (s.d_model, head_dim * s.kv_heads);
        let data = q8_0(&mut rng, d * s.vocab, 0.4);
        w.tensor("token_embd.weight", &[d, s.vocab], GgmlType::Q8_0, data);
        // Byte tokens get small output rows, the non-ASCII ones the smallest: generated text is
        // mostly the word tokens, and never a lone byte of a UTF-8 character in practice.
        let mut output = Vec::new();
        for row in 0..s.vocab {
            let std = match row {
                0..128 => 0.1,
                128..256 => 0.02,
                _ => 0.4,
            };
            output.extend(q8_0(&mut rng, d, std));
        }
        w.tensor("output.weight", &[d, s.vocab], GgmlType::Q8_0, output);
        let mut matrix = |w: &mut GgufWriter, name: &str, dims: [u64; 2], std: f32| {
            let data = q8_0(&mut rng, dims[0] * dims[1], std);
            w.tensor(name, &dims, GgmlType::Q8_0, data);
        };
        for i in 0..s.layers {
            let b = |n: &str| format!("blk.{i}.{n}.weight");
            matrix(&mut w, &b("attn_q"), [d, d], 0.08);
            matrix(&mut w, &b("attn_k"), [d, kv], 0.08);
            matrix(&mut w, &b("attn_v"), [d, kv], 0.08);
            matrix(&mut w, &b("attn_output"), [d, d], 0.08);
            matrix(&mut w, &b("ffn_gate"), [d, s.ffn], 0.08);
            matrix(&mut w, &b("ffn_up"), [d, s.ffn], 0.08);
            matrix(&mut w, &b("ffn_down"), [s.ffn, d], 0.08);
        }
        for i in 0..s.layers {
            for n in ["attn_norm", "ffn_norm"] {
                w.tensor(&format!("blk.{i}.{n}.weight"), &[d], GgmlType::F32, norm(&mut rng, d));
            }
        }
        w.tensor("output_norm.weight", &[d], GgmlType::F32, norm(&mut rng, d));
        w.to_bytes()
    }
}

/// `bytes` (a GGUF file) written again with metadata `key` set to `value`.
pub fn with_metadata(bytes: &[u8], key: &str, value: Value) -> Vec<u8> {
    let g = Gguf::parse(bytes).unwrap();
    let mut w = GgufWriter::new(3);
    let mut keys: Vec<_> = g.metadata.iter().filter(|(k, _)| k.as_str() != key).collect();
    keys.sort_by_key(|(k, _)| k.as_str());
    for (k, v) in keys {
        w.metadata(k, v.clone());
    }
    w.metadata(key, value);
    for t in &g.tensors {
        w.tensor(&t.name, &t.shape, t.ty, t.data(bytes).to_vec());
    }
    w.to_bytes()
}

/// The CPU reference's greedy continuation of `prompt` (`n` tokens, EOS not a stop), by its own
/// loop over `CpuModel::forward`, with the top-1/top-2 logit margin at each step.
pub fn greedy(bytes: &[u8], prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let gguf = Gguf::parse(bytes).unwrap();
    let model = CpuModel::load(&gguf, bytes).unwrap();
    let mut cache = model.new_cache();
    let mut logits = model.forward(&mut cache, prompt, Logits::Last).unwrap();
    let (mut ids, mut margins) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let next = webgpu_llm::sampling::argmax(&logits);
        let top = logits[next as usize];
        let second =
            logits.iter().enumerate().filter(|&(i, _)| i != next as usize).map(|(_, &l)| l).fold(f32::MIN, f32::max);
        ids.push(next);
        margins.push(top - second);
        logits = model.forward(&mut cache, &[next], Logits::Last).unwrap();
    }
    (ids, margins)
}

/// The CPU reference's logits after `prompt` (the last position's).
pub fn logits(bytes: &[u8], prompt: &[u32]) -> Vec<f32> {
    let gguf = Gguf::parse(bytes).unwrap();
    let model = CpuModel::load(&gguf, bytes).unwrap();
    model.forward(&mut model.new_cache(), prompt, Logits::Last).unwrap()
}

/// `CHAT`'s file, made once.
pub fn chat() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| CHAT.bytes())
}

/// The text `ids` decode to, by the tokenizer's whole-sequence decode (not the engine's
/// incremental detokenizer).
pub fn decode(bytes: &[u8], ids: &[u32]) -> String {
    let gguf = Gguf::parse(bytes).unwrap();
    webgpu_llm::tokenizer::Tokenizer::from_gguf(&gguf).unwrap().decode(ids).unwrap()
}

/// A ChatML prompt by hand: `<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n`, each
/// character a byte token (the vocabulary has no merges).
pub fn chat_prompt(turns: &[(&str, &str)]) -> Vec<u32> {
    let mut ids = Vec::new();
    for (role, text) in turns {
        ids.push(IM_START);
        ids.extend(format!("{role}\n{text}").bytes().map(u32::from));
        ids.push(IM_END);
        ids.push(u32::from(b'\n'));
    }
    ids.push(IM_START);
    ids.extend("assistant\n".bytes().map(u32::from));
    ids
}

/// `CHAT` with its end-of-sequence token moved to the token the CPU reference's greedy answer to
/// `prompt` makes at index `at` (its first occurrence there), so that a generation ends at EOS
/// after `at` tokens; returns the file and the EOS id.
pub fn chat_ending_at(prompt: &[u32], at: usize) -> (Vec<u8>, u32) {
    let (ids, _) = greedy(chat(), prompt, at + 1);
    let eos = ids[at];
    assert!(!ids[..at].contains(&eos), "token {eos} comes before index {at}: pick another index");
    (with_metadata(chat(), "tokenizer.ggml.eos_token_id", Value::U32(eos)), eos)
}

/// The system turn prompts 4 and 5 of `prompts()` share: 24 tokens.
pub const SYSTEM: (&str, &str) = ("system", "Be brief, kind");

/// Eight prompts of 5 to 40 tokens, chat and raw: word-token ids, ChatML turns, and two chats
/// (4 and 5) that share a system turn.
pub fn prompts() -> Vec<Vec<u32>> {
    let raw = |n: u32, seed: u32| -> Vec<u32> {
        std::iter::once(IM_START).chain((1..n).map(|i| 259 + (i * 131 + seed * 977) % 1789)).collect()
    };
    vec![
        raw(5, 1),
        chat_prompt(&[("user", "Tell me a story")]),
        raw(12, 2),
        chat_prompt(&[("user", "What is 2+2?")]),
        chat_prompt(&[SYSTEM, ("user", "Where is Paris?")]),
        chat_prompt(&[SYSTEM, ("user", "Explain gravity.")]),
        raw(40, 3),
        chat_prompt(&[("user", "What is the capital of France?")]),
    ]
}
