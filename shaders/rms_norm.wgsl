// RMSNorm: out[r] = x[r] / sqrt(mean(x[r]^2) + EPS) * weight, one workgroup per row.
// With LAST_ONLY, only the last token's row is normalized, into out row 0 (for the logits).
// With ADD, the result is added to out (a post-norm before the residual add, Gemma).
// Bindings: 0 params, 1 x, 2 weight, 3 out. Dispatch: (n_tokens or 1, 1, 1).
// WG (invocations, a power of two) comes from the host: 256 on GPUs, 8 on CPU adapters
// (kernels::reduce_width).

override COLS: u32;
override EPS: f32;
override LAST_ONLY: bool = false;
override ADD: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    var row = wg.x;
    var out_row = wg.x;
    if (LAST_ONLY) { row = params.n_tokens - 1u; out_row = 0u; }
    let base = row * COLS;
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
