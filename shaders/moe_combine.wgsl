// A mixture of experts' output: out[t][i] = sum over the token's USED experts j (in the
// router's order) of weights[t][j] * y[t * USED + j][i], stored, or added to out with ADD (the
// residual stream).
// Bindings: 0 params, 1 y (rows of D), 2 weights, 3 out (rows of D).
// Dispatch: (ceil(D / 64), n_tokens, 1).

override D: u32;
override ADD: bool = true;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> weights: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= D || t >= params.n_tokens) { return; }
    var sum = 0.0;
    for (var j = 0u; j < USED; j++) { sum += weights[t * USED + j] * y[(t * USED + j) * D + i]; }
    out[t * D + i] = select(sum, out[t * D + i] + sum, ADD);
}
