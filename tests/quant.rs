//! Every block format's CPU decoder against gguf-py's `gguf.quants.dequantize` (float32), bit for
//! bit, on random blocks: vectors made by scripts/gen-quant-vectors.py and committed.

use std::path::PathBuf;
use webgpu_llm::gguf::TensorInfo;
use webgpu_llm::quant::{self, FORMATS};

fn vectors(name: &str) -> (Vec<u8>, Vec<f32>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant");
    let read = |ext: &str| std::fs::read(dir.join(format!("{name}.{ext}"))).expect("vectors for every format");
    let values = read("f32").chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    (read("blocks"), values)
}

#[test]
fn every_format_decodes_bit_for_bit_as_gguf_py() {
    for f in &FORMATS {
        let (blocks, want) = vectors(f.ty.name());
        let info = TensorInfo {
            name: "t".into(),
            shape: vec![want.len() as u64],
            ty: f.ty,
            file_offset: 0,
            byte_size: blocks.len() as u64,
        };
        let got = quant::dequantize(&info, &blocks).unwrap();
        assert_eq!(got.len(), want.len(), "{}", f.ty.name());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{} value {i}: got {g}, gguf-py {w}", f.ty.name());
        }
    }
}

#[test]
fn gpu_layout_pads_unaligned_blocks_to_whole_words_and_keeps_aligned_ones() {
    for f in &FORMATS {
        let (values, bytes) = f.block();
        assert_eq!(f.gpu_block_bytes() % if values == 1 { 2 } else { 4 }, 0, "{}", f.ty.name());
        let data: Vec<u8> = (0..bytes * 2).map(|i| i as u8).collect();
        let gpu = f.to_gpu_layout(&data);
        assert_eq!(gpu.len(), 2 * f.gpu_block_bytes(), "{}", f.ty.name());
        if let Some(at) = f.pad_at {
            // The block's bytes in order, with two zeros at `at` in each block.
            let b = f.gpu_block_bytes();
            assert_eq!(&gpu[at..at + 2], [0, 0]);
            assert_eq!(&gpu[b + at..b + at + 2], [0, 0]);
            assert_eq!([&gpu[..at], &gpu[at + 2..b]].concat(), data[..bytes]);
        } else {
            assert_eq!(gpu, data);
        }
    }
}

#[test]
fn an_unsupported_type_is_named_in_the_error() {
    let info = TensorInfo {
        name: "blk.0.ffn_up.weight".into(),
        shape: vec![256],
        ty: webgpu_llm::gguf::GgmlType::IQ2XXS,
        file_offset: 0,
        byte_size: 66,
    };
    let msg = quant::dequantize(&info, &[0; 66]).unwrap_err().to_string();
    assert!(msg.contains("blk.0.ffn_up.weight") && msg.contains("IQ2_XXS") && msg.contains("Q4_K"), "{msg}");
}
