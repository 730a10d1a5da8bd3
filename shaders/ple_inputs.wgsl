// Gemma 4's per-layer inputs (src/arch PerLayerEmbeddings), in place in `tok` (rows of L * W:
// each token's row of the per-layer token table, already times sqrt(W)): each layer's W values
// of `proj` (the model projection of the scaled embedding) divided by sqrt(D), RMS-normed with
// `norm` (W weights, eps EPS), plus the token table's, times 1 / sqrt(2).
// Bindings: 0 params, 1 proj (rows of L * W), 2 tok (rows of L * W), 3 norm (W f32).
// Dispatch: (L, n_tokens, 1), workgroups of 64.

override L: u32;
override W: u32;
override D: u32;
override EPS: f32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> proj: array<f32>;
@group(0) @binding(2) var<storage, read_write> tok: array<f32>;
@group(0) @binding(3) var<storage, read> norm: array<f32>;

var<workgroup> sums: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let l = wid.x;
    let t = wid.y;
    if (t >= params.n_tokens) { return; }
    let at = t * L * W + l * W;
    let scale = 1.0 / sqrt(f32(D));
    var sq = 0.0;
    for (var i = lid.x; i < W; i += 64u) {
        let v = proj[at + i] * scale;
        sq += v * v;
    }
    sums[lid.x] = sq;
    workgroupBarrier();
    for (var w = 32u; w > 0u; w >>= 1u) {
        if (lid.x < w) { sums[lid.x] += sums[lid.x + w]; }
        workgroupBarrier();
    }
    let inv = inverseSqrt(sums[0] / f32(W) + EPS);
    for (var i = lid.x; i < W; i += 64u) {
        tok[at + i] = (norm[i] * (proj[at + i] * scale * inv) + tok[at + i]) * 0.70710678118654752;
    }
}
