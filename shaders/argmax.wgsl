// Greedy pick on the GPU: out[r] = index of the largest of row r's N logits (lowest index on
// ties), for each of the pass's `params.rows` rows, so decode reads back 4 bytes a sequence
// instead of the vocabulary's logits; 0xffffffff when any logit is NaN or infinite (the model
// broke down: the host reports it and emits nothing).
// The host prepends what the kernel reads (kernels::argmax's `ARGMAX_LOGITS` or
// `ARGMAX_RECORDS`): binding 0 and `value_at(row, i)`, `token_at(row, i)` for the row's N
// candidates in token order — its logits, or the lm_head gemv's records of each group of rows'
// largest logit (shaders/gemv.wgsl's ARGMAX: the first pass done in the lm_head's epilogue,
// so this pass walks a few thousand records instead of the whole vocabulary).
// Bindings: 0 logits or records, 1 out, 2 params. Dispatch: (1, the pass's most rows): rows past the pass's exit.
// WG (invocations, a power of two) comes from the host: 256 on GPUs, 8 on CPU adapters
// (kernels::reduce_width).
// The host prepends `row_masked` and `token_allowed` (kernels::mask_wgsl). The forward pass's
// argmax has stubs (every row, every token); a structured-output round's second argmax binds the
// constraint masks (binding 3) and rewrites only the masked rows, among their allowed tokens
// (over the logits: a record's token stands for its group alone).

override N: u32;
const NONE: u32 = 0xffffffffu;

@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@group(0) @binding(2) var<uniform> params: Params;

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;
var<workgroup> non_finite: atomic<u32>;
var<workgroup> skip: u32;

// NaN or +-infinity, from the bits (robust where the compiler assumes finite floats).
fn is_non_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.y;
    if (row >= params.rows) { return; }
    if (li == 0u) {
        atomicStore(&non_finite, 0u);
        skip = select(0u, 1u, MASKED && !row_masked(row));
    }
    if (workgroupUniformLoad(&skip) != 0u) { return; }
    // Each thread starts from its first allowed value (a sentinel value would have to be -inf,
    // which WGSL cannot write as a constant); a thread with none yet holds index NONE, which the
    // comparisons and the reduction skip. Every value is checked for being finite, allowed or not.
    var bv = 0.0;
    var bi = NONE;
    var bad = false;
    if (li < N) {
        bv = value_at(row, li);
        bad = is_non_finite(bv);
        if (token_allowed(row, li)) { bi = li; }
    }
    // Eight loads in flight per invocation (one workgroup walks the whole vocabulary, so the
    // loads' latency, not their bytes, sets its time), taken in index order; on a CPU adapter
    // the 8 invocations' loads are one vector.
    var i = li + WG;
    for (; i + 7u * WG < N; i += 8u * WG) {
        var v: array<f32, 8>;
        for (var u = 0u; u < 8u; u++) { v[u] = value_at(row, i + u * WG); }
        for (var u = 0u; u < 8u; u++) {
            bad = bad || is_non_finite(v[u]);
            if ((bi == NONE || v[u] > bv) && token_allowed(row, i + u * WG)) { bv = v[u]; bi = i + u * WG; }
        }
    }
    for (; i < N; i += WG) {
        let v = value_at(row, i);
        bad = bad || is_non_finite(v);
        if ((bi == NONE || v > bv) && token_allowed(row, i)) { bv = v; bi = i; }
    }
    if (bad) { atomicStore(&non_finite, 1u); }
    best_v[li] = bv;
    best_i[li] = bi;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            let ov = best_v[li + s];
            let oi = best_i[li + s];
            let mine = best_i[li];
            if (oi != NONE && (mine == NONE || ov > best_v[li] || (ov == best_v[li] && oi < mine))) {
                best_v[li] = ov;
                best_i[li] = oi;
            }
        }
        workgroupBarrier();
    }
    if (li == 0u) {
        var id = best_i[0];
        if (atomicLoad(&non_finite) != 0u) { id = NONE; }
        if (id != NONE) { id = token_at(row, id); }
        out[row] = id;
    }
}
