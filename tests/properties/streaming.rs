//! Loading reads the file in ranges: the header from a prefix that grows only as far as the
//! header needs, then each tensor once, in pieces of at most 8 MiB straight into GPU buffers —
//! host memory holds one piece, never the file (so a model larger than memory or wasm32's 4 GiB can load).

use crate::common;

use common::Reference::{Gemma3, SmolLm2};
use std::cell::Cell;
use webgpu_llm::gguf::{ByteSource, Gguf, GgufError, SplitSource};
use webgpu_llm::gpu::weights::PIECE_BYTES;
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, Readback};

/// Bytes in memory that count what is read of them.
struct Counting<'a> {
    bytes: &'a [u8],
    largest: Cell<u64>,
    total: Cell<u64>,
}

impl<'a> Counting<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, largest: Cell::new(0), total: Cell::new(0) }
    }
}

impl ByteSource for Counting<'_> {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        self.largest.set(self.largest.get().max(len));
        self.total.set(self.total.get() + len);
        Ok(self.bytes[offset as usize..(offset + len) as usize].to_vec())
    }
}

#[test]
fn the_header_read_in_growing_prefixes_equals_the_whole_file_parse() {
    for r in [SmolLm2, Gemma3] {
        let source = Counting::new(r.bytes());
        let streamed = pollster::block_on(Gguf::read(&source)).unwrap();
        let whole = r.gguf();
        assert_eq!(streamed.tensors, whole.tensors);
        assert_eq!(streamed.metadata, whole.metadata);
        // Gemma's 262144-token vocabulary makes a header of several MB: a few doubling reads of
        // prefixes, never the 253 MB file.
        assert!(streamed.data_offset <= source.largest.get() && source.largest.get() <= 2 * streamed.data_offset);
        assert!(source.total.get() <= 4 * streamed.data_offset, "read {} bytes for the header", source.total.get());
    }
}

#[test]
fn a_header_cut_short_is_still_a_truncation_error() {
    let bytes = &SmolLm2.bytes()[..3_000_000];
    let err = pollster::block_on(Gguf::read(&Counting::new(bytes))).unwrap_err();
    assert!(matches!(err, GgufError::Truncated { .. } | GgufError::TensorOutOfBounds { .. }), "{err}");
}

#[test]
fn the_gpu_upload_reads_each_tensor_once_in_pieces_of_at_most_8_mib() {
    let gguf = Gemma3.gguf();
    let source = Counting::new(Gemma3.bytes());
    let gpu =
        pollster::block_on(Gpu::new(GpuOptions { force_f32: true, ..Default::default() })).expect("a GPU adapter");
    let model = pollster::block_on(GpuModel::load(gpu, gguf, &source, 64, &mut |_, _| {})).unwrap();
    let largest_tensor = gguf.tensors.iter().map(|t| t.byte_size).max().unwrap();
    let all_tensors: u64 = gguf.tensors.iter().map(|t| t.byte_size).sum();
    // Gemma's 168 MiB embedding is read in pieces: host memory holds one piece, not a tensor.
    assert!(largest_tensor > 20 * PIECE_BYTES as u64);
    assert!(source.largest.get() <= PIECE_BYTES as u64, "a read of {} bytes", source.largest.get());
    assert_eq!(source.total.get(), all_tensors, "every tensor is read once (the tied output is not read again)");
    drop(model);
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
