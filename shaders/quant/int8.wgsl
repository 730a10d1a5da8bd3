// The int8 decode gemv's view of a 32-value integer block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Not a
// kernel: the host appends this after the block's family file, and a line choosing `q8w`, to
// gemvs that take int8 activations. Value i of block b of the row at word `base` is
// d * q_i + m, q_i the signed byte i of lo (values 0..15) then hi (16..31), four to a word in
// order. Its dot product with a block of int8 activations (a quantize_x.wgsl record: values
// e (254 xq_i + xr_i), two slices of signed bytes, and their sum sx) is
// d e (254 sum(q_i xq_i) + sum(q_i xr_i)) + m sx: exact integer sums, scaled in f32.

struct Q8W { lo: vec4<u32>, hi: vec4<u32>, d: f32, m: f32 }

/// A weight block's integers against an activation record's two slices (xa, xb: q; ra, rb: r)
/// as the one integer sum(q_i (254 xq_i + xr_i)).
fn q8_isum(q: Q8W, xa: vec4<u32>, xb: vec4<u32>, ra: vec4<u32>, rb: vec4<u32>) -> i32 {
    // Each weight vector taken from the block once, each word from it once for both slices.
    let lo = q.lo;
    let hi = q.hi;
    let l0 = lo.x;
    let l1 = lo.y;
    let l2 = lo.z;
    let l3 = lo.w;
    let h0 = hi.x;
    let h1 = hi.y;
    let h2 = hi.z;
    let h3 = hi.w;
    let first = dot4I8Packed(l0, xa.x) + dot4I8Packed(l1, xa.y) + dot4I8Packed(l2, xa.z) + dot4I8Packed(l3, xa.w)
        + dot4I8Packed(h0, xb.x) + dot4I8Packed(h1, xb.y) + dot4I8Packed(h2, xb.z) + dot4I8Packed(h3, xb.w);
    let second = dot4I8Packed(l0, ra.x) + dot4I8Packed(l1, ra.y) + dot4I8Packed(l2, ra.z) + dot4I8Packed(l3, ra.w)
        + dot4I8Packed(h0, rb.x) + dot4I8Packed(h1, rb.y) + dot4I8Packed(h2, rb.z) + dot4I8Packed(h3, rb.w);
    return 254 * first + second;
}

// A quantize_x.wgsl record: the two slices' bytes (xq_i in xa then xb, xr_i in ra then rb),
// then e and sx as f32 bits.
struct XRec { xa: vec4<u32>, xb: vec4<u32>, ra: vec4<u32>, rb: vec4<u32>, s: vec4<u32> }

/// acc plus the block's dot product with the record, in two fused multiply-adds.
fn q8_dot_add(acc: f32, q: Q8W, x: XRec) -> f32 {
    let s = bitcast<vec4<f32>>(x.s);
    return fma(q.d * s.x, f32(q8_isum(q, x.xa, x.xb, x.ra, x.rb)), fma(q.m, s.y, acc));
}

// A body of four words starting at a word that is a multiple of 4 (the split formats' bodies,
// after a head padded to whole vec4s), in one vector load: `weight_vec` is the kernel's view of
// the weights as vec4s (host snippets: kernels::matmul).
fn body4(at: u32) -> vec4<u32> {
    return weight_vec(at >> 2u);
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
    let q = body4(split_body(base, b, SPLIT_HEAD_32, 4u));
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
    let bw = split_body(base, b, SPLIT_HEAD_32, 5u);
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
    let bw = split_body(base, b, SPLIT_HEAD_32, 8u);
    return Q8W(body4(bw), body4(bw + 4u), d, 0.0);
}
