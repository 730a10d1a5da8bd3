//! Loading reads the file in ranges: the header from a prefix that grows only as far as the
//! header needs, then each tensor once, in pieces of at most 8 MiB straight into GPU buffers —
//! host memory holds one piece, never the file (so a model larger than memory or wasm32's 4 GiB can load).
//! The models: the synthetic source `bench --synthetic` runs, in shapes with a Gemma-sized
//! vocabulary (262144 tokens: a header of 11.7 MB and a 9.4 MB embedding, two pieces) and a
//! SmolLM2-sized one (49152: 2.1 MB), and the committed tiny models llama.cpp's converter wrote.

use crate::common;

use std::cell::Cell;
use webgpu_llm::gguf::{ByteSource, Gguf, GgufError, SplitSource};
use webgpu_llm::gpu::weights::PIECE_BYTES;
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, Readback};
use webgpu_llm::model::{CpuModel, Logits};
use webgpu_llm::synthetic::{Shape, SyntheticSource};

/// A source that counts what is read of it.
struct Counting<S> {
    inner: S,
    largest: Cell<u64>,
    total: Cell<u64>,
}

impl<S: ByteSource> Counting<S> {
    fn new(inner: S) -> Self {
        Self { inner, largest: Cell::new(0), total: Cell::new(0) }
    }
}

impl<S: ByteSource> ByteSource for Counting<S> {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        self.largest.set(self.largest.get().max(len));
        self.total.set(self.total.get() + len);
        self.inner.read(offset, len).await
    }
}

/// Gemma 3's vocabulary size (262144 tokens, tied): a header of 11.7 MB, and at 64 values a row
/// in Q4_0 an embedding of 9.4 MB, more than one piece.
const GEMMA_VOCABULARY: Shape = Shape {
    name: "gemma-sized vocabulary",
    layers: 1,
    d_model: 64,
    ffn: 128,
    heads: 2,
    kv_heads: 1,
    vocab: 262144,
    context: 2048,
    tied: true,
};

/// SmolLM2's vocabulary size and width (49152 tokens of 576 values, tied): a header of 2.1 MB
/// (past the first read of 1 MiB) in a file of 18 MB.
const SMOLLM2_VOCABULARY: Shape = Shape {
    name: "smollm2-sized vocabulary",
    d_model: 576,
    heads: 9,
    kv_heads: 3,
    ffn: 1536,
    vocab: 49152,
    ..GEMMA_VOCABULARY
};

fn file_of(shape: Shape) -> Vec<u8> {
    let mut file = Vec::new();
    SyntheticSource::new(shape).write_to(&mut file).unwrap();
    file
}

fn arch_models() -> Vec<(&'static str, Vec<u8>)> {
    ["llama3", "mistral", "phi3", "qwen2", "qwen3"]
        .into_iter()
        .map(|name| {
            let path = format!("{}/tests/data/arch/{name}/model.gguf", env!("CARGO_MANIFEST_DIR"));
            (name, std::fs::read(path).unwrap())
        })
        .collect()
}

#[test]
fn the_header_read_in_growing_prefixes_equals_the_whole_file_parse() {
    for shape in [SMOLLM2_VOCABULARY, GEMMA_VOCABULARY] {
        let file = file_of(shape);
        let source = Counting::new(&file[..]);
        let streamed = pollster::block_on(Gguf::read(&source)).unwrap();
        let whole = Gguf::parse(&file).unwrap();
        assert_eq!(streamed.tensors, whole.tensors);
        assert_eq!(streamed.metadata, whole.metadata);
        // A header of several MB: a few doubling reads of prefixes, never the whole file.
        let (largest, total) = (source.largest.get(), source.total.get());
        eprintln!("{}: header {} bytes, read {total} (at most {largest} at once)", shape.name, streamed.data_offset);
        assert!(streamed.data_offset > 1 << 20, "{}: a header past the first read", shape.name);
        assert!(streamed.data_offset <= largest && largest <= 2 * streamed.data_offset);
        assert!(total <= 4 * streamed.data_offset, "read {total} bytes for the header");
        assert!(largest < file.len() as u64);
    }
    // The converter's own files (merges, arrays of every type): headers within the first read.
    for (name, file) in arch_models() {
        let source = Counting::new(&file[..]);
        let streamed = pollster::block_on(Gguf::read(&source)).unwrap();
        let whole = Gguf::parse(&file).unwrap();
        assert_eq!(streamed.tensors, whole.tensors, "{name}");
        assert_eq!(streamed.metadata, whole.metadata, "{name}");
        assert_eq!(source.total.get(), (1 << 20).min(file.len() as u64), "{name}: one read");
    }
}

