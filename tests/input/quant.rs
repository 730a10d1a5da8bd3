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
fn gpu_layout_moves_unaligned_blocks_scales_to_the_row_head_and_keeps_aligned_blocks() {
    for f in &FORMATS {
        let (values, bytes) = f.block();
        for blocks in [1, 2, 3, 4, 5] {
            let cols = blocks * values.max(8);
            let n = cols / values;
            // Two rows of distinct bytes.
            let data: Vec<u8> = (0..2 * n * bytes).map(|i| (i % 251) as u8).collect();
            let gpu = f.to_gpu_layout(&data, cols);
            let Some(words) = f.gpu_row_words(cols) else {
                assert!(f.scale_at.is_none() && (n * bytes) % 4 != 0, "{} rows of {cols}", f.ty.name());
                continue;
            };
            assert_eq!(gpu.len(), 2 * 4 * words, "{} rows of {cols}", f.ty.name());
            match f.scale_at {
                None => assert_eq!(gpu, data),
                Some(at) => {
                    let sb = f.scale_bytes;
                    let head = 4 * f.head_words(n);
                    // The scales padded to whole 16-byte vectors, so that the bodies start on one.
                    assert_eq!(head, (n * sb).next_multiple_of(16), "{}", f.ty.name());
                    // At most 15 bytes per row more than the file: the scales' padding.
                    assert_eq!(4 * words, n * bytes + head - n * sb, "{}", f.ty.name());
                    assert!(head - n * sb < 16, "{}", f.ty.name());
                    for (r, row) in data.chunks_exact(n * bytes).enumerate() {
                        let out = &gpu[r * 4 * words..(r + 1) * 4 * words];
                        for (b, block) in row.chunks_exact(bytes).enumerate() {
                            assert_eq!(&out[sb * b..sb * (b + 1)], &block[at..at + sb], "{} scale {b}", f.ty.name());
                            let body = &out[head + b * (bytes - sb)..head + (b + 1) * (bytes - sb)];
                            assert_eq!(body, [&block[..at], &block[at + sb..]].concat(), "{} block {b}", f.ty.name());
                        }
                        assert!(out[n * sb..head].iter().all(|&p| p == 0), "{} padding", f.ty.name());
                    }
                }
            }
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
