// Qwen3.5-MoE's shared expert: each row of `y` (D values) times sigmoid of its row's gate logit,
// added to x. Bindings: 0 params, 1 x (rows of D), 2 y (rows of D), 3 gate (a value a row).
// Dispatch: (ceil(D / 64), n_tokens, 1).

override D: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read> gate: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= D || t >= params.n_tokens) { return; }
    x[t * D + i] += y[t * D + i] / (1.0 + exp(-gate[t]));
}
