//! Weight block formats: the one place that knows a ggml block type. Each `BlockFormat` holds
//! the CPU decode (bit for bit as gguf-py's `dequantize` in float32), the WGSL decode the GPU
//! kernels call, and how the upload lays the blocks out for the GPU. Sizes come from the GGUF
//! format's own table (`GgmlType::block_layout`), which also covers the types nobody runs.
//! Adding a type: one entry in FORMATS, its decoder here and its WGSL function in shaders/quant/.

mod blocks;

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, TensorInfo};
use std::borrow::Cow;

/// The WGSL every weight-reading kernel gets: the `Dq8` type, bit helpers, shared tables.
pub const WGSL_COMMON: &str = include_str!("../../shaders/quant/common.wgsl");
const WGSL_FLOAT: &str = include_str!("../../shaders/quant/float.wgsl");
const WGSL_Q32: &str = include_str!("../../shaders/quant/q32.wgsl");
const WGSL_K: &str = include_str!("../../shaders/quant/k.wgsl");

/// The non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

pub struct BlockFormat {
    pub ty: GgmlType,
    /// Decodes one block (`block_bytes` in, `block_values` out).
    decode: fn(&[u8], &mut [f32]),
    /// WGSL file defining `wgsl_fn(base: u32, g: u32) -> Dq8`: values 8g .. 8g+7 of the row that
    /// starts at word `base` of the uploaded weights `w`.
    pub wgsl: &'static str,
    pub wgsl_fn: &'static str,
    /// Byte offset of the block's f16 scale when the upload moves it out of the block: a row
    /// goes to the GPU as its blocks' scales, two per word (a zero half after an odd count),
    /// then the blocks without them. GGUF packs Q4_0 in 18 bytes and Q6_K in 210, which do not
    /// fill whole u32 words; without the scale they do (16, 208), so a row carries at most two
    /// bytes more than in the file. None when blocks already fill whole words (uploaded as is).
    pub scale_at: Option<usize>,
    /// Byte offsets of the block's f16 scale fields (tests fill them with finite values).
    pub f16_fields: &'static [usize],
}

macro_rules! block_format {
    ($ty:ident, $decode:path, $wgsl:expr, $f:literal, $pad:expr, $fields:expr) => {
        BlockFormat {
            ty: GgmlType::$ty,
            decode: $decode,
            wgsl: $wgsl,
            wgsl_fn: $f,
            scale_at: $pad,
            f16_fields: &$fields,
        }
    };
}

/// Every block type the engine runs, on the CPU and in every GPU kernel that reads weights.
pub static FORMATS: [BlockFormat; 15] = [
    block_format!(F32, blocks::f32, WGSL_FLOAT, "dq8_f32", None, []),
    block_format!(F16, blocks::f16, WGSL_FLOAT, "dq8_f16", None, []),
    block_format!(BF16, blocks::bf16, WGSL_FLOAT, "dq8_bf16", None, []),
    block_format!(Q4_0, blocks::q4_0, WGSL_Q32, "dq8_q4_0", Some(0), [0]),
    block_format!(Q4_1, blocks::q4_1, WGSL_Q32, "dq8_q4_1", None, [0, 2]),
    block_format!(Q5_0, blocks::q5_0, WGSL_Q32, "dq8_q5_0", Some(0), [0]),
    block_format!(Q5_1, blocks::q5_1, WGSL_Q32, "dq8_q5_1", None, [0, 2]),
    block_format!(Q8_0, blocks::q8_0, WGSL_Q32, "dq8_q8_0", Some(0), [0]),
    block_format!(IQ4NL, blocks::iq4_nl, WGSL_Q32, "dq8_iq4_nl", Some(0), [0]),
    block_format!(Q2K, blocks::q2_k, WGSL_K, "dq8_q2_k", None, [80, 82]),
    block_format!(Q3K, blocks::q3_k, WGSL_K, "dq8_q3_k", Some(108), [108]),
    block_format!(Q4K, blocks::q4_k, WGSL_K, "dq8_q4_k", None, [0, 2]),
    block_format!(Q5K, blocks::q5_k, WGSL_K, "dq8_q5_k", None, [0, 2]),
    block_format!(Q6K, blocks::q6_k, WGSL_K, "dq8_q6_k", Some(208), [208]),
    block_format!(IQ4XS, blocks::iq4_xs, WGSL_K, "dq8_iq4_xs", None, [0]),
];

