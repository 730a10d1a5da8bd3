// Quantized weight access shared by every kernel that reads weights (embedding, gemv, gemm).
// Not a kernel: the host (src/quant) prepends this, the IQ4 code book, the one block-family file
// the tensor needs and a line choosing `dq8`. Weights are bound as `w: array<u32>`; a row of
// COLS values (the kernel's override) starts at word `base`; `dq8(base, g)` returns the row's
// values 8g .. 8g+7. Block layouts are ggml's, except that the formats whose blocks do not fill
// whole words have their scale moved to the head of the row (src/quant's `scale_at`): the row
// is its blocks' scales, two f16 per word (MXFP4: four E8M0 bytes per word), padded to whole
// vec4s, then the blocks without them.

struct Dq8 { a: vec4<f32>, b: vec4<f32> }

// The first words of rows r0 .. r0 + 3 (lo) and r0 + 4 .. r0 + 7 (hi) of `count` rows of `words`
// words, those past the last clamped to it: a CPU-style kernel's 8 rows held in straight-line
// code (no array: SwiftShader would keep one in memory).
struct Rows8 { lo: vec4<u32>, hi: vec4<u32> }

fn rows8(r0: u32, count: u32, words: u32) -> Rows8 {
    let r = vec4<u32>(r0) + vec4<u32>(0u, 1u, 2u, 3u);
    let last = vec4<u32>(count - 1u);
    return Rows8(min(r, last) * words, min(r + 4u, last) * words);
}

// The dot product of 8 weights and 8 values.
fn dot8(v: Dq8, x: Dq8) -> f32 {
    return dot(v.a, x.a) + dot(v.b, x.b);
}

// Values 8g .. 8g+7 of 8 rows (`rows8`'s), dequantized once to be dotted with several x
// (`dot8x8`): members, not an array, for the same reason as Rows8.
struct W8 { w0: Dq8, w1: Dq8, w2: Dq8, w3: Dq8, w4: Dq8, w5: Dq8, w6: Dq8, w7: Dq8 }

fn dq8x8(b: Rows8, g: u32) -> W8 {
    return W8(dq8(b.lo.x, g), dq8(b.lo.y, g), dq8(b.lo.z, g), dq8(b.lo.w, g),
              dq8(b.hi.x, g), dq8(b.hi.y, g), dq8(b.hi.z, g), dq8(b.hi.w, g));
}

// The 8 rows of `w` each dotted with x: rows 0-3 (lo) and 4-7 (hi).
fn dot8x8(w: W8, x: Dq8) -> Rows8f {
    return Rows8f(vec4<f32>(dot8(w.w0, x), dot8(w.w1, x), dot8(w.w2, x), dot8(w.w3, x)),
                  vec4<f32>(dot8(w.w4, x), dot8(w.w5, x), dot8(w.w6, x), dot8(w.w7, x)));
}

struct Rows8f { lo: vec4<f32>, hi: vec4<f32> }

// Values 8g .. 8g+7 of the four rows that start at words `rows`, each dotted with x.
fn dot8x4(rows: vec4<u32>, g: u32, x: Dq8) -> vec4<f32> {
    return vec4<f32>(dot8(dq8(rows.x, g), x), dot8(dq8(rows.y, g), x), dot8(dq8(rows.z, g), x), dot8(dq8(rows.w, g), x));
}

const BYTE_SHIFTS = vec4<u32>(0u, 8u, 16u, 24u);

// Bits shift .. of each byte of v, masked: the fields of four packed values.
fn field4(v: u32, shift: u32, mask: u32) -> vec4<u32> {
    return (vec4<u32>(v) >> (BYTE_SHIFTS + vec4<u32>(shift))) & vec4<u32>(mask);
}

// Unsigned integers below 2^23 as floats, exactly, without conversion instructions (a quarter of
// the arithmetic rate on NVIDIA GPUs, and four per four weights): 2^23 + n, built in the bits,
// minus 2^23.
fn u2f4(v: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(v | vec4<u32>(0x4B000000u)) - vec4<f32>(8388608.0);
}

fn nibbles(v: u32, shift: u32) -> vec4<f32> {
    return u2f4(field4(v, shift, 15u));
}

// Four signed bytes: with the sign bits flipped they are n + 128 in 0 .. 255 (u2f4's way).
fn bytes_i8(v: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(field4(v ^ 0x80808080u, 0u, 255u) | vec4<u32>(0x4B000000u)) - vec4<f32>(8388736.0);
}

// Byte `offset` of the block starting at word bw.
fn byte_at(bw: u32, offset: u32) -> u32 {
    return (w[bw + offset / 4u] >> ((offset % 4u) * 8u)) & 255u;
}

fn iq4(q: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(IQ4_VALUES[q.x], IQ4_VALUES[q.y], IQ4_VALUES[q.z], IQ4_VALUES[q.w]);
}

// The f16 scale of block b of a row with its scales at its head.
fn split_scale(base: u32, b: u32) -> f32 {
    return unpack2x16float(w[base + (b >> 1u)])[b & 1u];
}

// Words of such a row's head: its blocks' scales (32-value blocks' f16, 256-value blocks' f16,
// MXFP4's bytes), padded to whole vec4s so that the bodies start on one (src/quant's
// `head_words`). Overrides, so that they are constants in the compiled kernel.
override SPLIT_HEAD_32: u32 = (COLS / 32u * 2u + 15u) / 16u * 4u;
override SPLIT_HEAD_256: u32 = (COLS / 256u * 2u + 15u) / 16u * 4u;
override SPLIT_HEAD_E8M0: u32 = (COLS / 32u + 15u) / 16u * 4u;

// The first word of block b's remaining `body_words` in such a row with a head of `head` words.
fn split_body(base: u32, b: u32, head: u32, body_words: u32) -> u32 {
    return base + head + b * body_words;
}
