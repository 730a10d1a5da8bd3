//! The traffic ledger (what each decode dispatch declares it moves) against hand counts, on small
//! models made here with the crate's GGUF writer in the default model's types (Q4_1 matrices, a
//! tied Q8_0 embedding, F32 norms) and in types whose rows the GPU pads; and the synthetic
//! large-model source `bench --synthetic` runs: its real shapes (read only), and a small shape of
//! it run on the GPU, its logits against the CPU reference on the same bytes.

use crate::common::tiny::Xorshift;
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
use webgpu_llm::gguf::{Array, ByteSource, GgmlType, Gguf, GgufWriter, Value};
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, KernelStyle, KvStore, Readback};
use webgpu_llm::model::{CpuModel, Logits, ModelConfig};
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::synthetic::{Shape, SyntheticSource, LLAMA_3_2_1B, LLAMA_3_8B};
use webgpu_llm::tokenizer::Tokenizer;

/// A llama-architecture model for hand counts: every matrix of `matrices`' type, the embedding
/// (tied to the output) of `embedding`'s, F32 norms.
#[derive(Clone, Copy)]
struct Small {
    layers: u64,
    d: u64,
    heads: u64,
    kv_heads: u64,
    ffn: u64,
    vocab: u64,
    matrices: GgmlType,
    embedding: GgmlType,
}

impl Small {
    fn head_dim(&self) -> u64 {
        self.d / self.heads
    }
    fn kv_dim(&self) -> u64 {
        self.head_dim() * self.kv_heads
    }
}

/// (values, bytes) of one block of a type written here.
fn block(ty: GgmlType) -> (u64, u64) {
    match ty {
        GgmlType::Q4_0 => (32, 18),
        GgmlType::Q4_1 => (32, 20),
        GgmlType::Q8_0 => (32, 34),
        other => panic!("no blocks of {other:?} here"),
    }
}

/// Bytes of a row of `cols` values in the file.
fn file_row(ty: GgmlType, cols: u64) -> u64 {
    let (values, bytes) = block(ty);
    cols / values * bytes
}

/// Bytes of a row of `cols` values on the GPU, by the layout's rule (src/quant): Q4_1's 20-byte
/// blocks are whole words and go up as they are; Q4_0 and Q8_0 rows go up as their blocks' f16
/// scales (padded to a whole 16-byte vector) then the blocks without them.
fn gpu_row(ty: GgmlType, cols: u64) -> u64 {
    let (values, bytes) = block(ty);
    let blocks = cols / values;
    match ty {
        GgmlType::Q4_1 => blocks * bytes,
        _ => (blocks * 2).next_multiple_of(16) + blocks * (bytes - 2),
    }
}

/// `n` values of random blocks of `ty` with small scales (activations stay finite).
fn blocks(rng: &mut Xorshift, ty: GgmlType, n: u64) -> Vec<u8> {
    let (values, bytes) = block(ty);
    let mut out = Vec::with_capacity((n / values * bytes) as usize);
    for _ in 0..n / values {
        let scale = 0.002 + 0.004 * (rng.next() % 1000) as f32 / 1000.0;
        out.extend_from_slice(&half::f16::from_f32(scale).to_le_bytes());
        if ty == GgmlType::Q4_1 {
            out.extend_from_slice(&half::f16::from_f32(-8.0 * scale).to_le_bytes());
        }
        out.extend((2..bytes - 2 * (ty == GgmlType::Q4_1) as u64).map(|_| rng.next() as u8));
    }
    out
}

