//! Weight upload: tensors go to GPU buffers in their quantized block layout, read by the
//! kernels as u32 words. Q4_0 (18-byte) and Q8_0 (34-byte) blocks are padded to 20 and 36 bytes
//! so every block starts on a word; nothing is dequantized. A matrix larger than one storage
//! binding is split by rows into parts; matrices read by the same input (q|k|v, gate|up) are
//! fused into one buffer when their types match.

use super::Gpu;
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, TensorInfo};

/// Words per row of `cols` values as uploaded, or None for a type the GPU path does not run.
pub fn row_words(ty: GgmlType, cols: usize) -> Option<usize> {
    let blocks = cols / 32;
    match ty {
        GgmlType::F32 => Some(cols),
        GgmlType::F16 if cols % 2 == 0 => Some(cols / 2),
        GgmlType::Q4_0 | GgmlType::Q4_1 if cols % 32 == 0 => Some(blocks * 5),
        GgmlType::Q8_0 if cols % 32 == 0 => Some(blocks * 9),
        _ => None,
    }
}

/// The tensor's bytes in the uploaded layout.
pub fn repack(ty: GgmlType, data: &[u8]) -> Vec<u8> {
    let pad_block = |from: usize, to: usize| {
        let mut out = Vec::with_capacity(data.len() / from * to);
        for block in data.chunks_exact(from) {
            out.extend_from_slice(&block[..2]);
            out.extend_from_slice(&[0, 0]);
            out.extend_from_slice(&block[2..]);
        }
        out
    };
    match ty {
        GgmlType::Q4_0 => pad_block(18, 20),
        GgmlType::Q8_0 => pad_block(34, 36),
        _ => data.to_vec(),
    }
}

/// One GPU buffer of weight rows.
pub struct Part {
    pub buffer: wgpu::Buffer,
    pub ty: GgmlType,
    pub cols: usize,
    pub row_words: usize,
    /// Rows in this part (for a gated pair: rows of each half).
    pub rows: usize,
    /// Output index of the part's first row.
    pub out: usize,
    /// Holds `rows` gate rows followed by the matching `rows` up rows.
    pub pair: bool,
}

/// A weight matrix as one or more parts.
pub struct Linear {
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
}

fn check_type(t: &TensorInfo) -> Result<usize> {
    row_words(t.ty, t.shape[0] as usize)
        .ok_or_else(|| Error::UnsupportedTensorType { name: t.name.clone(), ty: t.ty.name() })
}

impl Linear {
    /// Uploads the row-wise concatenation of `tensors` (same column count): fused into one
    /// buffer when the types agree and it fits a binding, else one or more parts per tensor.
    pub fn new(gpu: &Gpu, label: &str, tensors: &[&TensorInfo], file: &[u8]) -> Result<Self> {
        let cols = tensors[0].shape[0] as usize;
        let total_rows: usize = tensors.iter().map(|t| t.rows().1).sum();
        let max = gpu.max_binding() as usize;
        let words = check_type(tensors[0])?;
        let same_type = tensors.iter().all(|t| t.ty == tensors[0].ty);
        let mut parts = Vec::new();
        if same_type && total_rows * words * 4 <= max {
            let bytes: Vec<u8> = tensors.iter().flat_map(|t| repack(t.ty, t.data(file))).collect();
            parts.push(Part {
                buffer: gpu.storage_init(label, &bytes)?,
                ty: tensors[0].ty,
                cols,
                row_words: words,
                rows: total_rows,
                out: 0,
                pair: false,
            });
        } else {
            let mut out = 0;
            for t in tensors {
                let words = check_type(t)?;
                let rows = t.rows().1;
                let per_part = (max / (words * 4)).max(1);
                let row_bytes = t.byte_size as usize / rows;
                for r0 in (0..rows).step_by(per_part) {
                    let n = per_part.min(rows - r0);
                    let data = &t.data(file)[r0 * row_bytes..(r0 + n) * row_bytes];
                    let buffer = gpu.storage_init(label, &repack(t.ty, data))?;
                    parts.push(Part { buffer, ty: t.ty, cols, row_words: words, rows: n, out: out + r0, pair: false });
                }
                out += rows;
            }
        }
        Ok(Self { parts, rows: total_rows, cols })
    }

    /// Gate and up projections as gated pairs (each part: gate rows, then the same up rows),
    /// or None when their types differ.
    pub fn gated_pair(gpu: &Gpu, label: &str, gate: &TensorInfo, up: &TensorInfo, file: &[u8]) -> Result<Option<Self>> {
        if gate.ty != up.ty || gate.shape != up.shape {
            return Ok(None);
        }
        let words = check_type(gate)?;
        let (cols, rows) = gate.rows();
        let max = gpu.max_binding() as usize;
        let per_part = (max / (2 * words * 4)).max(1);
        let row_bytes = gate.byte_size as usize / rows;
        let mut parts = Vec::new();
        for r0 in (0..rows).step_by(per_part) {
            let n = per_part.min(rows - r0);
            let range = r0 * row_bytes..(r0 + n) * row_bytes;
            let mut bytes = repack(gate.ty, &gate.data(file)[range.clone()]);
            bytes.extend(repack(up.ty, &up.data(file)[range]));
            let buffer = gpu.storage_init(label, &bytes)?;
            parts.push(Part { buffer, ty: gate.ty, cols, row_words: words, rows: n, out: r0, pair: true });
        }
        Ok(Some(Self { parts, rows, cols }))
    }
}
