// Each row of x (D values) times one scalar (Gemma 4's layer_output_scale), in place.
// Bindings: 0 params, 1 x, 2 scale (one f32). Dispatch: (ceil(D / 64), n_tokens, 1).

override D: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> scale: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= D || t >= params.n_tokens) { return; }
    x[t * D + i] *= scale[0];
}