#[test]
fn a_header_cut_short_is_still_a_truncation_error() {
    let file = file_of(GEMMA_VOCABULARY);
    let data_offset = Gguf::parse(&file).unwrap().data_offset as usize;
    // Cut within the token strings: a string runs past the end of the file.
    let err = pollster::block_on(Gguf::read(&Counting::new(&file[..3_000_000]))).unwrap_err();
    assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
    // Cut within the token types (the header's last 1 MB): the array holds more than is left.
    let err = pollster::block_on(Gguf::read(&Counting::new(&file[..data_offset - 100_000]))).unwrap_err();
    assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
    // Cut within the tensor data: the header parses, and a tensor reaches past the end.
    let err = pollster::block_on(Gguf::read(&Counting::new(&file[..data_offset + 1000]))).unwrap_err();
    assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "{err}");
    for (name, file) in arch_models() {
        let err = pollster::block_on(Gguf::read(&Counting::new(&file[..file.len() / 2]))).unwrap_err();
        assert!(matches!(err, GgufError::Truncated { .. } | GgufError::TensorOutOfBounds { .. }), "{name}: {err}");
    }
}

#[test]
fn the_gpu_upload_reads_each_tensor_once_in_pieces_of_at_most_8_mib() {
    let synthetic = SyntheticSource::new(GEMMA_VOCABULARY);
    let gguf = pollster::block_on(Gguf::read(&synthetic)).unwrap();
    let source = Counting::new(&synthetic);
    let gpu =
        pollster::block_on(Gpu::new(GpuOptions { force_f32: true, ..Default::default() })).expect("a GPU adapter");
    let mut model = pollster::block_on(GpuModel::load(gpu, &gguf, &source, 64, &mut |_, _| {})).unwrap();
    let largest_tensor = gguf.tensors.iter().map(|t| t.byte_size).max().unwrap();
    let all_tensors: u64 = gguf.tensors.iter().map(|t| t.byte_size).sum();
    // The 9.4 MB embedding is read in pieces: host memory holds one piece, not a tensor.
    assert_eq!(largest_tensor, 262144 * 36);
    assert!(largest_tensor > PIECE_BYTES as u64);
    assert!(source.largest.get() <= PIECE_BYTES as u64, "a read of {} bytes", source.largest.get());
    assert_eq!(source.total.get(), all_tensors, "every tensor is read once (the tied output is not read again)");

    // The pieces went where they belong: the logits of all 262144 rows are the CPU reference's
    // on the whole file.
    let file = file_of(GEMMA_VOCABULARY);
    let cpu = CpuModel::load(&gguf, &file).unwrap();
    let prompt = [256, 72, 101, 108, 108, 111];
    let want = cpu.forward(&mut cpu.new_cache(), &prompt, Logits::Last).unwrap();
    let mut got = vec![0f32; 262144];
    pollster::block_on(model.step(&prompt, 0, Readback::Logits(&mut got))).unwrap();
    let largest = want.iter().fold(0f32, |a, &l| a.max(l.abs()));
    let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("largest logit difference {diff:e} (largest logit {largest})");
    assert!(largest > 1e-3, "the weights do something: {largest}");
    assert!(diff <= 1e-4 * largest, "logits differ by {diff}");
}

#[test]
fn a_split_model_loads_from_its_parts_and_gives_the_whole_files_logits() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/arch/qwen2/model.gguf");
    let whole = std::fs::read(path).unwrap();
    let (a, b) = common::split_in_two(&whole, 10);
    let split = SplitSource::new(vec![&a[..], &b[..]]);
    let merged = pollster::block_on(split.header()).unwrap();
    assert_eq!(merged.tensors.len(), Gguf::parse(&whole).unwrap().tensors.len());

    let logits = |gguf: &Gguf, source: &dyn Fn(&Gguf) -> GpuModel| {
        let mut model = source(gguf);
        let mut out = vec![0f32; model.config.vocab_size];
        pollster::block_on(model.step(&[1, 100, 200, 300, 400], 0, Readback::Logits(&mut out))).unwrap();
        out
    };
    let gpu = || pollster::block_on(Gpu::new(GpuOptions { force_f32: true, ..Default::default() })).unwrap();
    let from_parts =
        logits(&merged, &|g| pollster::block_on(GpuModel::load(gpu(), g, &split, 64, &mut |_, _| {})).unwrap());
    let whole_gguf = Gguf::parse(&whole).unwrap();
    let from_whole =
        logits(&whole_gguf, &|g| pollster::block_on(GpuModel::load(gpu(), g, &whole[..], 64, &mut |_, _| {})).unwrap());
    assert_eq!(from_parts, from_whole);

    // Parts out of order, or one missing, are refused with a message that says so.
    for parts in [vec![&b[..], &a[..]], vec![&a[..]]] {
        let err = pollster::block_on(SplitSource::new(parts).header()).unwrap_err();
        assert!(err.to_string().contains("split"), "{err}");
    }
}
