// Gemma 4's per-layer embedding of layer LAYER: each row's inp_gate projection (W values, in
// place in `g`) through the activation, times the row's per-layer inputs for the layer.
// Bindings: 0 params, 1 g (rows of W), 2 inputs (rows of L * W). Dispatch: (ceil(W / 64), n_tokens, 1).

override L: u32;
override W: u32;
override LAYER: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> g: array<f32>;
@group(0) @binding(2) var<storage, read> inputs: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= W || t >= params.n_tokens) { return; }
    g[t * W + i] = act(g[t * W + i]) * inputs[t * L * W + LAYER * W + i];
}
