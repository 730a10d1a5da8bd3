// Super-blocks of 256 values (K-quants and IQ4_XS), as uploaded; byte offsets within a block
// (Q3_K and Q6_K have their d moved to the head of the row: see `split_scale`):
//   Q2_K   21 words  [scales: 16 (scale | min << 4)][qs: 64][d][dmin]
//   Q3_K   27 words  [hmask: 32][qs: 64][scales: 12]
//   Q4_K   36 words  [d][dmin][scales: 12][qs: 128]
//   Q5_K   44 words  [d][dmin][scales: 12][qh: 32][qs: 128]
//   Q6_K   52 words  [ql: 128][qh: 64][scales: 16 x i8]
//   IQ4_XS 34 words  [d][scales_h: u16][scales_l: 4][qs: 128]
// Bit layouts as in src/quant/blocks.rs. A group of 8 values (gg = 0..31 within the block) always
// shares one scale, and its quants sit in 8 consecutive bytes: two words.

// Q2_K: value v: scale byte v / 16, bits 2 ((v % 128) / 32) of qs[32 (v / 128) + v % 32].
fn dq8_q2_k(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 5u) * 21u;
    let gg = g & 31u;
    let dm = unpack2x16float(w[bw + 20u]);
    let sc = byte_at(bw, gg / 2u);
    let dl = dm.x * f32(sc & 15u);
    let ml = dm.y * f32(sc >> 4u);
    let qw = bw + 4u + (gg / 16u) * 8u + (gg % 4u) * 2u;
    let shift = 2u * ((gg / 4u) % 4u);
    return Dq8(u2f4(field4(w[qw], shift, 3u)) * dl - ml, u2f4(field4(w[qw + 1u], shift, 3u)) * dl - ml);
}

// Q3_K: 2 low bits as Q2_K (qs at byte 32); high bit v / 32 of hmask[v % 32], clear meaning -4;
// 16 six-bit scales minus 32.
fn dq8_q3_k(base: u32, g: u32) -> Dq8 {
    let bw = split_body(base, g >> 5u, SPLIT_HEAD_256, 27u);
    let gg = g & 31u;
    let d = split_scale(base, g >> 5u);
    let s = gg / 2u;
    let lo = select(byte_at(bw, 88u + s) >> 4u, byte_at(bw, 96u + s) & 15u, s < 8u);
    let hi = (byte_at(bw, 104u + s % 4u) >> (2u * (s / 4u))) & 3u;
    let scale = d * f32(i32(lo | (hi << 4u)) - 32);
    let qw = bw + 8u + (gg / 16u) * 8u + (gg % 4u) * 2u;
    let shift = 2u * ((gg / 4u) % 4u);
    let hw = bw + (gg % 4u) * 2u;
    let qa = u2f4(field4(w[qw], shift, 3u)) - 4.0 + 4.0 * u2f4(field4(w[hw], gg / 4u, 1u));
    let qb = u2f4(field4(w[qw + 1u], shift, 3u)) - 4.0 + 4.0 * u2f4(field4(w[hw + 1u], gg / 4u, 1u));
    return Dq8(qa * scale, qb * scale);
}

// d * scale and dmin * min of the sub-block holding group gg of a Q4_K / Q5_K block at word bw:
// [d][dmin] in word 0, then 6-bit (scale, min) pairs packed in the 12 bytes from byte 4.
fn k_scale_min(bw: u32, gg: u32) -> vec2<f32> {
    let j = gg / 4u;
    var sc = byte_at(bw, 4u + j) & 63u;
    var m = byte_at(bw, 8u + j) & 63u;
    if (j >= 4u) {
        sc = (byte_at(bw, 8u + j) & 15u) | ((byte_at(bw, j) >> 6u) << 4u);
        m = (byte_at(bw, 8u + j) >> 4u) | ((byte_at(bw, 4u + j) >> 6u) << 4u);
    }
    let dm = unpack2x16float(w[bw]);
    return vec2<f32>(dm.x * f32(sc), dm.y * f32(m));
}