fn small_model(s: &Small) -> Vec<u8> {
    let mut w = GgufWriter::new(3);
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("general.name", Value::String("ledger test model".into()))
        .metadata("llama.block_count", Value::U32(s.layers as u32))
        .metadata("llama.context_length", Value::U32(2048))
        .metadata("llama.embedding_length", Value::U32(s.d as u32))
        .metadata("llama.feed_forward_length", Value::U32(s.ffn as u32))
        .metadata("llama.attention.head_count", Value::U32(s.heads as u32))
        .metadata("llama.attention.head_count_kv", Value::U32(s.kv_heads as u32))
        .metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    let tokens: Vec<String> = (0..s.vocab).map(|i| format!("<t{i}>")).collect();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.tokens", Value::List(Array::from(tokens)))
        .metadata("tokenizer.ggml.merges", Value::List(Array::from(Vec::<String>::new())));
    let mut rng = Xorshift(0x2545_f491_4f6c_dd1d);
    let (d, kv) = (s.d, s.kv_dim());
    w.tensor("token_embd.weight", &[d, s.vocab], s.embedding, blocks(&mut rng, s.embedding, d * s.vocab));
    let ones = |n: u64| (0..n).flat_map(|_| 1f32.to_le_bytes()).collect::<Vec<u8>>();
    w.tensor("output_norm.weight", &[d], GgmlType::F32, ones(d));
    for i in 0..s.layers {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        w.tensor(&b("attn_norm"), &[d], GgmlType::F32, ones(d));
        w.tensor(&b("ffn_norm"), &[d], GgmlType::F32, ones(d));
        for (name, dims) in [
            ("attn_q", [d, d]),
            ("attn_k", [d, kv]),
            ("attn_v", [d, kv]),
            ("attn_output", [d, d]),
            ("ffn_gate", [d, s.ffn]),
            ("ffn_up", [d, s.ffn]),
            ("ffn_down", [s.ffn, d]),
        ] {
            w.tensor(&b(name), &dims, s.matrices, blocks(&mut rng, s.matrices, dims[0] * dims[1]));
        }
    }
    w.to_bytes()
}

/// The model uploaded with `options`.
fn gpu_model(bytes: &[u8], options: GpuOptions, context: usize) -> GpuModel {
    let gpu = pollster::block_on(Gpu::new(options)).expect("a GPU adapter (lavapipe in CI)");
    let gguf = Gguf::parse(bytes).unwrap();
    pollster::block_on(GpuModel::load(gpu, &gguf, bytes, context, &mut |_, _| {})).unwrap()
}

/// The model read from `source`, on a GPU whose storage bindings are taken to hold at most
/// `max_binding` bytes (larger matrices are split by rows into parts), when given.
fn gpu_model_from(
    source: &(impl ByteSource + ?Sized),
    gguf: &Gguf,
    options: GpuOptions,
    max_binding: Option<u64>,
) -> GpuModel {
    let mut gpu = pollster::block_on(Gpu::new(options)).expect("a GPU adapter (lavapipe in CI)");
    if let Some(max) = max_binding {
        gpu.limits.max_storage_buffer_binding_size = max;
    }
    pollster::block_on(GpuModel::load(gpu, gguf, source, 64, &mut |_, _| {})).unwrap()
}

/// The logits after `prompt`.
fn logits(model: &mut GpuModel, prompt: &[u32]) -> Vec<f32> {
    let mut out = vec![0f32; model.config.vocab_size];
    pollster::block_on(model.step(prompt, 0, Readback::Logits(&mut out))).unwrap();
    out
}

/// The adapter's own path, the forced f32 path (an f32 KV cache) and the GPU-style kernels
/// (norms fused into the matrix products; lavapipe's own are the CPU-style ones).
const PATHS: [GpuOptions; 3] =
    [ADAPTER, GpuOptions { force_f32: true, ..ADAPTER }, GpuOptions { kernels: Some(KernelStyle::Gpu), ..ADAPTER }];

/// The adapter's own options (`GpuOptions::default`, which is no const fn).
const ADAPTER: GpuOptions = GpuOptions {
    force_f32: false,
    packed_kv: false,
    request_deadline_ms: None,
    max_batch: None,
    pass_rows: None,
    kv_tokens: None,
    kernels: None,
    coop: None,
};

/// Bytes of one key or value element in the cache, by its storage.
fn kv_element_bytes(kv: KvStore) -> u64 {
    match kv {
        KvStore::F32 => 4,
        KvStore::F16 | KvStore::PackedF16 => 2,
    }
}

