// Qwen3.5's MTP head reads the model's final hidden state (after the output norm) at each
// position, kept paged like the KV cache (rows of D f32 at each position's slot). Without
// GATHER: each row of x, RMS-normed with `norm` (eps EPS), goes to its position's slot of
// `hidden`; with GATHER: each row's position's hidden state goes to row t of `out`.
// Bindings: 0 params, 1 x (rows of D), 2 norm (D f32), 3 hidden (paged), 4 out (rows of D),
// 5 batch. Dispatch: (1, n_tokens, 1), workgroups of 64.

override D: u32;
override EPS: f32 = 0.0;
override GATHER: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> norm: array<f32>;
@group(0) @binding(3) var<storage, read_write> hidden: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> batch: array<u32>;

var<workgroup> sums: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = wid.y;
    if (t >= params.n_tokens) { return; }
    let slot = kv_slot(row_table(t), row_pos(t)) * D;
    if (GATHER) {
        for (var i = lid.x; i < D; i += 64u) { out[t * D + i] = hidden[slot + i]; }
        return;
    }
    var sq = 0.0;
    for (var i = lid.x; i < D; i += 64u) { sq += x[t * D + i] * x[t * D + i]; }
    sums[lid.x] = sq;
    workgroupBarrier();
    for (var w = 32u; w > 0u; w >>= 1u) {
        if (lid.x < w) { sums[lid.x] += sums[lid.x + w]; }
        workgroupBarrier();
    }
    let inv = inverseSqrt(sums[0] / f32(D) + EPS);
    for (var i = lid.x; i < D; i += 64u) { hidden[slot + i] = norm[i] * (x[t * D + i] * inv); }
}
