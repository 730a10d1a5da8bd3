// The int8 gemv's and gemm's activations: each of the pass's `params.rows` rows of x (with
// TOKENS, the prefill gemm's `params.n_tokens`) of COLS values, RMS-normalized here with NORM
// (weights nw, epsilon EPS, so the gemvs that read the record need not), in blocks of 32
// values, block b of row m as xq record (m * COLS / 32 + b): five vec4<u32>, two int8 slices
// of the 32 values as signed bytes (four to a word, in order: q_i, then r_i), then (e, sx, 0,
// 0) as f32 bits. The values are e (254 q_i + r_i): q_i the value over dx = the block's
// largest |value| / 127 rounded to nearest (ties to even), r_i what q_i leaves, over dx / 254,
// rounded the same (|r_i| <= 127), e = dx / 254, and sx = e sum(254 q_i + r_i). One slice
// alone is llama.cpp's q8_1 block, whose rounding (up to dx / 2 a value) moved SmolLM2's
// logits by up to 0.9 against transformers; the second slice brings that to dx / 508, finer
// than f16, for a second dot4I8Packed a word (the integer sums stay exact). One workgroup a
// row, an invocation a block.
// Bindings: 0 x (vec4), 1 nw (vec4; any buffer when not NORM), 2 xq, 3 params. Dispatch: a
// workgroup per row the pass may have (those past its rows return).

override COLS: u32;
override NORM: bool = false;
override EPS: f32 = 0.0;
override LANES: u32 = 32u;
override TOKENS: bool = false;

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> xq: array<vec4<u32>>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, lane: Lane) {
    let m = wg.x;
    if (m >= select(params.rows, params.n_tokens, TOKENS)) { return; }
    let xo = m * (COLS / 4u);
    var scale = 1.0;
    if (NORM) {
        var ss = 0.0;
        for (var i = lane.li; i < COLS / 4u; i += 256u) {
            let v = x[xo + i];
            ss += dot(v, v);
        }
        scale = inverseSqrt(block_sum(ss, lane) / f32(COLS) + EPS);
    }
    for (var b = lane.li; b < COLS / 32u; b += 256u) {
        var v: array<vec4<f32>, 8>;
        var amax = 0.0;
        for (var i = 0u; i < 8u; i++) {
            var t = x[xo + b * 8u + i];
            if (NORM) { t *= nw[b * 8u + i] * scale; }
            v[i] = t;
            let a = abs(t);
            amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
        }
        let dx = amax / 127.0;
        let inv = select(0.0, 127.0 / amax, amax > 0.0);
        var q: array<u32, 8>;
        var r: array<u32, 8>;
        var sum = 0;
        for (var i = 0u; i < 8u; i++) {
            let t = v[i] * inv;
            let qf = round(t);
            let qi = vec4<i32>(qf);
            let ri = vec4<i32>(round((t - qf) * 254.0));
            let both = qi * 254 + ri;
            sum += both.x + both.y + both.z + both.w;
            q[i] = pack4xI8(qi);
            r[i] = pack4xI8(ri);
        }
        let e = dx / 254.0;
        let o = (m * (COLS / 32u) + b) * 5u;
        xq[o] = vec4<u32>(q[0], q[1], q[2], q[3]);
        xq[o + 1u] = vec4<u32>(q[4], q[5], q[6], q[7]);
        xq[o + 2u] = vec4<u32>(r[0], r[1], r[2], r[3]);
        xq[o + 3u] = vec4<u32>(r[4], r[5], r[6], r[7]);
        xq[o + 4u] = vec4<u32>(bitcast<u32>(e), bitcast<u32>(e * f32(sum)), 0u, 0u);
    }
}