/// The default model's types (SmolLM2-135M: Q4_1 matrices, a tied Q8_0 embedding, 61 F32 norm
/// vectors), at 3 layers of 192 (3 heads of 64 over 1 KV head, SmolLM2's 3:1): the GPU reads
/// each matrix's file bytes, the whole table for the lm_head (its rows as the GPU holds them),
/// one row for the lookup, each norm once; the keys attended and the new token's key and value;
/// attention records per 64 keys.
#[test]
fn the_decode_ledger_of_a_model_in_the_default_models_types_matches_a_hand_count() {
    let s = Small {
        layers: 3,
        d: 192,
        heads: 3,
        kv_heads: 1,
        ffn: 512,
        vocab: 1000,
        matrices: GgmlType::Q4_1,
        embedding: GgmlType::Q8_0,
    };
    let bytes = small_model(&s);
    let g = Gguf::parse(&bytes).unwrap();
    let bytes_of = |ty: GgmlType| -> u64 { g.tensors.iter().filter(|t| t.ty == ty).map(|t| t.byte_size).sum() };
    let (q4_1, q8_0, f32s) = (bytes_of(GgmlType::Q4_1), bytes_of(GgmlType::Q8_0), bytes_of(GgmlType::F32));
    // Per layer q, k, v, o (192 x 192, 2 of 192 x 64, 192 x 192), gate, up, down (3 of 192 x
    // 512), in 20-byte blocks of 32 values.
    let per_layer = (192 * 192 * 2 + 192 * 64 * 2 + 192 * 512 * 3) / 32 * 20;
    assert_eq!((q4_1, q8_0, f32s), (3 * per_layer, 1000 * 6 * 34, (2 * 3 + 1) * 192 * 4));
    // A Q8_0 row of 6 blocks on the GPU is its 6 scales (12 bytes, padded to a 16-byte vector)
    // then the 6 blocks' quants: 208 bytes, the file's 204 and 4 of padding.
    assert_eq!(gpu_row(GgmlType::Q8_0, 192), 208);
    let weights = q4_1 + 1000 * 208 + 208 + f32s;
    for options in PATHS {
        let m = gpu_model(&bytes, options, 1024);
        eprintln!("{options:?}: {:?}, KV {:?}", m.gpu.style, m.gpu.kv);
        let kv_row = 2 * 3 * 64 * kv_element_bytes(m.gpu.kv);
        // A step's dispatches: the lookup; a layer's q|k|v with RoPE and the cache write in its
        // epilogue, attention's two passes, o, gate|up (one pair), down, with the norms in the
        // products (on GPUs fused into the products that read them; on CPU adapters o and down
        // feed the norms after them, and only the first layer's attention norm is a pass of its
        // own); the LM head with the argmax's first pass, the argmax's second. On CPU adapters
        // attention is one dispatch while a KV head's 3 query heads' splits (a 64-key tile each)
        // fit one workgroup of 64: 21 tiles, 1344 keys.
        let steps = |seq: usize| match m.gpu.style {
            KernelStyle::Cpu if seq <= 21 * 64 => 1 + 1 + 3 * 5 + 2,
            KernelStyle::Cpu => 1 + 1 + 3 * 6 + 2,
            KernelStyle::Gpu => 1 + 3 * 6 + 2,
        };
        for seq in [1, 1000] {
            assert_eq!(m.decode_dispatches(seq), steps(seq), "{:?} at {seq} keys", m.gpu.style);
        }
        for seq in [1, 64, 65, 1000] {
            let ledger = m.decode_traffic(seq);
            assert_eq!(ledger.weights, weights, "at {seq} keys");
            assert_eq!(ledger.kv_read, kv_row * seq as u64, "at {seq} keys");
            assert_eq!(ledger.kv_written, kv_row, "at {seq} keys");
            let least = m.min_decode_traffic(seq);
            assert_eq!(least.weights, q4_1 + q8_0 + f32s);
            assert_eq!(least.kv_read, ledger.kv_read);
            // The bound: weight bytes read per token within 2% of the file's.
            assert!(ledger.weights as f64 / least.weights as f64 <= 1.02);
            assert!(ledger.activations >= least.activations, "at {seq} keys: fewer activation bytes than the least");
        }
        // Attention's records: one per head per 64-key chunk attended (the head's 64 values, its
        // max and its sum), written then read.
        let records = |seq| m.decode_traffic(seq).activations;
        assert_eq!(records(65) - records(64), 3 * 2 * 3 * (64 + 2) * 4);
        assert_eq!(records(129) - records(128), 3 * 2 * 3 * (64 + 2) * 4);
        assert_eq!(records(64), records(1));
        assert_eq!(records(128), records(65));
        // At long context a split takes several tiles on GPUs: the records stop at 64 a head
        // (src/gpu/kernels/attention.rs), while the keys read grow on. On CPU adapters a split
        // is a tile at any length: 512 records a head at 32768 keys. Either way the step's
        // bytes are linear in the context.
        let long = gpu_model(&bytes, options, 32768);
        for seq in [1344, 1345, 32768] {
            assert_eq!(long.decode_dispatches(seq), steps(seq), "{:?} at {seq} keys", long.gpu.style);
        }
        let splits = if long.gpu.style == KernelStyle::Gpu { 64 } else { 512 };
        let records = |seq| long.decode_traffic(seq).activations;
        let per_split = 3 * 2 * 3 * (64 + 2) * 4;
        assert_eq!(records(32768) - records(1), (splits - 1) * per_split);
        assert_eq!(records(64 * splits as usize), records(32768));
        assert_eq!(records(64 * splits as usize) - records(64 * splits as usize - 64), per_split);
        if long.gpu.style == KernelStyle::Gpu {
            assert_eq!(records(16384), records(32768));
        } else {
            assert_eq!(records(32768) - records(16384), 256 * per_split);
        }
        let kv_read = |seq| long.decode_traffic(seq).kv_read;
        assert_eq!(kv_read(32768), 2 * kv_read(16384));
    }
}

