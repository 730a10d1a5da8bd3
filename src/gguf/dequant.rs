//! CPU dequantization of the block layouts the engine runs: F32, F16, BF16, Q4_0, Q4_1, Q8_0.
//! This is the reference the GPU kernels are tested against, so it follows ggml bit for bit.

use super::{GgmlType, GgufError, TensorInfo};
use half::{bf16, f16};

/// Dequantizes a whole tensor to f32 (row-major, `shape[0]` contiguous).
pub fn dequantize(info: &TensorInfo, data: &[u8]) -> Result<Vec<f32>, GgufError> {
    let mut out = vec![0f32; info.n_elements() as usize];
    dequantize_row_into(info.ty, data, &mut out)
        .ok_or_else(|| GgufError::UnsupportedTensorType { name: info.name.clone(), ty: info.ty.name() })?;
    Ok(out)
}

/// Dequantizes `out.len()` values from `data` (which must hold exactly that many, a whole number
/// of blocks). Returns None for a type this engine does not run.
pub fn dequantize_row_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Option<()> {
    let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    o[j] = ((b[2 + j] & 0x0f) as i32 - 8) as f32 * d;
                    o[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    o[j] = (b[4 + j] & 0x0f) as f32 * d + m;
                    o[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
        _ => return None,
    }
    Some(())
}
