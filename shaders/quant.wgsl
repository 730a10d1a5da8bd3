// Quantized weight access, shared by every kernel that reads weights (embedding, gemv, gemm).
// Not a kernel: the host prepends it, plus a line choosing `dq8`, to the kernels that need it.
// Weights are bound as `w: array<u32>`; a row starts at word `base`. Block layouts as uploaded
// (GGUF layouts, with Q4_0 and Q8_0 blocks padded to a multiple of 4 bytes):
//   F32: 1 word / value.  F16: 2 values / word.
//   Q4_0: [d:f16, pad:16][qs: 16 bytes]       (5 words / 32 values)  v = (q - 8) * d
//   Q4_1: [d:f16, m:f16][qs: 16 bytes]        (5 words / 32 values)  v = q * d + m
//   Q8_0: [d:f16, pad:16][qs: 32 x i8]        (9 words / 32 values)  v = q * d
// In Q4 blocks byte j holds value j in its low nibble and value j + 16 in its high nibble.

struct Dq8 { a: vec4<f32>, b: vec4<f32> }

fn nibbles(v: u32, shift: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>((v >> shift) & 15u, (v >> (shift + 8u)) & 15u, (v >> (shift + 16u)) & 15u, (v >> (shift + 24u)) & 15u));
}

fn bytes_i8(v: u32) -> vec4<f32> {
    let s = i32(v);
    return vec4<f32>(f32(extractBits(s, 0u, 8u)), f32(extractBits(s, 8u, 8u)), f32(extractBits(s, 16u, 8u)), f32(extractBits(s, 24u, 8u)));
}

// Values 8g .. 8g+7 of the row starting at word `base`.
fn dq8_f32(base: u32, g: u32) -> Dq8 {
    let i = base + g * 8u;
    return Dq8(bitcast<vec4<f32>>(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u])),
               bitcast<vec4<f32>>(vec4<u32>(w[i + 4u], w[i + 5u], w[i + 6u], w[i + 7u])));
}

fn dq8_f16(base: u32, g: u32) -> Dq8 {
    let i = base + g * 4u;
    return Dq8(vec4<f32>(unpack2x16float(w[i]), unpack2x16float(w[i + 1u])),
               vec4<f32>(unpack2x16float(w[i + 2u]), unpack2x16float(w[i + 3u])));
}

// The two words of qs and the nibble shift for group j (0..3) of a Q4 block at word bw.
fn q4_group(bw: u32, j: u32) -> Dq8 {
    let word = bw + 1u + (j & 1u) * 2u;
    let shift = (j >> 1u) * 4u;
    return Dq8(nibbles(w[word], shift), nibbles(w[word + 1u], shift));
}

fn dq8_q4_0(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 2u) * 5u;
    let d = unpack2x16float(w[bw]).x;
    let q = q4_group(bw, g & 3u);
    return Dq8((q.a - 8.0) * d, (q.b - 8.0) * d);
}

fn dq8_q4_1(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 2u) * 5u;
    let dm = unpack2x16float(w[bw]);
    let q = q4_group(bw, g & 3u);
    return Dq8(q.a * dm.x + dm.y, q.b * dm.x + dm.y);
}

fn dq8_q8_0(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 2u) * 9u;
    let d = unpack2x16float(w[bw]).x;
    let i = bw + 1u + (g & 3u) * 2u;
    return Dq8(bytes_i8(w[i]) * d, bytes_i8(w[i + 1u]) * d);
}