/// Rows of Q4_0 or Q8_0 blocks whose scales do not fill whole 16-byte vectors: on the GPU they
/// are padded to one (so that the blocks after them can be read as vectors), up to 14 bytes a
/// row more than the file, and the ledger counts the bytes the GPU reads.
#[test]
fn the_decode_ledger_counts_the_padded_rows_the_gpu_reads() {
    let s = Small {
        layers: 2,
        d: 160,
        heads: 5,
        kv_heads: 1,
        ffn: 320,
        vocab: 700,
        matrices: GgmlType::Q4_0,
        embedding: GgmlType::Q8_0,
    };
    let bytes = small_model(&s);
    let g = Gguf::parse(&bytes).unwrap();
    // 5 blocks a row of 160 values: 10 bytes of scales padded to 16, then the quants.
    assert_eq!((gpu_row(GgmlType::Q4_0, 160), file_row(GgmlType::Q4_0, 160)), (96, 90));
    assert_eq!((gpu_row(GgmlType::Q8_0, 160), file_row(GgmlType::Q8_0, 160)), (176, 170));
    // 10 blocks a row of 320 values (ffn_down): 20 bytes of scales padded to 32.
    assert_eq!((gpu_row(GgmlType::Q4_0, 320), file_row(GgmlType::Q4_0, 320)), (192, 180));
    // Rows of 160 values: q, k, v, o, gate, up (160 + 32 + 32 + 160 + 320 + 320 per layer); rows
    // of 320: down (160 per layer).
    let matrices = 2 * ((160 + 32 + 32 + 160 + 320 + 320) * 96 + 160 * 192);
    let head = 700 * 176;
    let f32s = (2 * 2 + 1) * 160 * 4;
    let file: u64 = g.tensors.iter().map(|t| t.byte_size).sum();
    assert_eq!(file, 2 * ((160 + 32 + 32 + 160 + 320 + 320) * 90 + 160 * 180) + 700 * 170 + f32s);
    for options in PATHS {
        let m = gpu_model(&bytes, options, 256);
        let kv_row = 2 * 2 * 32 * kv_element_bytes(m.gpu.kv);
        for seq in [1, 100] {
            let ledger = m.decode_traffic(seq);
            assert_eq!(ledger.weights, matrices + head + 176 + f32s, "{options:?} at {seq} keys");
            assert_eq!((ledger.kv_read, ledger.kv_written), (kv_row * seq as u64, kv_row));
            assert_eq!(m.min_decode_traffic(seq).weights, file);
        }
    }
}

