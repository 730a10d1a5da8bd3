// RMSNorm: out[r] = x[r] / sqrt(mean(x[r]^2) + EPS) * weight, one workgroup per row.
// With LAST_ONLY, only the last token's row is normalized, into out row 0 (for the logits).
// With ADD, the result is added to out (a post-norm before the residual add, Gemma).
// With FEED (CPU-style kernels), the norm of a fed product (shaders/norm_fed.wgsl): out[r] is
// x[r] times the weights, each FEED_ROWS values' sum of squares goes to `feed_sum` and then the
// row's scale to `feed_scale` (the host appends them and bindings 4 and 5, or stubs); the
// product applies the scale.
// Bindings: 0 params, 1 x, 2 weight, 3 out. Dispatch: (n_tokens or 1, 1, 1).
// WG (invocations, a power of two) comes from the host: 256 on GPUs, 8 on CPU adapters
// (kernels::reduce_width).

override COLS: u32;
override EPS: f32;
override LAST_ONLY: bool = false;
override ADD: bool = false;
override FEED: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, WG>;

// FEED: the sum of the squares of x's values FEED_ROWS p .. + FEED_ROWS - 1 from `base` (those
// below COLS), in order; 0 past the row.
fn square_sum(base: u32, p: u32) -> f32 {
    var ss = 0.0;
    for (var i = 0u; i < FEED_ROWS; i++) {
        let c = p * FEED_ROWS + i;
        if (c >= COLS) { break; }
        let v = x[base + c];
        ss += v * v;
    }
    return ss;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    var row = wg.x;
    var out_row = wg.x;
    if (LAST_ONLY) { row = params.n_tokens - 1u; out_row = 0u; }
    let base = row * COLS;
    if (FEED) {
        let parts = (COLS + FEED_ROWS - 1u) / FEED_ROWS;
        for (var p = li; p < parts; p += WG) {
            for (var i = 0u; i < FEED_ROWS; i++) {
                let c = p * FEED_ROWS + i;
                if (c >= COLS) { break; }
                out[out_row * COLS + c] = x[base + c] * weight[c];
            }
            feed_sum(out_row * sums_stride(COLS) + p, square_sum(base, p));
        }
        // The row's scale from the same sums (fed_sums' order), worked out again by one
        // invocation rather than read back after a barrier (which a CPU adapter runs slowly).
        if (li == 0u) {
            var acc = vec4<f32>(0.0);
            for (var p = 0u; p < parts; p += 4u) {
                acc += vec4<f32>(square_sum(base, p), square_sum(base, p + 1u), square_sum(base, p + 2u),
                                 square_sum(base, p + 3u));
            }
            feed_scale(out_row, fed_rms(acc));
        }
        return;
    }
    var acc = 0.0;
    for (var i = li; i < COLS; i += WG) {
        let v = x[base + i];
        acc += v * v;
    }
    partial[li] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) { partial[li] += partial[li + s]; }
        workgroupBarrier();
    }
    let inv = inverseSqrt(partial[0] / f32(COLS) + EPS);
    for (var i = li; i < COLS; i += WG) {
        let v = weight[i] * (x[base + i] * inv);
        if (ADD) { out[out_row * COLS + i] += v; } else { out[out_row * COLS + i] = v; }
    }
}
