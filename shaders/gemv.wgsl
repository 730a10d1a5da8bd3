// Matrix-vector product for decode: y[OUT + r] (= or +=) dot(w[r], x) for the ROW_COUNT weight
// rows of this part, dequantizing on the fly. 256 / LANES rows per workgroup, LANES lanes per
// row each taking groups of 8 values, summed with row_sum (subgroups when available). GPUs use
// 32 lanes; CPU adapters 1, so that a row needs no reduction and the kernel no barrier.
// NORM: x is RMS-normalized on the fly (weights nw, epsilon EPS): every workgroup sums x's squares
// itself, which costs less than a separate normalization pass and its dispatch.
// EPILOGUE 0: store. 1: add (residual). 2: gated pair: the part holds ROW_COUNT gate rows then
// ROW_COUNT up rows, and y[OUT + r] = act(gate_r . x) * (up_r . x) (`act` from the host).
// 3: the fused q|k|v rows of a decode step go through `rope_kv_pair` a pair of rows at a time
// (gemv_rope_kv.wgsl: RoPE, then q to y and k, v to the cache; OUT and ROW_COUNT even). The host
// appends `rope_kv_pair`, or an empty one for the other epilogues.
// Bindings: 0 w, 1 x (vec4), 2 y, 3 nw (vec4; any buffer when not NORM). Dispatch: ceil(ROW_COUNT / (256 / LANES)) workgroups, spread
// over x and y.

override COLS: u32;
override ROW_WORDS: u32;
override ROW_COUNT: u32;
override OUT: u32 = 0u;
override EPILOGUE: u32 = 0u;
override LANES: u32 = 32u;
override NORM: bool = false;
override EPS: f32 = 0.0;

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> nw: array<vec4<f32>>;

// EPILOGUE 3: the workgroup's row results, so that a pair's even row sees its partner.
var<workgroup> pair_rows: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lane: Lane) {
    let r = (wg.y * nwg.x + wg.x) * (256u / LANES) + lane.li / LANES;
    let k = lane.li & (LANES - 1u);
    var scale = 1.0;
    if (NORM) {
        var ss = 0.0;
        for (var i = lane.li; i < COLS / 4u; i += 256u) {
            let v = x[i];
            ss += dot(v, v);
        }
        scale = inverseSqrt(block_sum(ss, lane) / f32(COLS) + EPS);
    }
    var a = 0.0;
    var b = 0.0;
    if (r < ROW_COUNT) {
        let base = r * ROW_WORDS;
        for (var g = k; g < COLS / 8u; g += LANES) {
            var xa = x[g * 2u];
            var xb = x[g * 2u + 1u];
            if (NORM) {
                xa *= nw[g * 2u];
                xb *= nw[g * 2u + 1u];
            }
            let v = dq8(base, g);
            a += dot(v.a, xa) + dot(v.b, xb);
            if (EPILOGUE == 2u) {
                let u = dq8(base + ROW_COUNT * ROW_WORDS, g);
                b += dot(u.a, xa) + dot(u.b, xb);
            }
        }
    }
    a = row_sum(a, lane) * scale;
    if (EPILOGUE == 2u) { b = row_sum(b, lane) * scale; }
    if (EPILOGUE == 3u) {
        let lr = lane.li / LANES;
        if (k == 0u) { pair_rows[lr] = a; }
        workgroupBarrier();
        if (k == 0u && r < ROW_COUNT && lr % 2u == 0u) { rope_kv_pair(OUT + r, pair_rows[lr], pair_rows[lr + 1u]); }
        return;
    }
    if (k == 0u && r < ROW_COUNT) {
        let o = OUT + r;
        switch EPILOGUE {
            case 1u: { y[o] = y[o] + a; }
            case 2u: { y[o] = act(a) * b; }
            default: { y[o] = a; }
        }
    }
}
