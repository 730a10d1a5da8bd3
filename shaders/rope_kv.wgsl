// What happens to q, k and v between their projection and attention, in one pass over the fused
// q|k|v rows of n_tokens tokens: bias add (BIAS), RMSNorm of each q and k head (QK_NORM, weights
// q_norm then k_norm), RoPE of the first ROPE_DIM values of each q and k head — adjacent pairs
// (x[2i], x[2i+1]) or, with NEOX, halves (x[i], x[i + ROPE_DIM/2]) — by angle pos * inv_freq[i]
// from a cos/sin table computed in f64 at load; then q is written back in place and k, v go to
// the cache at row t's position, in its sequence's block. V_NORM: each V head RMS-normed without
// weights (Gemma 4). A layer that reads another's K and V (Gemma 4's KV sharing) dispatches its
// q heads alone.
// One workgroup per (head of q, k or v; token) of WG = HD / VPI invocations (the host keeps WG
// within WebGPU's 256 and even); invocation i owns values i, i + WG, ... of the head.
// Bindings: 0 params, 1 qkv, 2 rope (vec2 cos,sin per [pos][pair]), 3 k_cache, 4 v_cache,
// 5 bias (Q_DIM + 2 KV_DIM), 6 qk_norm (2 HD) — 5 and 6 any buffer when unused, 7 batch.
// Dispatch: (N_Q_HEADS + 2 N_KV_HEADS, n_tokens, 1). HD, VPI, WG, WG_POW2, `kv_t`, the cache's accessors
// the batch's accessors and `rope_rotate` (shaders/rope.wgsl) come from the host. Decode folds this pass into the qkv
// projection where it can (gemv_rope_kv.wgsl).

override ROPE_DIM: u32;
override N_Q_HEADS: u32;
override N_KV_HEADS: u32;
override NEOX: bool = false;
override BIAS: bool = false;
override QK_NORM: bool = false;
// Each V head RMS-normed without weights (Gemma 4).
override V_NORM: bool = false;
override EPS: f32 = 0.0;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> k_cache: array<kv_t>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<kv_t>;
@group(0) @binding(5) var<storage, read> bias: array<f32>;
@group(0) @binding(6) var<storage, read> qk_norm: array<f32>;
@group(0) @binding(7) var<storage, read> batch: array<u32>;

var<workgroup> vals: array<f32, HD>;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let head = wg.x;
    let t = wg.y;
    if (t >= params.n_tokens) { return; }
    let q_dim = N_Q_HEADS * HD;
    let kv_dim = N_KV_HEADS * HD;
    let row = t * (q_dim + 2u * kv_dim);
    let is_v = head >= N_Q_HEADS + N_KV_HEADS;
    // This invocation's values: i, i + WG, ... of the head.
    var v: array<f32, VPI>;
    var squares = 0.0;
    for (var r = 0u; r < VPI; r++) {
        let e = head * HD + i + r * WG;
        var x = qkv[row + e];
        if (BIAS) { x += bias[e]; }
        v[r] = x;
        squares += x * x;
    }
    if ((QK_NORM && !is_v) || (V_NORM && is_v)) {
        red[i] = squares;
        workgroupBarrier();
        for (var s = WG_POW2 / 2u; s > 0u; s >>= 1u) {
            if (i < s && i + s < WG) { red[i] += red[i + s]; }
            workgroupBarrier();
        }
        let inv = inverseSqrt(red[0] / f32(HD) + EPS);
        for (var r = 0u; r < VPI; r++) {
            if (is_v) {
                v[r] *= inv;
            } else {
                v[r] = qk_norm[select(HD, 0u, head < N_Q_HEADS) + i + r * WG] * (v[r] * inv);
            }
        }
    }
    for (var r = 0u; r < VPI; r++) { vals[i + r * WG] = v[r]; }
    workgroupBarrier();
    let pos = row_pos(t);
    // At least 1: a layer without RoPE (ROPE_DIM 0) never rotates, but the modulo below must not
    // be by a constant 0.
    let half = max(ROPE_DIM / 2u, 1u);
    for (var r = 0u; r < VPI; r++) {
        let j = i + r * WG;
        if (!is_v && j < ROPE_DIM) {
            var pair = j / 2u;
            var first = j % 2u == 0u;
            var other = j ^ 1u;
            if (NEOX) {
                pair = j % half;
                first = j < half;
                other = select(j - half, j + half, first);
            }
            let x = v[r];
            let rot = rope_rotate(select(vals[other], x, first), select(x, vals[other], first), rope[pos * half + pair]);
            v[r] = select(rot.y, rot.x, first);
        }
        if (head < N_Q_HEADS) {
            qkv[row + head * HD + j] = v[r];
        }
    }
    // k and v go to the cache a pair of values per even index (a packed f16 word holds two; WG is
    // even, so an invocation's indices are all even or all odd).
    workgroupBarrier();
    for (var r = 0u; r < VPI; r++) { vals[i + r * WG] = v[r]; }
    workgroupBarrier();
    if (head >= N_Q_HEADS && i % 2u == 0u) {
        let cache_row = kv_slot(row_table(t), pos) * kv_dim;
        for (var r = 0u; r < VPI; r++) {
            let j = i + r * WG;
            let e = head * HD + j;
            if (!is_v) {
                store_k(cache_row + e - q_dim, vals[j], vals[j + 1u]);
            } else {
                store_v(cache_row + e - q_dim - kv_dim, vals[j], vals[j + 1u]);
            }
        }
    }
}
