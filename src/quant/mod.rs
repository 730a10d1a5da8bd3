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
pub const WGSL_INT8: &str = include_str!("../../shaders/quant/int8.wgsl");

/// The non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// MXFP4's 4-bit E2M1 code book, doubled (ggml's `kvalues_mxfp4`; its E8M0 scale is halved to
/// match): sign bit 3, so codes 0 and 8 are both +0.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

pub struct BlockFormat {
    pub ty: GgmlType,
    /// Decodes one block (`block_bytes` in, `block_values` out).
    decode: fn(&[u8], &mut [f32]),
    /// WGSL file defining `wgsl_fn(base: u32, g: u32) -> Dq8`: values 8g .. 8g+7 of the row that
    /// starts at word `base` of the uploaded weights `w`.
    pub wgsl: &'static str,
    pub wgsl_fn: &'static str,
    /// Byte offset of the block's scale when the upload moves it out of the block: a row goes
    /// to the GPU as its blocks' scales, packed in words (zero bytes after the last), then the
    /// blocks without them. GGUF packs Q4_0 in 18 bytes, Q6_K in 210 and MXFP4 in 17, which do
    /// not fill whole u32 words; without the scale they do (16, 208, 16), so a row carries at
    /// most `4 - scale_bytes` bytes more than in the file. None when blocks already fill whole
    /// words (uploaded as is).
    pub scale_at: Option<usize>,
    /// Bytes of that scale: 2 for an f16 (two scales a word), 1 for MXFP4's E8M0 exponent
    /// (four a word, block b's in byte b % 4 of word b / 4).
    pub scale_bytes: usize,
    /// Byte offsets of the block's f16 scale fields (tests fill them with finite values).
    pub f16_fields: &'static [usize],
    /// Byte offsets of the block's E8M0 exponent fields (tests fill them with moderate scales).
    pub e8m0_fields: &'static [usize],
}

macro_rules! block_format {
    ($ty:ident, $decode:path, $wgsl:expr, $f:literal, $pad:expr, $fields:expr) => {
        block_format!($ty, $decode, $wgsl, $f, $pad, $fields, scale_bytes: 2, e8m0: [])
    };
    ($ty:ident, $decode:path, $wgsl:expr, $f:literal, $pad:expr, $fields:expr, scale_bytes: $sb:literal, e8m0: $e8m0:expr) => {
        BlockFormat {
            ty: GgmlType::$ty,
            decode: $decode,
            wgsl: $wgsl,
            wgsl_fn: $f,
            scale_at: $pad,
            scale_bytes: $sb,
            f16_fields: &$fields,
            e8m0_fields: &$e8m0,
        }
    };
}

/// Every block type the engine runs, on the CPU and in every GPU kernel that reads weights.
pub static FORMATS: [BlockFormat; 16] = [
    block_format!(F32, blocks::f32, WGSL_FLOAT, "dq8_f32", None, []),
    block_format!(F16, blocks::f16, WGSL_FLOAT, "dq8_f16", None, []),
    block_format!(BF16, blocks::bf16, WGSL_FLOAT, "dq8_bf16", None, []),
    block_format!(Q4_0, blocks::q4_0, WGSL_Q32, "dq8_q4_0", Some(0), [0]),
    block_format!(Q4_1, blocks::q4_1, WGSL_Q32, "dq8_q4_1", None, [0, 2]),
    block_format!(Q5_0, blocks::q5_0, WGSL_Q32, "dq8_q5_0", Some(0), [0]),
    block_format!(Q5_1, blocks::q5_1, WGSL_Q32, "dq8_q5_1", None, [0, 2]),
    block_format!(Q8_0, blocks::q8_0, WGSL_Q32, "dq8_q8_0", Some(0), [0]),
    block_format!(IQ4NL, blocks::iq4_nl, WGSL_Q32, "dq8_iq4_nl", Some(0), [0]),
    block_format!(MXFP4, blocks::mxfp4, WGSL_Q32, "dq8_mxfp4", Some(0), [], scale_bytes: 1, e8m0: [0]),
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
            Some(_) => self.head_words(blocks) * 4 + blocks * (bytes - self.scale_bytes),
            None => blocks * bytes,
        };
        (cols % values == 0 && cols % 8 == 0 && row % 4 == 0).then_some(row / 4)
    }

    /// The int8 decode gemv's block function (shaders/quant/int8.wgsl) for the 32-value integer
    /// blocks, whose values are d q + m with integer q of at most 8 bits.
    pub fn int8_fn(&self) -> Option<&'static str> {
        match self.ty {
            GgmlType::Q4_0 => Some("q8w_q4_0"),
            GgmlType::Q4_1 => Some("q8w_q4_1"),
            GgmlType::Q5_0 => Some("q8w_q5_0"),
            GgmlType::Q5_1 => Some("q8w_q5_1"),
            GgmlType::Q8_0 => Some("q8w_q8_0"),
            _ => None,
        }
    }

    /// Whether the int8 kernels' `q8w` reads this format's block bodies as vec4s (int8.wgsl's
    /// `body4`, through a second binding of the weights): the int8 formats whose blocks, their
    /// scale moved to the head, are whole vec4s (Q4_0, Q8_0).
    pub fn int8_reads_vec4s(&self) -> bool {
        let (_, bytes) = self.block();
        self.int8_fn().is_some() && self.scale_at.is_some() && (bytes - self.scale_bytes) % 16 == 0
    }

    /// Words at the head of a row of `blocks` blocks holding their moved scales, padded to
    /// whole 16-byte vectors so that the bodies after it start on one (the int8 kernels read a
    /// Q4_0 or Q8_0 body as vec4s; shaders/quant/common.wgsl's SPLIT_HEAD_*).
    pub fn head_words(&self, blocks: usize) -> usize {
        (blocks * self.scale_bytes).div_ceil(16) * 4
    }

    /// Whole rows of `cols` values in the GPU layout (borrowed when it is the GGUF layout).
    pub fn to_gpu_layout<'a>(&self, data: &'a [u8], cols: usize) -> Cow<'a, [u8]> {
        let Some(at) = self.scale_at else { return Cow::Borrowed(data) };
        let (values, bytes) = self.block();
        let (blocks, sb) = (cols / values, self.scale_bytes);
        let row_words = self.gpu_row_words(cols).unwrap_or(0);
        let mut out = Vec::with_capacity(data.len() / (blocks * bytes).max(1) * row_words * 4);
        for row in data.chunks_exact(blocks * bytes) {
            for block in row.chunks_exact(bytes) {
                out.extend_from_slice(&block[at..at + sb]);
            }
            out.resize(out.len() + self.head_words(blocks) * 4 - blocks * sb, 0);
            for block in row.chunks_exact(bytes) {
                out.extend_from_slice(&block[..at]);
                out.extend_from_slice(&block[at + sb..]);
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

/// WGSL declarations every weight-reading kernel shares, with the code books IQ4_VALUES and
/// MXFP4_VALUES.
pub fn wgsl_prelude() -> String {
    let table = |name: &str, values: &[i8; 16]| {
        let values: Vec<String> = values.iter().map(|v| format!("{v}.0")).collect();
        format!("var<private> {name}: array<f32, 16> = array<f32, 16>({});\n", values.join(", "))
    };
    format!("{WGSL_COMMON}{}{}", table("IQ4_VALUES", &IQ4_VALUES), table("MXFP4_VALUES", &MXFP4_VALUES))
}
