// Qwen3.5's gated attention: each row's attention output times sigmoid of its gate (the q
// projection's gate half), in place, before the output projection.
// Bindings: 0 params, 1 attn (rows of Q), 2 gate (rows of Q). Dispatch: (ceil(Q / 64), n_tokens, 1).

override Q: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> attn: array<f32>;
@group(0) @binding(2) var<storage, read> gate: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= Q || t >= params.n_tokens) { return; }
    attn[t * Q + i] *= 1.0 / (1.0 + exp(-gate[t * Q + i]));
}
