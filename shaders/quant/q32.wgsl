// Blocks of 32 values, as uploaded (d, m: f16). Q4_0, Q5_0, Q8_0 and IQ4_NL have their d moved
// to the head of the row (`split_scale`), the rest of each block after the row's scales:
//   Q4_0   [qs: 16]              4 words   v = (q - 8) d
//   Q4_1   [d, m][qs: 16]        5 words   v = q d + m
//   Q5_0   [qh: u32][qs: 16]     5 words   v = (q + 16 h - 16) d
//   Q5_1   [d, m][qh: u32][qs: 16] 6 words v = (q + 16 h) d + m
//   Q8_0   [qs: 32 x i8]         8 words   v = q d
//   IQ4_NL [qs: 16]              4 words   v = IQ4_VALUES[q] d
//   MXFP4  [qs: 16]              4 words   v = MXFP4_VALUES[q] 2^(e - 128)
// MXFP4's scale is an E8M0 exponent byte e: the row's are at its head, four per word (block b's
// in byte b % 4 of word b / 4), then the bodies.
// 4-bit quants: byte j holds value j in its low nibble and value j + 16 in its high nibble;
// the fifth bit of value i is bit i of qh. Group j (0..3) of a block is values 8j .. 8j+7.

fn q4_group(qs: u32, j: u32) -> Dq8 {
    let word = qs + (j & 1u) * 2u;
    let shift = (j >> 1u) * 4u;
    return Dq8(nibbles(w[word], shift), nibbles(w[word + 1u], shift));
}

fn q5_high(qh: u32, j: u32) -> Dq8 {
    let s = vec4<u32>(8u * j) + vec4<u32>(0u, 1u, 2u, 3u);
    return Dq8(u2f4((vec4<u32>(qh) >> s) & vec4<u32>(1u)) * 16.0,
               u2f4((vec4<u32>(qh) >> (s + vec4<u32>(4u))) & vec4<u32>(1u)) * 16.0);
}

fn dq8_q4_0(base: u32, g: u32) -> Dq8 {
    let b = g >> 2u;
    let d = split_scale(base, b);
    let q = q4_group(split_body(base, b, SPLIT_HEAD_32, 4u), g & 3u);
    return Dq8((q.a - 8.0) * d, (q.b - 8.0) * d);
}

fn dq8_q4_1(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 2u) * 5u;
    let dm = unpack2x16float(w[bw]);
    let q = q4_group(bw + 1u, g & 3u);
    return Dq8(q.a * dm.x + dm.y, q.b * dm.x + dm.y);
}

fn dq8_q5_0(base: u32, g: u32) -> Dq8 {
    let b = g >> 2u;
    let d = split_scale(base, b);
    let bw = split_body(base, b, SPLIT_HEAD_32, 5u);
    let q = q4_group(bw + 1u, g & 3u);
    let h = q5_high(w[bw], g & 3u);
    return Dq8((q.a + h.a - 16.0) * d, (q.b + h.b - 16.0) * d);
}

fn dq8_q5_1(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 2u) * 6u;
    let dm = unpack2x16float(w[bw]);
    let q = q4_group(bw + 2u, g & 3u);
    let h = q5_high(w[bw + 1u], g & 3u);
    return Dq8((q.a + h.a) * dm.x + dm.y, (q.b + h.b) * dm.x + dm.y);
}

fn dq8_q8_0(base: u32, g: u32) -> Dq8 {
    let b = g >> 2u;
    let d = split_scale(base, b);
    let i = split_body(base, b, SPLIT_HEAD_32, 8u) + (g & 3u) * 2u;
    return Dq8(bytes_i8(w[i]) * d, bytes_i8(w[i + 1u]) * d);
}

fn dq8_iq4_nl(base: u32, g: u32) -> Dq8 {
    let b = g >> 2u;
    let d = split_scale(base, b);
    let word = split_body(base, b, SPLIT_HEAD_32, 4u) + (g & 1u) * 2u;
    let shift = ((g & 3u) >> 1u) * 4u;
    return Dq8(iq4(field4(w[word], shift, 15u)) * d, iq4(field4(w[word + 1u], shift, 15u)) * d);
}

fn mxfp4(q: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(MXFP4_VALUES[q.x], MXFP4_VALUES[q.y], MXFP4_VALUES[q.z], MXFP4_VALUES[q.w]);
}

// MXFP4: code times 2^(e - 128), exactly as the CPU (ggml's E8M0 half scale). For e < 2 that
// scale is subnormal, which WGSL lets an implementation flush to zero on input, so the code is
// scaled by the normal 2^(e - 126) and then by 0.25: only results that are themselves subnormal
// (e < 2 and |code| <= 3, never seen in real weights) may be flushed. Past f32's range the
// product is inf, as on the CPU.
fn dq8_mxfp4(base: u32, g: u32) -> Dq8 {
    let b = g >> 2u;
    let e = (w[base + (b >> 2u)] >> ((b & 3u) * 8u)) & 255u;
    let small = e < 2u;
    let d = bitcast<f32>(select(e - 1u, e + 1u, small) << 23u);
    let post = select(1.0, 0.25, small);
    let word = base + SPLIT_HEAD_E8M0 + b * 4u + (g & 1u) * 2u;
    let shift = ((g & 3u) >> 1u) * 4u;
    return Dq8(mxfp4(field4(w[word], shift, 15u)) * d * post, mxfp4(field4(w[word + 1u], shift, 15u)) * d * post);
}
