//! A seeded mutation fuzzer over the whole load path, on stable Rust (no libFuzzer): GGUF parse
//! -> ModelConfig, Plan and ModelInfo -> Tokenizer::from_gguf (encode, decode) ->
//! ChatTemplate::from_gguf and a two-message render. Every input must end in a result or an
//! error: no panic, under a second, and no allocation sized from the file's numbers rather than
//! its bytes (see `Limits`).
//!
//! Seeds: the headers of the tiny models in tests/data/arch, of the default model (with and
//! without its 49k-token vocabulary), of Gemma 3 without its vocabulary, and a file holding every
//! value type. Mutations: bit flips, integers (boundary and huge values, the file's own length)
//! written over the fields a walk of the seed finds (counts, lengths, dimensions, types, offsets,
//! metadata values), one metadata value copied over another, random words at random offsets,
//! truncations, splices and deletions, a different file length for the header prefix, and keys
//! renamed to ones the loader reads (a sliding window, RoPE scaling, the alignment, ...) or string
//! values replaced (architectures, tokenizer kinds, pre-tokenizers, chat templates), with the
//! tensor data moved to stay where the header says.
//!
//! Building a 49k-token tokenizer takes some 90 ms, the rest of a load well under one, so the big
//! vocabulary is a small share of the seeds and the tokenizer stage runs again only when the
//! input's `tokenizer.*` metadata differs from its seed's (those two functions read nothing else).
//!
//! FUZZ_EXECS (default 100 000) executions from FUZZ_SEED (default 1), stopping early after
//! FUZZ_SECONDS (default 40); scripts/fuzz runs a million. A finding is written to
//! target/tmp/fuzz-findings/ and fails the test; kept as a regression file in tests/data/fuzz/
//! (`<name>.gguf`, or `<name>.of-<file length>.gguf` for a header prefix), it is replayed by
//! `every_saved_fuzz_input_loads_to_a_result_or_an_error`.

use crate::common;
use crate::layout;
use crate::meter;

use layout::{Field, Kind};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use webgpu_llm::arch::{Plan, ROPE_FREQS};
use webgpu_llm::chat::{ChatTemplate, Message};
use webgpu_llm::gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use webgpu_llm::model::ModelInfo;
use webgpu_llm::tokenizer::Tokenizer;

const MIB: usize = 1 << 20;

/// What one execution may take.
struct Limits;

impl Limits {
    const TIME: Duration = Duration::from_secs(1);
    /// Parse, config, plan: no allocation beyond the input's bytes plus this.
    const OURS_SLACK: usize = 64 << 10;
    /// Tokenizer and template (the tokenizers crate): its hash tables take about twice the
    /// vocabulary's bytes, and a BPE model reserves a 0.8 MB cache whatever its size.
    fn theirs_largest(input: usize) -> usize {
        2 * input + MIB
    }
    /// Live bytes at once, over the whole load: catches a blow-up made of many small pieces.
    fn peak(input: usize) -> usize {
        16 * input + 16 * MIB
    }
    /// One allocation past this fails and aborts the run (`Current` holds the input).
    const CEILING: usize = 1 << 30;
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// splitmix64: the same inputs from the same seed on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.below(items.len())])
    }
}

/// An input: the first bytes of a file of `file_len` bytes (all of it when they are equal).
#[derive(Clone)]
struct Input {
    bytes: Vec<u8>,
    file_len: u64,
}

struct Seed {
    name: String,
    input: Input,
    /// Metadata scalars: changing one keeps the file parsing, so config, plan and tokenizer see it.
    values: Vec<Field>,
    /// Counts, lengths and type ids of the header and of metadata.
    structure: Vec<Field>,
    /// Dimension counts, dimensions, types and offsets of the tensors.
    tensors: Vec<Field>,
    /// Lengths of strings inside arrays (tokens, merges): hit now and then.
    array_strings: Vec<Field>,
    /// Lengths of the keys and of the string values, whose text `replace_text` swaps.
    texts: Vec<Field>,
    header: HeaderLayout,
    /// Keys a renamed key may take: ones the loader reads, most of them for this architecture.
    keys: Vec<String>,
    /// Chance in a thousand of picking this seed.
    weight: usize,
    /// The seed's `tokenizer.*` metadata (sorted), for skipping an unchanged tokenizer.
    tokenizer_keys: Vec<(String, Value)>,
}

