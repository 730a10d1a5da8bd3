//! Weight upload: tensors go to GPU buffers in their quantized block layout (src/quant says how
//! each type is laid out for the GPU; nothing is dequantized). A matrix larger than one storage
//! binding is split by rows into parts; matrices read by the same input (q|k|v, gate|up) are
//! fused into one buffer when their types match. Rows are read from the source and written in
//! pieces of at most `PIECE_BYTES`, so host (and wasm) memory holds one piece, not a tensor.

use super::Gpu;
use crate::error::{Error, Result};
use crate::gguf::{ByteSource, TensorInfo};
use crate::quant::{self, BlockFormat};

/// The most file bytes read and written to the GPU at once (one row, when a row is larger).
pub const PIECE_BYTES: usize = 8 << 20;

/// Consecutive rows of one tensor: rows `first .. first + rows` of `info`.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub info: &'a TensorInfo,
    pub format: &'static BlockFormat,
    pub cols: usize,
    pub first: usize,
    pub rows: usize,
    /// u32 words of one row as uploaded.
    pub row_words: usize,
}

impl<'a> Rows<'a> {
    /// All rows of a tensor; an error names a type or row length the GPU kernels cannot read.
    pub fn of(info: &'a TensorInfo) -> Result<Self> {
        let format = quant::tensor_format(info)?;
        let (cols, rows) = info.rows();
        let row_words = format.gpu_row_words(cols).ok_or_else(|| Error::InvalidMetadata {
            key: info.name.clone(),
            value: format!("rows of {cols} {} values", info.ty.name()),
            reason: "the GPU kernels read rows of whole blocks, a multiple of 8 values and of 4 bytes".into(),
        })?;
        Ok(Self { info, format, cols, first: 0, rows, row_words })
    }

    /// Rows `start .. start + count` of these.
    pub fn slice(&self, start: usize, count: usize) -> Self {
        Self { first: self.first + start, rows: count, ..*self }
    }

    /// The first and second halves (a fused gate|up tensor).
    pub fn halves(&self) -> (Self, Self) {
        let half = self.rows / 2;
        (self.slice(0, half), self.slice(half, half))
    }

    /// Bytes of one row in the file.
    fn file_row_bytes(&self) -> u64 {
        self.info.byte_size / self.info.rows().1 as u64
    }

    /// Bytes of one row on the GPU.
    pub fn gpu_row_bytes(&self) -> u64 {
        self.row_words as u64 * 4
    }

    /// Reads these rows from `source` and writes them to `buffer` from byte `at`, a piece at a time.
    async fn write(
        &self,
        gpu: &Gpu,
        source: &(impl ByteSource + ?Sized),
        buffer: &wgpu::Buffer,
        at: u64,
    ) -> Result<()> {
        let file_row = self.file_row_bytes();
        let per_piece = (PIECE_BYTES / file_row as usize).max(1);
        for r0 in (0..self.rows).step_by(per_piece) {
            let n = per_piece.min(self.rows - r0);
            let offset = self.info.file_offset + (self.first + r0) as u64 * file_row;
            let bytes = source.read(offset, n as u64 * file_row).await?;
            gpu.queue.write_buffer(
                buffer,
                at + r0 as u64 * self.gpu_row_bytes(),
                &self.format.to_gpu_layout(&bytes, self.cols),
            );
        }
        Ok(())
    }

    fn part(&self, buffer: wgpu::Buffer, rows: usize, out: usize, pair: bool) -> Part {
        Part {
            buffer,
            shape: GemvShape { format: self.format, cols: self.cols, row_words: self.row_words, rows, out, pair },
        }
    }
}

/// One GPU buffer of weight rows, and their shape (its fields read through the part).
pub struct Part {
    pub buffer: wgpu::Buffer,
    pub shape: GemvShape,
}

/// A part's shape: what its kernels are compiled for (`gpu::spirv` compiles the gemv for one
/// without a buffer).
#[derive(Clone, Copy)]
pub struct GemvShape {
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

impl std::ops::Deref for Part {
    type Target = GemvShape;
    fn deref(&self) -> &GemvShape {
        &self.shape
    }
}

/// A weight matrix as one or more parts.
pub struct Linear {
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
}

impl Linear {
    /// Uploads the row-wise concatenation of `inputs` (same column count), read from `source`:
    /// fused into one buffer when the types agree and it fits a binding, else one or more parts
    /// per input.
    pub async fn new(gpu: &Gpu, label: &str, inputs: &[Rows<'_>], source: &(impl ByteSource + ?Sized)) -> Result<Self> {
        let first = inputs[0];
        let total_rows: usize = inputs.iter().map(|t| t.rows).sum();
        let max = gpu.max_binding() as usize;
        let same_type = inputs.iter().all(|t| std::ptr::eq(t.format, first.format));
        let mut parts = Vec::new();
        if same_type && total_rows * first.row_words * 4 <= max {
            let buffer = gpu.storage(label, (total_rows * first.row_words * 4) as u64)?;
            let mut at = 0;
            for t in inputs {
                t.write(gpu, source, &buffer, at).await?;
                at += t.rows as u64 * t.gpu_row_bytes();
            }
            parts.push(first.part(buffer, total_rows, 0, false));
        } else {
            let mut out = 0;
            for t in inputs {
                let per_part = (max / (t.row_words * 4)).max(1);
                for r0 in (0..t.rows).step_by(per_part) {
                    let rows = t.slice(r0, per_part.min(t.rows - r0));
                    let buffer = gpu.storage(label, rows.rows as u64 * rows.gpu_row_bytes())?;
                    rows.write(gpu, source, &buffer, 0).await?;
                    parts.push(t.part(buffer, rows.rows, out + r0, false));
                }
                out += t.rows;
            }
        }
        gpu.flush_writes()?;
        Ok(Self { parts, rows: total_rows, cols: first.cols })
    }

    /// Gate and up projections as gated pairs (each part: gate rows, then the same up rows),
    /// or None when their types or shapes differ.
    pub async fn gated_pair(
        gpu: &Gpu,
        label: &str,
        gate: Rows<'_>,
        up: Rows<'_>,
        source: &(impl ByteSource + ?Sized),
    ) -> Result<Option<Self>> {
        if !std::ptr::eq(gate.format, up.format) || gate.rows != up.rows || gate.cols != up.cols {
            return Ok(None);
        }
        let per_part = (gpu.max_binding() as usize / (2 * gate.row_words * 4)).max(1);
        let mut parts = Vec::new();
        for r0 in (0..gate.rows).step_by(per_part) {
            let n = per_part.min(gate.rows - r0);
            let half = n as u64 * gate.gpu_row_bytes();
            let buffer = gpu.storage(label, 2 * half)?;
            gate.slice(r0, n).write(gpu, source, &buffer, 0).await?;
            up.slice(r0, n).write(gpu, source, &buffer, half).await?;
            parts.push(gate.part(buffer, n, r0, true));
        }
        gpu.flush_writes()?;
        Ok(Some(Self { parts, rows: gate.rows, cols: gate.cols }))
    }
}
