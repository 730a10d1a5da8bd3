// Final-logit soft-capping in place (Gemma 2): every logit of the pass's rows becomes
// softcap(logit) (shaders/softcap.wgsl), between the LM head and the argmax / top-k / readback.
// Rows: params.rows (a decode step's batch, a prefill's last row) or, with ALL_TOKENS, every
// token of the pass (the all-logits prefill).
// Bindings: 0 params, 1 logits (rows of N). Dispatch: (ceil(N / 64), the pass's most rows): rows past the pass's exit.

override N: u32;
override ALL_TOKENS: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let row = gid.y;
    let rows = select(params.rows, params.n_tokens, ALL_TOKENS);
    if (i >= N || row >= rows) { return; }
    logits[row * N + i] = softcap(logits[row * N + i]);
}