/// A matrix larger than one storage binding is split by rows into parts (the 1B's 147 MB Q4_0
/// lm_head is on lavapipe's 128 MiB bindings, Gemma's 168 MB one everywhere): here bindings of
/// 700 KB, which the activation buffers still fit (32 rows of 5000 logits, 256 prefill rows of
/// 640 q|k|v values: a pass's 512 rows halved to fit), split the tied Q8_0 head (5000 rows of
/// 416 bytes) in three; the logits are the unsplit upload's and the CPU reference's.
#[test]
fn a_head_split_over_storage_bindings_gives_the_same_logits() {
    let s = Small {
        layers: 2,
        d: 384,
        heads: 6,
        kv_heads: 2,
        ffn: 128,
        vocab: 5000,
        matrices: GgmlType::Q4_1,
        embedding: GgmlType::Q8_0,
    };
    assert_eq!(gpu_row(GgmlType::Q8_0, 384), 416);
    let bytes = small_model(&s);
    let gguf = Gguf::parse(&bytes).unwrap();
    let prompt = [1, 500, 4999, 7, 3000, 42];
    let cpu = CpuModel::load(&gguf, &bytes).unwrap();
    let want = cpu.forward(&mut cpu.new_cache(), &prompt, Logits::Last).unwrap();
    let largest = want.iter().fold(0f32, |a, &l| a.max(l.abs()));
    assert!(largest > 1e-2, "the weights do something: {largest}");
    let options = GpuOptions { force_f32: true, ..Default::default() };
    let (mut whole_model, mut split_model) =
        (gpu_model_from(&bytes[..], &gguf, options, None), gpu_model_from(&bytes[..], &gguf, options, Some(700_000)));
    // Each part is a buffer of its own: 2 more for the head.
    let buffers = |m: &GpuModel| m.gpu.counters().buffers;
    assert_eq!(buffers(&split_model), buffers(&whole_model) + 2);
    // q|k|v's 640 floats a row: 512 rows are 1.31 MB, over the binding; 256 are 655 KB.
    assert!(whole_model.pass_rows() >= 512);
    assert_eq!(split_model.pass_rows(), 256);
    let (whole, split) = (logits(&mut whole_model, &prompt), logits(&mut split_model, &prompt));
    assert_eq!(split, whole);
    let diff = whole.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("largest logit difference from the CPU reference {diff:e} (largest logit {largest})");
    assert!(diff <= 1e-4 * largest.max(1.0), "logits differ by {diff}");
}