impl BlockFormat {
    /// Values per block, bytes per block as GGUF stores it.
    pub fn block(&self) -> (usize, usize) {
        let (values, bytes) = self.ty.block_layout();
        (values as usize, bytes as usize)
    }

    /// u32 words of a row of `cols` values as uploaded, or None when such a row cannot be
    /// uploaded: not whole blocks, not whole words, or not a multiple of 8 values (the kernels
    /// read 8 values at a time).
    pub fn gpu_row_words(&self, cols: usize) -> Option<usize> {
        let (values, bytes) = self.block();
        let blocks = cols / values;
        let row = match self.scale_at {
            Some(_) => blocks.div_ceil(2) * 4 + blocks * (bytes - 2),
            None => blocks * bytes,
        };
        (cols % values == 0 && cols % 8 == 0 && row % 4 == 0).then_some(row / 4)
    }

    /// Whole rows of `cols` values in the GPU layout (borrowed when it is the GGUF layout).
    pub fn to_gpu_layout<'a>(&self, data: &'a [u8], cols: usize) -> Cow<'a, [u8]> {
        let Some(at) = self.scale_at else { return Cow::Borrowed(data) };
        let (values, bytes) = self.block();
        let blocks = cols / values;
        let row_words = self.gpu_row_words(cols).unwrap_or(0);
        let mut out = Vec::with_capacity(data.len() / (blocks * bytes).max(1) * row_words * 4);
        for row in data.chunks_exact(blocks * bytes) {
            for block in row.chunks_exact(bytes) {
                out.extend_from_slice(&block[at..at + 2]);
            }
            if blocks % 2 == 1 {
                out.extend_from_slice(&[0, 0]);
            }
            for block in row.chunks_exact(bytes) {
                out.extend_from_slice(&block[..at]);
                out.extend_from_slice(&block[at + 2..]);
            }
        }
        Cow::Owned(out)
    }

    /// Decodes whole blocks: `out.len()` values from exactly that many values' bytes.
    pub fn decode_into(&self, data: &[u8], out: &mut [f32]) {
        let (values, bytes) = self.block();
        for (o, b) in out.chunks_exact_mut(values).zip(data.chunks_exact(bytes)) {
            (self.decode)(b, o);
        }
    }
}

/// The format of `ty`, or None when the engine does not run it.
pub fn format(ty: GgmlType) -> Option<&'static BlockFormat> {
    FORMATS.iter().find(|f| f.ty == ty)
}

/// Names of every type the engine runs, for error messages.
pub fn supported_names() -> String {
    FORMATS.iter().map(|f| f.ty.name()).collect::<Vec<_>>().join(", ")
}

/// The format of a tensor, or an error naming the tensor and its type.
pub fn tensor_format(info: &TensorInfo) -> Result<&'static BlockFormat> {
    format(info.ty).ok_or_else(|| Error::UnsupportedTensorType {
        name: info.name.clone(),
        ty: info.ty.name(),
        supported: supported_names(),
    })
}

/// Dequantizes a whole tensor to f32 (row-major, `shape[0]` contiguous).
pub fn dequantize(info: &TensorInfo, data: &[u8]) -> Result<Vec<f32>> {
    let f = tensor_format(info)?;
    let mut out = vec![0f32; info.n_elements() as usize];
    f.decode_into(data, &mut out);
    Ok(out)
}

/// WGSL declarations every weight-reading kernel shares, with the IQ4 code book from IQ4_VALUES.
pub fn wgsl_prelude() -> String {
    let values: Vec<String> = IQ4_VALUES.iter().map(|v| format!("{v}.0")).collect();
    format!("{WGSL_COMMON}var<private> IQ4_VALUES: array<f32, 16> = array<f32, 16>({});\n", values.join(", "))
}