impl Seed {
    fn new(name: &str, input: Input, weight: usize) -> Self {
        let (mut values, mut structure, mut tensors, mut array_strings, mut texts) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut in_array = false;
        for f in layout::fields(&input.bytes) {
            match f.kind {
                Kind::ArrayLength { .. } => in_array = true,
                Kind::KeyLength | Kind::NameLength => in_array = false,
                _ => {}
            }
            if matches!(f.kind, Kind::KeyLength) || (f.kind == Kind::StringLength && !in_array) {
                texts.push(f.clone());
            }
            match f.kind {
                Kind::Value { .. } => values.push(f),
                Kind::StringLength if in_array => array_strings.push(f),
                Kind::NameLength | Kind::NDims | Kind::Dim | Kind::TensorType | Kind::DataOffset => tensors.push(f),
                _ => structure.push(f),
            }
        }
        let gguf =
            Gguf::parse_prefix(&input.bytes, input.file_len).unwrap_or_else(|e| panic!("seed {name} must parse: {e}"));
        let tokenizer_keys = tokenizer_keys(&gguf);
        let arch = gguf.get_str("general.architecture").ok().flatten().unwrap_or("llama");
        let keys =
            ARCH_KEYS.iter().map(|k| format!("{arch}.{k}")).chain(OTHER_KEYS.iter().map(|k| k.to_string())).collect();
        let header = HeaderLayout::of(&input);
        Self {
            name: name.into(),
            input,
            values,
            structure,
            tensors,
            array_strings,
            texts,
            header,
            keys,
            weight,
            tokenizer_keys,
        }
    }
}

fn tokenizer_keys(gguf: &Gguf) -> Vec<(String, Value)> {
    let mut keys: Vec<_> = gguf
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    keys
}

/// Whether `gguf` has exactly these `tokenizer.*` keys and values.
fn same_tokenizer(gguf: &Gguf, keys: &[(String, Value)]) -> bool {
    gguf.metadata.keys().filter(|k| k.starts_with("tokenizer.")).count() == keys.len()
        && keys.iter().all(|(k, v)| gguf.get(k) == Some(v))
}

fn arch_models() -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/arch");
    let mut models: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.gguf").exists())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(p.join("model.gguf")).unwrap()))
        .collect();
    models.sort();
    assert!(models.len() >= 5, "the tiny models of tests/data/arch");
    models
}

/// The header of `bytes` (with the RoPE frequencies' data when it follows), as a prefix.
fn header_of(bytes: &[u8]) -> Input {
    let g = Gguf::parse(bytes).unwrap();
    let end = g.tensor(ROPE_FREQS).map_or(0, |t| t.file_offset + t.byte_size).max(g.data_offset);
    Input { bytes: bytes[..end as usize].to_vec(), file_len: bytes.len() as u64 }
}

/// Where an intact header ends, where its tensor data starts, and the alignment between them.
#[derive(Clone, Copy)]
struct HeaderLayout {
    end: usize,
    data_offset: usize,
    alignment: u64,
}

impl HeaderLayout {
    fn of(input: &Input) -> Self {
        let g = Gguf::parse_prefix(&input.bytes, input.file_len).unwrap();
        let last = layout::fields(&input.bytes).pop().unwrap();
        Self { end: last.offset + last.width, data_offset: g.data_offset as usize, alignment: g.alignment }
    }
}

