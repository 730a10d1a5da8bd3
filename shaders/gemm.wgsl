// Tiled matrix-matrix product for prefill: Y[t][OUT + r] (= or +=) dot(w[r], X[t]) for the
// n_tokens rows of X and the ROW_COUNT weight rows of this part. A workgroup computes a tile of
// 16 tokens x 64 rows, stepping through K in blocks of 32 values: the X tile and the dequantized
// W tile go to workgroup memory, each invocation accumulates 4 outputs.
// PAIR: the part holds HALF gate rows then HALF up rows; row r >= HALF is written to column
// PAIR_OFFSET + OUT + r - HALF (silu * mul follows in a separate pass).
// EPILOGUE 0: store. 1: add (residual).
// Bindings: 0 params, 1 w, 2 x, 3 y. Dispatch: (ceil(ROW_COUNT / 64), ceil(n_tokens / 16), 1).

struct Params { n_tokens: u32, start_pos: u32, seq_len: u32, pad: u32 }

override COLS: u32;
override ROW_WORDS: u32;
override ROW_COUNT: u32;
override Y_STRIDE: u32;
override OUT: u32 = 0u;
override EPILOGUE: u32 = 0u;
override PAIR: bool = false;
override HALF: u32 = 0u;
override PAIR_OFFSET: u32 = 0u;

const TM: u32 = 16u;
const TN: u32 = 64u;
const TK: u32 = 32u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> xs: array<f32, 512>;   // TM x TK
var<workgroup> ws: array<f32, 2048>;  // TN x TK

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row0 = wg.x * TN;
    let tok0 = wg.y * TM;
    let n = params.n_tokens;
    // Output: token tok0 + li / 16, rows row0 + (li % 16) * 4 .. + 4.
    let tm = li / 16u;
    let tn = (li % 16u) * 4u;
    var acc = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < COLS; k0 += TK) {
        for (var i = li; i < TM * TK; i += 256u) {
            let t = tok0 + i / TK;
            xs[i] = select(0.0, x[t * COLS + k0 + i % TK], t < n);
        }
        // 64 rows x 4 groups of 8: one dq8 per invocation.
        let wr = li / 4u;
        let g = li % 4u;
        var v = Dq8(vec4<f32>(0.0), vec4<f32>(0.0));
        if (row0 + wr < ROW_COUNT) { v = dq8((row0 + wr) * ROW_WORDS, k0 / 8u + g); }
        let o = wr * TK + g * 8u;
        ws[o] = v.a.x; ws[o + 1u] = v.a.y; ws[o + 2u] = v.a.z; ws[o + 3u] = v.a.w;
        ws[o + 4u] = v.b.x; ws[o + 5u] = v.b.y; ws[o + 6u] = v.b.z; ws[o + 7u] = v.b.w;
        workgroupBarrier();
        for (var k = 0u; k < TK; k++) {
            let xv = xs[tm * TK + k];
            acc += xv * vec4<f32>(ws[tn * TK + k], ws[(tn + 1u) * TK + k], ws[(tn + 2u) * TK + k], ws[(tn + 3u) * TK + k]);
        }
        workgroupBarrier();
    }
    let t = tok0 + tm;
    if (t >= n) { return; }
    for (var j = 0u; j < 4u; j++) {
        let r = row0 + tn + j;
        if (r >= ROW_COUNT) { continue; }
        var col = OUT + r;
        if (PAIR && r >= HALF) { col = PAIR_OFFSET + OUT + r - HALF; }
        let o = t * Y_STRIDE + col;
        if (EPILOGUE == 1u) { y[o] = y[o] + acc[j]; } else { y[o] = acc[j]; }
    }
}
