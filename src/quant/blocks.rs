//! CPU decoders, one block each, following gguf-py's `gguf.quants` float32 arithmetic operation
//! for operation (scale products first, then times the quant, then minus the min) so the results
//! are bit for bit the same. Block layouts are ggml's (`ggml-common.h`).

use super::{IQ4_VALUES, MXFP4_VALUES};
use half::{bf16, f16};

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

pub fn f32(b: &[u8], o: &mut [f32]) {
    o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

pub fn f16(b: &[u8], o: &mut [f32]) {
    o[0] = f16_at(b, 0);
}

pub fn bf16(b: &[u8], o: &mut [f32]) {
    o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

/// [d: f16][qs: 16]; value j in the low nibble of qs[j], value j + 16 in its high nibble.
pub fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        o[j] = d * ((b[2 + j] & 15) as i32 - 8) as f32;
        o[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
    }
}

/// [d: f16][m: f16][qs: 16]
pub fn q4_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        o[j] = d * (b[4 + j] & 15) as f32 + m;
        o[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
    }
}

/// The fifth bit of value i is bit i of the little-endian u32 `qh`.
fn q5(qs: &[u8], qh: u32, o: &mut [f32], value: impl Fn(i32) -> f32) {
    for j in 0..16 {
        let lo = (qs[j] & 15) as i32 | (((qh >> j) & 1) << 4) as i32;
        let hi = (qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
        o[j] = value(lo);
        o[j + 16] = value(hi);
    }
}

/// [d: f16][qh: u32][qs: 16]
pub fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    q5(&b[6..22], qh, o, |q| d * (q - 16) as f32);
}

/// [d: f16][m: f16][qh: u32][qs: 16]
pub fn q5_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    q5(&b[8..24], qh, o, |q| d * q as f32 + m);
}

/// [d: f16][qs: 32 x i8]
pub fn q8_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        o[j] = d * (b[2 + j] as i8) as f32;
    }
}

/// [d: f16][qs: 16], nibbles index IQ4_VALUES, laid out as Q4_0.
pub fn iq4_nl(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        o[j] = d * IQ4_VALUES[(b[2 + j] & 15) as usize] as f32;
        o[j + 16] = d * IQ4_VALUES[(b[2 + j] >> 4) as usize] as f32;
    }
}

/// Half of 2^(e - 127) as f32 bits, exactly (ggml's `ggml_e8m0_to_fp32_half`): 2^(e - 128),
/// subnormal for e < 2, and never inf (e = 255 gives 2^127).
pub fn e8m0_half(e: u8) -> f32 {
    let e = e as u32;
    f32::from_bits(if e < 2 { 0x0020_0000 << e } else { (e - 1) << 23 })
}

/// [e: E8M0][qs: 16], nibbles index MXFP4_VALUES (E2M1 doubled), laid out as Q4_0; the value is
/// the code times e8m0_half(e) in f32 (inf past f32's range for e >= 253).
pub fn mxfp4(b: &[u8], o: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for j in 0..16 {
        o[j] = d * MXFP4_VALUES[(b[1 + j] & 15) as usize] as f32;
        o[j + 16] = d * MXFP4_VALUES[(b[1 + j] >> 4) as usize] as f32;
    }
}

/// [scales: 16 (low nibble scale, high nibble min)][qs: 64][d: f16][dmin: f16]. Value v has
/// scale byte v / 16 and 2-bit quant (qs[32 (v / 128) + v % 32] >> 2 ((v % 128) / 32)) & 3.
pub fn q2_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (v, out) in o.iter_mut().enumerate() {
        let sc = b[v / 16];
        let q = (b[16 + 32 * (v / 128) + v % 32] >> (2 * ((v % 128) / 32))) & 3;
        let (dl, ml) = (d * (sc & 15) as f32, dmin * (sc >> 4) as f32);
        *out = dl * q as f32 - ml;
    }
}

/// [hmask: 32][qs: 64][scales: 12 (16 six-bit scales)][d: f16]. Value v: 2 low bits as Q2_K,
/// high bit = bit v / 32 of hmask[v % 32], set meaning no -4 offset.
pub fn q3_k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 108);
    let scales = &b[96..108];
    for (v, out) in o.iter_mut().enumerate() {
        let s = v / 16;
        let lo = if s < 8 { scales[s] & 15 } else { scales[s - 8] >> 4 };
        let hi = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
        let scale = ((lo | hi << 4) as i8 - 32) as f32;
        let ql = ((b[32 + 32 * (v / 128) + v % 32] >> (2 * ((v % 128) / 32))) & 3) as i8;
        let hbit = (b[v % 32] >> (v / 32)) & 1;
        let q = ql - if hbit == 1 { 0 } else { 4 };
        *out = (d * scale) * q as f32;
    }
}

/// The 6-bit (scale, min) of sub-block j of Q4_K / Q5_K, packed in 12 bytes.
pub fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        ((scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))
    }
}

/// [d: f16][dmin: f16][scales: 12][qs: 128]; sub-blocks of 32; value v = 64 c + 32 h + l is
/// nibble h of qs[32 c + l].
pub fn q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for (v, out) in o.iter_mut().enumerate() {
        let (sc, m) = k_scale_min(&b[4..16], v / 32);
        let q = (b[16 + 32 * (v / 64) + v % 32] >> (4 * ((v / 32) % 2))) & 15;
        *out = (d * sc as f32) * q as f32 - dmin * m as f32;
    }
}

/// [d: f16][dmin: f16][scales: 12][qh: 32][qs: 128]; low nibbles as Q4_K, fifth bit = bit
/// v / 32 of qh[v % 32].
pub fn q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for (v, out) in o.iter_mut().enumerate() {
        let (sc, m) = k_scale_min(&b[4..16], v / 32);
        let lo = (b[48 + 32 * (v / 64) + v % 32] >> (4 * ((v / 32) % 2))) & 15;
        let hi = (b[16 + v % 32] >> (v / 32)) & 1;
        *out = (d * sc as f32) * (lo | hi << 4) as f32 - dmin * m as f32;
    }
}

/// [ql: 128][qh: 64][scales: 16 x i8][d: f16]; value v = 128 h + w: low nibble (w / 64) of
/// ql[64 h + w % 64], high two bits (qh[32 h + w % 32] >> 2 (w / 32)) & 3, minus 32.
pub fn q6_k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 208);
    for (v, out) in o.iter_mut().enumerate() {
        let (h, w) = (v / 128, v % 128);
        let lo = (b[64 * h + w % 64] >> (4 * (w / 64))) & 15;
        let hi = (b[128 + 32 * h + w % 32] >> (2 * (w / 32))) & 3;
        let q = (lo | hi << 4) as i8 - 32;
        *out = (d * (b[192 + v / 16] as i8) as f32) * q as f32;
    }
}

/// [d: f16][scales_h: u16][scales_l: 4][qs: 128]; sub-blocks of 32 with 6-bit scales; value
/// v = 32 s + 16 h + l is nibble h of qs[16 s + l], indexing IQ4_VALUES.
pub fn iq4_xs(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    for (v, out) in o.iter_mut().enumerate() {
        let s = v / 32;
        let lo = (b[4 + s / 2] >> (4 * (s % 2))) & 15;
        let hi = ((scales_h >> (2 * s)) & 3) as u8;
        let scale = ((lo | hi << 4) as i8 - 32) as f32;
        let q = (b[8 + 16 * s + v % 16] >> (4 * ((v % 32) / 16))) & 15;
        *out = (d * scale) * IQ4_VALUES[q as usize] as f32;
    }
}