/// The intact header `input` with `edits` (ranges of the header, in order, and their new bytes):
/// the tensor data keeps its length and starts at the alignment after the new header.
fn edit_header(input: &Input, layout: HeaderLayout, edits: &[(std::ops::Range<usize>, &[u8])]) -> Input {
    let bytes = &input.bytes;
    let mut out = Vec::with_capacity(bytes.len());
    let mut pos = 0;
    for (range, with) in edits {
        out.extend_from_slice(&bytes[pos..range.start]);
        out.extend_from_slice(with);
        pos = range.end;
    }
    out.extend_from_slice(&bytes[pos..layout.end]);
    if input.file_len <= layout.data_offset as u64 {
        // No tensor data (and perhaps no padding) follows.
        return Input { file_len: out.len() as u64, bytes: out };
    }
    let data_offset = (out.len() as u64).next_multiple_of(layout.alignment) as usize;
    out.resize(data_offset, 0);
    out.extend_from_slice(&bytes[layout.data_offset..]);
    Input { file_len: input.file_len - layout.data_offset as u64 + data_offset as u64, bytes: out }
}

/// `input` less the metadata pairs of `keys`.
fn without_keys(input: &Input, keys: &[&str]) -> Input {
    let fields = layout::fields(&input.bytes);
    // Each pair runs from its key's length to the next key's length (or the first tensor info).
    let starts: Vec<usize> =
        fields.iter().filter(|f| matches!(f.kind, Kind::KeyLength | Kind::NameLength)).map(|f| f.offset).collect();
    let mut edits = Vec::new();
    for (i, f) in fields.iter().enumerate() {
        let Kind::ValueType { key } = &f.kind else { continue };
        if keys.contains(&key.as_str()) {
            let start = fields[i - 1].offset;
            let end = starts.iter().copied().find(|&s| s > start).unwrap_or(input.bytes.len());
            edits.push((start..end, &[][..]));
        }
    }
    let mut out = edit_header(input, HeaderLayout::of(input), &edits);
    let kv_count = fields.iter().find(|f| f.kind == Kind::KvCount).unwrap();
    kv_count.write(&mut out.bytes, kv_count.read(&input.bytes) - keys.len() as u64);
    out
}

/// Keys (after `<arch>.`) that a renamed key may take: each changes what the loader does.
const ARCH_KEYS: [&str; 16] = [
    "attention.sliding_window",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.freq_base",
    "expert_count",
    "attention.causal",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "attention.key_length",
    "attention.value_length",
    "attention.head_count_kv",
    "rope.dimension_count",
    "vocab_size",
    "block_count",
    "context_length",
    "embedding_length",
];
const OTHER_KEYS: [&str; 14] = [
    "general.alignment",
    "general.architecture",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.chat_template",
    "split.count",
    "split.tensors.count",
];
/// Texts a string value may take: architectures, tokenizer kinds, pre-tokenizers, RoPE scalings,
/// chat templates.
const TEXTS: [&str; 22] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma3",
    "bert",
    "gpt2",
    "",
    "llama-bpe",
    "gpt-4o",
    "tekken",
    "default",
    "linear",
    "yarn",
    "none",
    "<|im_end|>",
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content | trim }}\n{% endfor %}{{ eos_token }}",
    "{% for m in messages %}{% if m.role == 'user' %}{{ raise_exception('no') }}{% endif %}{% endfor %}",
    "{{ messages[0]['content'] * 1000 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% if",
];

/// The seed with the text of one key or string value replaced.
fn replace_text(rng: &mut Rng, seed: &Seed) -> Option<Input> {
    let f = rng.pick(&seed.texts)?;
    let len = f.read(&seed.input.bytes) as usize;
    let text = if f.kind == Kind::KeyLength {
        match rng.pick(&seed.keys) {
            Some(key) if rng.chance(80) => key.clone(),
            // Another key of the file: a duplicate.
            _ => seed.texts.iter().find(|t| t.kind == Kind::KeyLength).map(|t| text_of(&seed.input.bytes, t))?,
        }
    } else {
        TEXTS[rng.below(TEXTS.len())].to_string()
    };
    let mut with = (text.len() as u64).to_le_bytes().to_vec();
    with.extend_from_slice(text.as_bytes());
    Some(edit_header(&seed.input, seed.header, &[(f.offset..f.offset + 8 + len, &with)]))
}