// The 4-bit quants of group gg of a Q4_K / Q5_K block whose qs start at word qs: value
// v = 64 c + 32 h + l is nibble h of qs[32 c + l].
fn k_nibbles(qs: u32, gg: u32) -> Dq8 {
    let qw = qs + (gg / 8u) * 8u + (gg % 4u) * 2u;
    let shift = 4u * ((gg / 4u) % 2u);
    return Dq8(nibbles(w[qw], shift), nibbles(w[qw + 1u], shift));
}

// Q4_K: sub-blocks of 32; qs at byte 16.
fn dq8_q4_k(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 5u) * 36u;
    let gg = g & 31u;
    let s = k_scale_min(bw, gg);
    let q = k_nibbles(bw + 4u, gg);
    return Dq8(q.a * s.x - s.y, q.b * s.x - s.y);
}

// Q5_K: low nibbles as Q4_K (qs at byte 48); fifth bit v / 32 of qh[v % 32].
fn dq8_q5_k(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 5u) * 44u;
    let gg = g & 31u;
    let s = k_scale_min(bw, gg);
    let q = k_nibbles(bw + 12u, gg);
    let hw = bw + 4u + (gg % 4u) * 2u;
    let qa = q.a + 16.0 * u2f4(field4(w[hw], gg / 4u, 1u));
    let qb = q.b + 16.0 * u2f4(field4(w[hw + 1u], gg / 4u, 1u));
    return Dq8(qa * s.x - s.y, qb * s.x - s.y);
}

// Q6_K: value v = 128 h + u: nibble u / 64 of ql[64 h + u % 64], bits 2 (u / 32) of
// qh[32 h + u % 32] as bits 4-5, minus 32; signed 8-bit scales per 16 values.
fn dq8_q6_k(base: u32, g: u32) -> Dq8 {
    let bw = split_body(base, g >> 5u, SPLIT_HEAD_256, 52u);
    let gg = g & 31u;
    let d = split_scale(base, g >> 5u);
    let h = gg / 16u;
    let u = (gg % 16u) * 8u;
    let lw = bw + h * 16u + (u % 64u) / 4u;
    let lshift = 4u * (u / 64u);
    let hw = bw + 32u + h * 8u + (u % 32u) / 4u;
    let hshift = 2u * (u / 32u);
    let scale = d * f32(extractBits(i32(byte_at(bw, 192u + gg / 2u)), 0u, 8u));
    let qa = nibbles(w[lw], lshift) + 16.0 * u2f4(field4(w[hw], hshift, 3u)) - 32.0;
    let qb = nibbles(w[lw + 1u], lshift) + 16.0 * u2f4(field4(w[hw + 1u], hshift, 3u)) - 32.0;
    return Dq8(qa * scale, qb * scale);
}

// IQ4_XS: value v = 32 s + 16 h + l is nibble h of qs[16 s + l] (qs at byte 8), a code of
// IQ4_VALUES; 6-bit scales: low 4 bits in scales_l, high 2 in scales_h, minus 32.
fn dq8_iq4_xs(base: u32, g: u32) -> Dq8 {
    let bw = base + (g >> 5u) * 34u;
    let gg = g & 31u;
    let head = w[bw];
    let d = unpack2x16float(head).x;
    let s = gg / 4u;
    let lo = (byte_at(bw, 4u + s / 2u) >> (4u * (s % 2u))) & 15u;
    let hi = ((head >> 16u) >> (2u * s)) & 3u;
    let scale = d * f32(i32(lo | (hi << 4u)) - 32);
    let qw = bw + 2u + s * 4u + (gg % 2u) * 2u;
    let shift = 4u * ((gg % 4u) / 2u);
    return Dq8(iq4(field4(w[qw], shift, 15u)) * scale, iq4(field4(w[qw + 1u], shift, 15u)) * scale);
}
