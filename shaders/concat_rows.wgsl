// Each row of `out` (2 D values) is row t of a then row t of b (Qwen3.5's MTP head: the normed
// embedding, then the normed hidden state, before eh_proj).
// Bindings: 0 params, 1 a (rows of D), 2 b (rows of D), 3 out. Dispatch: (ceil(2 D / 64), n_tokens, 1).

override D: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= 2u * D || t >= params.n_tokens) { return; }
    if (i < D) {
        out[t * 2u * D + i] = a[t * D + i];
    } else {
        out[t * 2u * D + i] = b[t * D + i - D];
    }
}