fn text_of(bytes: &[u8], length: &Field) -> String {
    let start = length.offset + 8;
    String::from_utf8_lossy(&bytes[start..start + length.read(bytes) as usize]).into_owned()
}

/// A small file with every value type, nested arrays included, and two tensors.
fn every_value_type_file() -> Input {
    let mut w = GgufWriter::new(3);
    let values = [
        Value::U8(200),
        Value::I8(-5),
        Value::U16(60000),
        Value::I16(-30000),
        Value::U32(4_000_000_000),
        Value::I32(-2_000_000_000),
        Value::F32(0.125),
        Value::Bool(true),
        Value::String("héllo ✓".into()),
        Value::U64(u64::MAX),
        Value::I64(i64::MIN),
        Value::F64(-1e300),
        Value::List(Array::from(vec!["a", "", "bc"])),
        Value::List(Array::I32(vec![1, -1, 7])),
        Value::List(Array::Array(vec![Array::F32(vec![1.0]), Array::from(vec!["x"]), Array::U8(vec![])])),
    ];
    for (i, v) in values.into_iter().enumerate() {
        w.metadata(&format!("k{i}"), v);
    }
    w.metadata("general.alignment", Value::U32(64));
    w.tensor("a.weight", &[32], GgmlType::Q8_0, vec![0; 34]);
    w.tensor("b.weight", &[2, 3], GgmlType::F32, vec![0; 24]);
    let bytes = w.to_bytes();
    Input { file_len: bytes.len() as u64, bytes }
}

fn seeds() -> Vec<Seed> {
    const VOCAB: [&str; 3] = ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"];
    let mut seeds: Vec<Seed> =
        arch_models().into_iter().map(|(name, bytes)| Seed::new(&name, header_of(&bytes), 140)).collect();
    let smol = header_of(common::model_bytes());
    seeds.push(Seed::new("smollm2 without vocabulary", without_keys(&smol, &VOCAB), 140));
    seeds.push(Seed::new("smollm2", smol, 3));
    let gemma = header_of(common::Reference::Gemma3.bytes());
    let gemma_vocab = ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"];
    seeds.push(Seed::new("gemma3 without vocabulary", without_keys(&gemma, &gemma_vocab), 70));
    seeds.push(Seed::new("gemma3 tokenizer, 3000 tokens", sentencepiece_file(3000), 60));
    seeds.push(Seed::new("every value type", every_value_type_file(), 80));
    seeds
}

/// Gemma 3's tokenizer metadata with its first `n` tokens (specials, bytes, then the most common
/// pieces): a SentencePiece vocabulary whose tokenizer builds in milliseconds (all 262k take over
/// a second). No tensors: only the tokenizer and the template see it.
fn sentencepiece_file(n: usize) -> Input {
    let g = common::Reference::Gemma3.gguf();
    let mut keys: Vec<_> = g.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).collect();
    keys.sort_by_key(|(k, _)| k.as_str());
    let mut w = GgufWriter::new(3);
    for (key, value) in keys {
        let first = match value {
            Value::List(Array::String(s)) => Value::List(Array::from(s.iter().take(n).collect::<Vec<_>>())),
            Value::List(Array::F32(v)) => Value::List(Array::F32(v[..n].to_vec())),
            Value::List(Array::I32(v)) => Value::List(Array::I32(v[..n].to_vec())),
            other => other.clone(),
        };
        w.metadata(key, first);
    }
    let bytes = w.to_bytes();
    Input { file_len: bytes.len() as u64, bytes }
}

