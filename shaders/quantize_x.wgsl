// The int8 gemv's and gemm's activations: each of the pass's `params.rows` rows of x (with
// TOKENS, the prefill gemm's `params.n_tokens`) of COLS values, RMS-normalized here with NORM
// (weights nw, epsilon EPS, so the gemvs that read the record need not), in blocks of 32
// values, block b of row m as xq record (m * COLS / 32 + b): three vec4<u32>, the 32 values
// as signed bytes (four to a word, in order), then (dx, sx, 0, 0) as f32 bits: the values are
// dx * q_i (dx = the block's largest |value| / 127, q_i rounded to nearest, ties to even) and
// sx = dx * sum(q_i) (llama.cpp's q8_1 blocks). One workgroup a row, an invocation a block.
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
        var sum = 0;
        for (var i = 0u; i < 8u; i++) {
            let qi = vec4<i32>(round(v[i] * inv));
            sum += qi.x + qi.y + qi.z + qi.w;
            q[i] = pack4xI8(qi);
        }
        let o = (m * (COLS / 32u) + b) * 3u;
        xq[o] = vec4<u32>(q[0], q[1], q[2], q[3]);
        xq[o + 1u] = vec4<u32>(q[4], q[5], q[6], q[7]);
        xq[o + 2u] = vec4<u32>(bitcast<u32>(dx), bitcast<u32>(dx * f32(sum)), 0u, 0u);
    }
}
