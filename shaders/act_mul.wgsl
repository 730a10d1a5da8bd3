// Gated activation for prefill: h[t][i] = act(gu[t][i]) * gu[t][FFN + i], gu rows of 2 FFN.
// Bindings: 0 params, 1 gu, 2 h. Dispatch: (ceil(FFN / 64), n_tokens, 1). `act` comes from the host.

override FFN: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> gu: array<f32>;
@group(0) @binding(2) var<storage, read_write> h: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= FFN || t >= params.n_tokens) { return; }
    h[t * FFN + i] = act(gu[t * 2u * FFN + i]) * gu[t * 2u * FFN + FFN + i];
}
