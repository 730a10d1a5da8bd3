// The int8 decode gemv's view of a 32-value integer block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Not a
// kernel: the host appends this after the block's family file, and a line choosing `q8w`, to
// gemvs that take int8 activations. Value i of block b of the row at word `base` is
// d * q_i + m, q_i the signed byte i of lo (values 0..15) then hi (16..31), four to a word in
// order. Its dot product with a block of int8 activations (a quantize_x.wgsl record: values
// dx * xq_i and their sum sx) is d dx sum(q_i xq_i) + m sx: an exact integer sum, scaled in f32.

struct Q8W { lo: vec4<u32>, hi: vec4<u32>, d: f32, m: f32 }

fn q8_dot(q: Q8W, xa: vec4<u32>, xb: vec4<u32>, xs: vec2<f32>) -> f32 {
    let i = dot4I8Packed(q.lo.x, xa.x) + dot4I8Packed(q.lo.y, xa.y) + dot4I8Packed(q.lo.z, xa.z)
        + dot4I8Packed(q.lo.w, xa.w) + dot4I8Packed(q.hi.x, xb.x) + dot4I8Packed(q.hi.y, xb.y)
        + dot4I8Packed(q.hi.z, xb.z) + dot4I8Packed(q.hi.w, xb.w);
    return q.d * xs.x * f32(i) + q.m * xs.y;
}

fn words4(at: u32) -> vec4<u32> {
    return vec4<u32>(w[at], w[at + 1u], w[at + 2u], w[at + 3u]);
}

// 4-bit values: the low nibbles of a block's four words are values 0..15, the high ones 16..31.
const LOW_NIBBLES = vec4<u32>(0x0F0F0F0Fu);

// A 5-bit value's fifth bit (bit i of qh for value i) as bit 4 of its byte: four bits of qh
// spread to the four bytes of a word by one multiply (bit j to bit 8j; the shifted copies of a
// 4-bit field never overlap).
fn fifth_bits(qh: u32, first: u32) -> vec4<u32> {
    let fields = (vec4<u32>(qh) >> (vec4<u32>(first) + vec4<u32>(0u, 4u, 8u, 12u))) & vec4<u32>(15u);
    return ((fields * vec4<u32>(0x00204081u)) & vec4<u32>(0x01010101u)) << vec4<u32>(4u);
}

fn q8w_q4_0(base: u32, b: u32) -> Q8W {
    let d = split_scale(base, b);
    let q = words4(split_body(base, b, 32u, 4u));
    return Q8W(q & LOW_NIBBLES, (q >> vec4<u32>(4u)) & LOW_NIBBLES, d, -8.0 * d);
}

fn q8w_q4_1(base: u32, b: u32) -> Q8W {
    let bw = base + b * 5u;
    let dm = unpack2x16float(w[bw]);
    let q = words4(bw + 1u);
    return Q8W(q & LOW_NIBBLES, (q >> vec4<u32>(4u)) & LOW_NIBBLES, dm.x, dm.y);
}

fn q8w_q5_0(base: u32, b: u32) -> Q8W {
    let d = split_scale(base, b);
    let bw = split_body(base, b, 32u, 5u);
    let qh = w[bw];
    let q = words4(bw + 1u);
    let lo = (q & LOW_NIBBLES) | fifth_bits(qh, 0u);
    let hi = ((q >> vec4<u32>(4u)) & LOW_NIBBLES) | fifth_bits(qh, 16u);
    return Q8W(lo, hi, d, -16.0 * d);
}

fn q8w_q5_1(base: u32, b: u32) -> Q8W {
    let bw = base + b * 6u;
    let dm = unpack2x16float(w[bw]);
    let qh = w[bw + 1u];
    let q = words4(bw + 2u);
    let lo = (q & LOW_NIBBLES) | fifth_bits(qh, 0u);
    let hi = ((q >> vec4<u32>(4u)) & LOW_NIBBLES) | fifth_bits(qh, 16u);
    return Q8W(lo, hi, dm.x, dm.y);
}

fn q8w_q8_0(base: u32, b: u32) -> Q8W {
    let d = split_scale(base, b);
    let bw = split_body(base, b, 32u, 8u);
    return Q8W(words4(bw), words4(bw + 4u), d, 0.0);
}
