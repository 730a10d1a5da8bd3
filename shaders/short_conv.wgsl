// LFM2's gated short convolution (src/arch ShortConv), in two dispatches over the pass's rows:
// without APPLY, each row's B * x goes to the layer's state at its position (state rows of D
// f32, paged by the sequence's block table like the KV cache); with APPLY, each row's output is
// C * (the causal depthwise convolution of B * x over positions pos - L + 1 .. pos, the taps
// oldest first, zero before position 0), read back from the state: the earlier rows of a chunk
// were written by the first dispatch, the earlier positions by earlier passes.
// Bindings: 0 params, 1 bcx (rows of 3 D: B, C, x), 2 state, 3 taps (D x L f32), 4 out (rows
// of D), 5 batch. Dispatch: (ceil(D / 64), n_tokens, 1). L and the batch's accessors come from
// the host.

override D: u32;
override APPLY: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> bcx: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read> taps: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> batch: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= D || t >= params.n_tokens) { return; }
    let pos = row_pos(t);
    let table = row_table(t);
    let row = t * 3u * D;
    if (!APPLY) {
        state[kv_slot(table, pos) * D + c] = bcx[row + c] * bcx[row + 2u * D + c];
        return;
    }
    var s = 0.0;
    for (var j = 0u; j < L; j++) {
        // Tap j reads position pos - (L - 1) + j.
        if (pos + j + 1u >= L) {
            s += taps[c * L + j] * state[kv_slot(table, pos + j + 1u - L) * D + c];
        }
    }
    out[t * D + c] = bcx[row + D + c] * s;
}