#[test]
fn synthetic_models_have_the_real_shapes_and_read_the_same_in_any_pieces() {
    for (shape, params) in [(LLAMA_3_2_1B, 1.236e9), (LLAMA_3_8B, 8.03e9)] {
        let source = SyntheticSource::new(shape);
        let gguf = pollster::block_on(Gguf::read(&source)).unwrap();
        let c = ModelConfig::from_gguf(&gguf).unwrap();
        assert_eq!(
            (c.n_layers, c.d_model, c.ffn_dim, c.n_heads, c.n_kv_heads, c.vocab_size),
            (shape.layers as usize, shape.d_model as usize, shape.ffn as usize, 32, 8, 128256)
        );
        let n: u64 = gguf.tensors.iter().map(|t| t.n_elements()).sum();
        assert!((n as f64 / params - 1.0).abs() < 0.01, "{} parameters", n);
        let last = gguf.tensors.iter().map(|t| t.file_offset + t.byte_size).max().unwrap();
        assert_eq!(last, source.len());
        // Any span reads the same whole or in odd pieces (header, padding, norms, blocks).
        let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
        assert_eq!(tokenizer.decode(&tokenizer.encode("Hello, wörld!").unwrap()).unwrap(), "Hello, wörld!");
        let norm = gguf.tensor("blk.0.attn_norm.weight").unwrap();
        let start = norm.file_offset - 100;
        let whole = pollster::block_on(source.read(start, 20_000)).unwrap();
        let mut pieces = Vec::new();
        for (at, len) in [(0, 7), (7, 93), (100, 1), (101, 4095), (4196, 15_804)] {
            pieces.extend(pollster::block_on(source.read(start + at, len)).unwrap());
        }
        assert_eq!(whole, pieces);
        let ones = &whole[100..100 + norm.byte_size as usize];
        assert!(ones.chunks_exact(4).all(|b| f32::from_le_bytes(b.try_into().unwrap()) == 1.0));
        let q = gguf.tensor("blk.0.attn_q.weight").unwrap();
        let block = pollster::block_on(source.read(q.file_offset + 18 * 1000, 18)).unwrap();
        let scale = half::f16::from_le_bytes([block[0], block[1]]).to_f32().abs();
        assert!((0.0009..0.0031).contains(&scale), "block scale {scale}");
    }
}

/// The synthetic source (what `bench --synthetic` runs) in a small shape of Llama 3.2 1B's kind:
/// Q4_0, tied, GQA 4:1, the byte-level tokenizer padded with reserved tokens to the vocabulary.
const SMALL_1B: Shape = Shape {
    name: "small",
    layers: 2,
    d_model: 256,
    ffn: 512,
    heads: 4,
    kv_heads: 1,
    vocab: 8192,
    context: 2048,
    tied: true,
};

/// The small synthetic model generates on the GPU through the engine; its logits are finite and
/// the CPU reference's on the same bytes, also with the lm_head split over three storage
/// bindings (as the 1B's 147 MB Q4_0 table is on lavapipe's 128 MiB ones); a token reads the
/// file's Q4_0 bytes (rows of whole words), each norm once and one embedding row.
#[test]
fn a_small_synthetic_model_runs_on_the_gpu_with_the_cpu_references_logits() {
    let source = SyntheticSource::new(SMALL_1B);
    let mut file = Vec::new();
    source.write_to(&mut file).unwrap();
    assert_eq!(file.len() as u64, source.len());
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(64), gpu: GpuOptions::default() };
    let mut engine = pollster::block_on(Engine::load_from(&source, opts, &mut |_, _| {})).expect("a GPU adapter");
    let options =
        GenerateOptions { max_tokens: 2, sampling: SamplingParams::greedy(), ignore_eos: true, ..Default::default() };
    let mut ids = Vec::new();
    let stats = pollster::block_on(engine.generate(&Prompt::Text("Hello".into()), &options, &mut |ev| {
        ids.push(ev.id);
        true
    }))
    .unwrap();
    assert_eq!(ids.len(), 2);
    assert!(ids.iter().all(|&id| id < 8192));
    assert_eq!(stats.generated_tokens, 2);
    let m = engine.gpu_model().unwrap();
    let (ledger, least) = (m.decode_traffic(64), m.min_decode_traffic(64));
    let gguf = Gguf::parse(&file).unwrap();
    let q4_0: u64 = gguf.tensors.iter().filter(|t| t.ty == GgmlType::Q4_0).map(|t| t.byte_size).sum();
    let f32s: u64 = gguf.tensors.iter().filter(|t| t.ty == GgmlType::F32).map(|t| t.byte_size).sum();
    assert_eq!(gpu_row(GgmlType::Q4_0, 256), file_row(GgmlType::Q4_0, 256));
    assert_eq!(ledger.weights, q4_0 + f32s + file_row(GgmlType::Q4_0, 256));
    assert_eq!(least.weights, q4_0 + f32s);
    let ratio = ledger.weights as f64 / least.weights as f64;
    assert!((0.999..1.001).contains(&ratio), "weights read {} vs the file's {}", ledger.weights, least.weights);

    // The prompt's logits: the GPU's those of the CPU reference on the same bytes.
    let prompt = engine.prompt_tokens(&Prompt::Text("Hello".into()), None).unwrap();
    let cpu = CpuModel::load(&gguf, &file).unwrap();
    let want = cpu.forward(&mut cpu.new_cache(), &prompt, Logits::Last).unwrap();
    let largest = want.iter().fold(0f32, |a, &l| a.max(l.abs()));
    assert!(want.iter().all(|l| l.is_finite()) && largest > 1e-3, "the weights do something: {largest}");
    let mut model = gpu_model_from(&source, &gguf, GpuOptions::default(), None);
    let got = logits(&mut model, &prompt);
    let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("largest logit difference {diff:e} (largest logit {largest})");
    assert!(got.iter().all(|l| l.is_finite()));
    // The f16 path's bound of the golden tests (5e-2 on logits of about 10).
    assert!(diff <= 5e-3 * largest, "logits differ by {diff} (largest {largest})");
}