/// How far one input got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Reached {
    ParseError,
    Parsed,
    Planned,
    TokenizerBuilt,
    Rendered,
}

/// What one execution did.
struct Outcome {
    reached: Reached,
    /// Parse, config, plan; then tokenizer and template, while the parsed header stays live.
    ours: meter::Usage,
    theirs: meter::Usage,
}

impl Outcome {
    fn peak(&self) -> usize {
        self.ours.peak.max(self.ours.live + self.theirs.peak)
    }
}

/// The load path on one input; the tokenizer stage is skipped when its metadata is `known`.
fn load(input: &Input, known: Option<&[(String, Value)]>) -> Outcome {
    let bytes = &input.bytes;
    let ((gguf, mut reached), ours) = meter::measure(Limits::CEILING, || {
        let Ok(gguf) = Gguf::parse_prefix(bytes, input.file_len) else { return (None, Reached::ParseError) };
        let _ = ModelInfo::new(&gguf, input.file_len, None);
        let _ = ModelInfo::new(&gguf, input.file_len, Some(usize::MAX));
        // A header prefix may not hold them.
        let rope_freqs = gguf
            .tensor(ROPE_FREQS)
            .and_then(|t| bytes.get(t.file_offset as usize..(t.file_offset + t.byte_size) as usize));
        let vocab = Plan::from_gguf(&gguf, rope_freqs).ok().map(|plan| plan.config.vocab_size);
        (Some((gguf, vocab)), if vocab.is_some() { Reached::Planned } else { Reached::Parsed })
    });
    let (rendered, theirs) = meter::measure(Limits::CEILING, || {
        let (gguf, vocab) = gguf.as_ref()?;
        if known.is_some_and(|keys| same_tokenizer(gguf, keys)) {
            return None;
        }
        let mut reached = None;
        if let Ok(tokenizer) = Tokenizer::from_gguf(gguf) {
            reached = Some(Reached::TokenizerBuilt);
            if let Some(vocab) = vocab {
                let _ = tokenizer.check_vocab(*vocab);
            }
            if let Ok(ids) = tokenizer.encode("Hello, world! 123 <|im_end|> héllo ✓ 🦀") {
                let _ = tokenizer.decode(&ids);
            }
        }
        if let Ok(Some(template)) = ChatTemplate::from_gguf(gguf) {
            let chat = [Message::new("user", "Hi there"), Message::new("assistant", "Hello! How can I help?")];
            if template.render(&chat, true).is_ok() {
                reached = Some(Reached::Rendered);
            }
        }
        reached
    });
    reached = reached.max(rendered.unwrap_or(reached));
    Outcome { reached, ours, theirs }
}

/// The message of the last panic inside `check` (which keeps those quiet).
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

thread_local! {
    static IN_CHECK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Panics inside `check` are kept, not printed; any other (a failing assertion) is reported as usual.
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_CHECK.with(|c| c.get()) {
                let location = info.location().map(|l| l.to_string()).unwrap_or_default();
                *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{info} at {location}"));
            } else {
                default(info);
            }
        }));
    });
}

/// Runs one input and checks it against `Limits`: None when it passes, else what was wrong.
fn check(input: &Input, known: Option<&[(String, Value)]>) -> (Option<String>, Option<Outcome>, Duration) {
    let start = common::thread_cpu_time();
    IN_CHECK.with(|c| c.set(true));
    let result = catch_unwind(AssertUnwindSafe(|| load(input, known)));
    IN_CHECK.with(|c| c.set(false));
    let elapsed = common::thread_cpu_time() - start;
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(_) => {
            let msg = LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
            return (Some(format!("panic: {msg}")), None, elapsed);
        }
    };
    let n = input.bytes.len();
    let problem = if outcome.ours.largest > n + Limits::OURS_SLACK {
        Some(format!("parse/config/plan allocated {} bytes at once for {n} input bytes", outcome.ours.largest))
    } else if outcome.theirs.largest > Limits::theirs_largest(n) {
        Some(format!("tokenizer/template allocated {} bytes at once for {n} input bytes", outcome.theirs.largest))
    } else if outcome.peak() > Limits::peak(n) {
        Some(format!("{} bytes live at once for {n} input bytes", outcome.peak()))
    } else if elapsed > Limits::TIME {
        Some(format!("took {elapsed:?}"))
    } else {
        None
    };
    (problem, Some(outcome), elapsed)
}

