//! Weight upload: tensors go to GPU buffers in their quantized block layout (src/quant says how
//! each type is laid out for the GPU; nothing is dequantized). A matrix larger than one storage
//! binding is split by rows into parts; matrices read by the same input (q|k|v, gate|up) are
//! fused into one buffer when their types match.

use super::Gpu;
use crate::error::{Error, Result};
use crate::gguf::TensorInfo;
use crate::quant::{self, BlockFormat};

/// Consecutive rows of one tensor, in its GGUF bytes.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub name: &'a str,
    pub format: &'static BlockFormat,
    pub cols: usize,
    pub rows: usize,
    pub data: &'a [u8],
    /// u32 words of one row as uploaded.
    pub row_words: usize,
}

impl<'a> Rows<'a> {
    /// All rows of a tensor whose bytes are `data`; an error names a type or row length the GPU
    /// kernels cannot read.
    pub fn of(info: &'a TensorInfo, data: &'a [u8]) -> Result<Self> {
        let format = quant::tensor_format(info)?;
        let (cols, rows) = info.rows();
        let row_words = format.gpu_row_words(cols).ok_or_else(|| Error::InvalidMetadata {
            key: info.name.clone(),
            value: format!("rows of {cols} {} values", info.ty.name()),
            reason: "the GPU kernels read rows of whole blocks, a multiple of 8 values and of 4 bytes".into(),
        })?;
        Ok(Self { name: &info.name, format, cols, rows, data, row_words })
    }

    /// Rows `start .. start + count`.
    pub fn slice(&self, start: usize, count: usize) -> Self {
        let row_bytes = self.data.len() / self.rows;
        Self { rows: count, data: &self.data[start * row_bytes..(start + count) * row_bytes], ..*self }
    }

    /// The first and second halves (a fused gate|up tensor).
    pub fn halves(&self) -> (Self, Self) {
        let half = self.rows / 2;
        (self.slice(0, half), self.slice(half, half))
    }

    fn gpu_bytes(&self) -> std::borrow::Cow<'a, [u8]> {
        self.format.to_gpu_layout(self.data)
    }

    fn part(&self, buffer: wgpu::Buffer, rows: usize, out: usize, pair: bool) -> Part {
        Part { buffer, format: self.format, cols: self.cols, row_words: self.row_words, rows, out, pair }
    }
}

/// One GPU buffer of weight rows.
pub struct Part {
    pub buffer: wgpu::Buffer,
    pub format: &'static BlockFormat,
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

impl Linear {
    /// Uploads the row-wise concatenation of `inputs` (same column count): fused into one
    /// buffer when the types agree and it fits a binding, else one or more parts per input.
    pub fn new(gpu: &Gpu, label: &str, inputs: &[Rows]) -> Result<Self> {
        let first = inputs[0];
        let total_rows: usize = inputs.iter().map(|t| t.rows).sum();
        let max = gpu.max_binding() as usize;
        let same_type = inputs.iter().all(|t| std::ptr::eq(t.format, first.format));
        let mut parts = Vec::new();
        if same_type && total_rows * first.row_words * 4 <= max {
            let bytes = match inputs {
                [one] => one.gpu_bytes(),
                _ => inputs.iter().map(|r| r.gpu_bytes()).collect::<Vec<_>>().concat().into(),
            };
            let buffer = gpu.storage_init(label, &bytes)?;
            parts.push(first.part(buffer, total_rows, 0, false));
        } else {
            let mut out = 0;
            for t in inputs {
                let per_part = (max / (t.row_words * 4)).max(1);
                for r0 in (0..t.rows).step_by(per_part) {
                    let n = per_part.min(t.rows - r0);
                    let buffer = gpu.storage_init(label, &t.slice(r0, n).gpu_bytes())?;
                    parts.push(t.part(buffer, n, out + r0, false));
                }
                out += t.rows;
            }
        }
        Ok(Self { parts, rows: total_rows, cols: first.cols })
    }

    /// Gate and up projections as gated pairs (each part: gate rows, then the same up rows),
    /// or None when their types or shapes differ.
    pub fn gated_pair(gpu: &Gpu, label: &str, gate: Rows, up: Rows) -> Result<Option<Self>> {
        if !std::ptr::eq(gate.format, up.format) || gate.rows != up.rows || gate.cols != up.cols {
            return Ok(None);
        }
        let per_part = (gpu.max_binding() as usize / (2 * gate.row_words * 4)).max(1);
        let mut parts = Vec::new();
        for r0 in (0..gate.rows).step_by(per_part) {
            let n = per_part.min(gate.rows - r0);
            let mut bytes = gate.slice(r0, n).gpu_bytes().into_owned();
            bytes.extend_from_slice(&up.slice(r0, n).gpu_bytes());
            let buffer = gpu.storage_init(label, &bytes)?;
            parts.push(gate.part(buffer, n, r0, true));
        }
        Ok(Some(Self { parts, rows: gate.rows, cols: gate.cols }))
    }
}