/// The decode gemv's SPIR-V instructions per weight byte (`gpu::spirv`, `bench --json`'s
/// `gemv_instructions_per_weight_byte` and `gemv_int8_instructions_per_weight_byte`), pinned for
/// each block type and both kernels: a kernel change that moves them updates these tables
/// (issue 26's goal for Q4_0: at most 6; 17.33 before the int8 kernel).
#[test]
fn the_decode_gemvs_spirv_instructions_per_weight_byte_are_pinned() {
    use webgpu_llm::gpu::spirv::gemv_instructions_per_weight_byte;
    for (int8, pinned) in [(false, &PINNED[..]), (true, &PINNED_INT8[..])] {
        let mut got = Vec::new();
        for f in webgpu_llm::quant::FORMATS.iter().filter(|f| !int8 || f.int8_fn().is_some()) {
            let n = gemv_instructions_per_weight_byte(f, int8).unwrap_or_else(|e| panic!("{}: {e}", f.ty.name()));
            got.push(format!("{} {:.2}", f.ty.name(), n));
        }
        println!("int8 {int8}: {}", got.join(", "));
        let pinned: Vec<String> = pinned.iter().map(|(t, n)| format!("{t} {n:.2}")).collect();
        assert_eq!(got, pinned, "int8 {int8}");
    }
}

/// Two int8 slices of the activations (exact to the golden bounds; one slice, llama.cpp's q8_1,
/// was Q4_0 5.61, Q4_1 4.75, Q5_0 5.55, Q5_1 4.83, Q8_0 3.24, and moved SmolLM2's logits by 0.9;
/// two were Q4_0 6.89 before the bodies were read as vec4s after a padded head, each weight
/// vector taken from its block once and the scales applied by fma).
const PINNED_INT8: [(&str, f64); 5] = [("Q4_0", 5.67), ("Q4_1", 5.40), ("Q5_0", 6.00), ("Q5_1", 5.38), ("Q8_0", 3.00)];

const PINNED: [(&str, f64); 16] = [
    ("F32", 1.78),
    ("F16", 2.94),
    ("BF16", 3.94),
    ("Q4_0", 16.67),
    ("Q4_1", 15.40),
    ("Q5_0", 18.55),
    ("Q5_1", 17.33),
    ("Q8_0", 8.12),
    ("IQ4_NL", 20.00),
    ("MXFP4", 23.53),
    ("Q2_K", 35.05),
    ("Q3_K", 44.51),
    ("Q4_K", 34.22),
    ("Q5_K", 34.00),
    ("Q6_K", 19.81),
    ("IQ4_XS", 27.06),
];