const INTERESTING: [u64; 30] = [
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    12,
    13,
    24,
    31,
    32,
    64,
    255,
    256,
    4096,
    65535,
    65536,
    1 << 20,
    10_000_000,
    1_000_000_000,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// A value to write over `field` of `bytes`: a boundary, a huge count, or a near neighbour.
fn interesting(rng: &mut Rng, field: &Field, bytes: &[u8], file_len: u64) -> u64 {
    let old = field.read(bytes);
    match rng.below(10) {
        0..=3 => INTERESTING[rng.below(INTERESTING.len())],
        4 => [file_len, file_len / 8, file_len / 13, file_len / 24, bytes.len() as u64][rng.below(5)],
        5 | 6 => old.wrapping_add([1, u64::MAX, 2, u64::MAX - 1][rng.below(4)]),
        7 => old.wrapping_mul([2, 10, 1000][rng.below(3)]),
        8 => old / 2,
        _ => rng.next(),
    }
}

fn mutate(rng: &mut Rng, seed: &Seed, seeds: &[Seed]) -> Input {
    // A renamed key or a new string value: the data after it moves, so it comes alone.
    if rng.chance(10) {
        if let Some(input) = replace_text(rng, seed) {
            return input;
        }
    }
    let mut input = seed.input.clone();
    let rounds = [1, 1, 1, 2, 2, 3, 4][rng.below(7)];
    // Half the inputs change only metadata values, so they parse and reach the model's checks.
    let values_only = rng.chance(50);
    for _ in 0..rounds {
        let bytes = &mut input.bytes;
        if bytes.is_empty() {
            break;
        }
        if values_only {
            if let Some(f) = rng.pick(&seed.values) {
                let v = match rng.pick(&seed.values).filter(|from| from.width == f.width && rng.chance(20)) {
                    Some(from) => from.read(bytes),
                    None => interesting(rng, f, bytes, input.file_len),
                };
                f.write(bytes, v);
            }
            continue;
        }
        let field = match rng.below(100) {
            0..=44 => rng.pick(&seed.values),
            45..=69 => rng.pick(&seed.structure),
            70..=96 => rng.pick(&seed.tensors),
            _ => rng.pick(&seed.array_strings),
        }
        .filter(|f| f.offset + f.width <= bytes.len());
        match rng.below(100) {
            // An integer over a field the walk found.
            0..=44 => {
                if let Some(f) = field {
                    let v = interesting(rng, f, bytes, input.file_len);
                    f.write(bytes, v);
                }
            }
            // One metadata value copied over another of the same width: consistent-looking lies.
            45..=54 => {
                if let (Some(to), Some(from)) = (field, rng.pick(&seed.values)) {
                    if to.width == from.width && from.offset + from.width <= bytes.len() {
                        let v = from.read(bytes);
                        to.write(bytes, v);
                    }
                }
            }
            // A bit flip, in a field or anywhere.
            55..=66 => {
                let at = match field.filter(|_| rng.chance(70)) {
                    Some(f) => f.offset + rng.below(f.width),
                    None => rng.below(bytes.len()),
                };
                bytes[at] ^= 1 << rng.below(8);
            }
            // A random 4- or 8-byte word anywhere.
            67..=72 => {
                let width = if rng.chance(50) { 4 } else { 8 };
                let at = rng.below(bytes.len().saturating_sub(width) + 1);
                let end = (at + width).min(bytes.len());
                let word = if rng.chance(50) { INTERESTING[rng.below(INTERESTING.len())] } else { rng.next() };
                bytes[at..end].copy_from_slice(&word.to_le_bytes()[..end - at]);
            }
            // Cut short, at a field or anywhere.
            73..=79 => {
                let at = match field {
                    Some(f) => f.offset + rng.below(f.width + 1),
                    None => rng.below(bytes.len()),
                };
                bytes.truncate(at.min(bytes.len()));
            }
            // A piece of any seed copied over or into this one.
            80..=88 => {
                let from = &seeds[rng.below(seeds.len())].input.bytes;
                let len = 1 + rng.below(256.min(from.len()));
                let src = rng.below(from.len() - len + 1);
                let piece = from[src..src + len].to_vec();
                let at = rng.below(bytes.len());
                if rng.chance(50) {
                    let end = (at + len).min(bytes.len());
                    bytes[at..end].copy_from_slice(&piece[..end - at]);
                } else {
                    bytes.splice(at..at, piece);
                }
            }
            // A piece taken out.
            89..=93 => {
                let at = rng.below(bytes.len());
                let end = (at + 1 + rng.below(64)).min(bytes.len());
                bytes.drain(at..end);
            }
            // Another file length: the bytes as the whole file, or a longer file.
            _ => {
                input.file_len = match rng.below(3) {
                    0 => bytes.len() as u64,
                    1 => bytes.len() as u64 + rng.below(1 << 20) as u64,
                    _ => (bytes.len() as u64).max(INTERESTING[rng.below(INTERESTING.len())]),
                };
            }
        }
        input.file_len = input.file_len.max(input.bytes.len() as u64);
    }
    input
}

fn pick_seed<'a>(rng: &mut Rng, seeds: &'a [Seed], total_weight: usize) -> &'a Seed {
    let mut pick = rng.below(total_weight);
    for seed in seeds {
        if pick < seed.weight {
            return seed;
        }
        pick -= seed.weight;
    }
    unreachable!("the pick is below the total weight")
}

/// The input being run, kept on disk so that an abort (an allocation past the ceiling, a stack
/// overflow) leaves it behind: its bytes, and the file length they begin (a number, as text).
struct Current {
    bytes: std::fs::File,
    file_len: std::fs::File,
}

impl Current {
    const PATH: &str = concat!(env!("CARGO_TARGET_TMPDIR"), "/fuzz-current.gguf");

    fn create() -> Self {
        let create = |path: &str| std::fs::File::create(path).unwrap();
        Self { bytes: create(Self::PATH), file_len: create(&format!("{}.file-len", Self::PATH)) }
    }

    /// Overwrites the files in place (creating a file per input is slower than running it).
    fn keep(&mut self, input: &Input) {
        use std::io::{Seek, SeekFrom, Write};
        let overwrite = |file: &mut std::fs::File, bytes: &[u8]| {
            file.seek(SeekFrom::Start(0)).and_then(|_| file.write_all(bytes)).unwrap();
            file.set_len(bytes.len() as u64).unwrap();
        };
        overwrite(&mut self.bytes, &input.bytes);
        overwrite(&mut self.file_len, input.file_len.to_string().as_bytes());
    }
}

fn save(dir: &Path, name: &str, input: &Input) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let of = if input.file_len == input.bytes.len() as u64 { String::new() } else { format!(".of-{}", input.file_len) };
    let path = dir.join(format!("{name}{of}.gguf"));
    std::fs::write(&path, &input.bytes).unwrap();
    path
}

#[test]
fn the_load_path_survives_mutated_model_headers() {
    let execs: u64 = env_or("FUZZ_EXECS", 100_000);
    let seconds: u64 = env_or("FUZZ_SECONDS", 40);
    let mut rng = Rng(env_or("FUZZ_SEED", 1));
    let seeds = seeds();
    let total_weight: usize = seeds.iter().map(|s| s.weight).sum();
    install_panic_hook();

    // The seeds themselves load all the way (a harness that never gets past the parser tests nothing).
    for seed in &seeds {
        let (problem, outcome, _) = check(&seed.input, None);
        assert_eq!(problem, None, "seed {}", seed.name);
        eprintln!("seed {}: {} bytes, reaches {:?}", seed.name, seed.input.bytes.len(), outcome.unwrap().reached);
    }

    let findings_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-findings");
    let mut findings = Vec::new();
    let mut reached: BTreeMap<Reached, u64> = BTreeMap::new();
    // How close the inputs came to each limit (1.0: at it).
    let (mut ours_worst, mut theirs_worst, mut peak_worst, mut slowest) = (0f64, 0f64, 0f64, Duration::ZERO);
    let mut current = Current::create();
    let start = Instant::now();
    let mut done = 0;
    while done < execs && start.elapsed() < Duration::from_secs(seconds) {
        let seed = pick_seed(&mut rng, &seeds, total_weight);
        let input = mutate(&mut rng, seed, &seeds);
        current.keep(&input);
        let known = Some(&seed.tokenizer_keys[..]);
        let (mut problem, outcome, mut elapsed) = check(&input, known);
        if problem.as_deref().is_some_and(|p| p.starts_with("took")) {
            // A slow run is run again: the machine may have been busy.
            (problem, _, elapsed) = check(&input, known);
        }
        if let Some(outcome) = outcome {
            *reached.entry(outcome.reached).or_default() += 1;
            let n = input.bytes.len();
            ours_worst = ours_worst.max(outcome.ours.largest as f64 / (n + Limits::OURS_SLACK) as f64);
            theirs_worst = theirs_worst.max(outcome.theirs.largest as f64 / Limits::theirs_largest(n) as f64);
            peak_worst = peak_worst.max(outcome.peak() as f64 / Limits::peak(n) as f64);
        }
        slowest = slowest.max(elapsed);
        if let Some(problem) = problem {
            let path = save(&findings_dir, &format!("{}-{done}", seed.name.replace(' ', "-")), &input);
            eprintln!("FINDING at execution {done} (seed {}): {problem}\n  input: {}", seed.name, path.display());
            findings.push(problem);
        }
        done += 1;
        if done % 100_000 == 0 {
            eprintln!("{done} executions, {:.0}/s", done as f64 / start.elapsed().as_secs_f64());
        }
    }
    let rate = done as f64 / start.elapsed().as_secs_f64();
    eprintln!(
        "fuzz: {done} executions in {:.1} s ({rate:.0}/s), {} findings; reached {reached:?}; closest to the \
         limits: largest allocation {ours_worst:.2} (parse, config, plan) and {theirs_worst:.2} (tokenizer, \
         template), peak {peak_worst:.2}, slowest {slowest:?}",
        start.elapsed().as_secs_f64(),
        findings.len()
    );
    assert!(findings.is_empty(), "{} findings (inputs in {}): {findings:#?}", findings.len(), findings_dir.display());
    // Mutated inputs still get past the parser and through the tokenizer and the template.
    assert!(reached.get(&Reached::Planned).is_some_and(|&n| n * 100 > done), "{reached:?}");
    assert!(reached.get(&Reached::Rendered).is_some_and(|&n| n * 1000 > done), "{reached:?}");
}

#[test]
fn every_saved_fuzz_input_loads_to_a_result_or_an_error() {
    install_panic_hook();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension() == Some("gguf".as_ref()))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "regression inputs in {}", dir.display());
    for path in files {
        let bytes = std::fs::read(&path).unwrap();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let file_len = name.rsplit_once(".of-").map_or(bytes.len() as u64, |(_, len)| len.parse().unwrap());
        let (problem, _, _) = check(&Input { bytes, file_len }, None);
        assert_eq!(problem, None, "{}", path.display());
    }
}
