// Qwen3.5's gated delta rule (src/arch DeltaNet) over the pass's rows. A run is rows of one
// sequence at consecutive positions (a prompt chunk, a decode row and its drafts); workgroup
// (h, t) takes value head h of the run that starts at row t (others return). Each invocation
// owns columns j of the head's state S (HK x HV; column j: S[i][j] for every i) and walks the
// run's positions: S = S exp(g); S += k (v - S^T k)^T beta, column by column, and writes each
// row's output (S^T q)[j] to `out` (rows of VD).
// The sequence's state slot holds S after its first `ckpt` positions (a count per slot and
// head): the run first replays, from the inputs kept per position (rows of IN: k, v, g, beta),
// the positions from there to its first row; a slot whose count is past that row (its sequence
// went back: a new prompt over an old conversation) starts again from zeros at position 0, as
// a new sequence's (whose counts the host zeroes). With COMMIT, the state after a row whose
// position is final goes back to the slot with its count: a decode row (the first DECODE rows
// of the pass, `decode.n_tokens`: their runs' first row; the drafts after it may be rejected),
// else a prompt chunk's last row. Without COMMIT (self-speculation's drafts, whose earlier
// positions are drafts too) nothing is kept.
// Bindings: 0 params, 1 decode (the pass's decode rows' params), 2 inputs, 3 q (rows of KD),
// 4 out, 5 state (slots x VH x HK x HV f32), 6 ckpt (slots x VH u32), 7 batch.
// Dispatch: (VH, n_tokens, 1).

override COMMIT: bool = true;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> decode: Params;
@group(0) @binding(2) var<storage, read> inputs: array<f32>;
@group(0) @binding(3) var<storage, read> q: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> state: array<f32>;
@group(0) @binding(6) var<storage, read_write> ckpt: array<u32>;
@group(0) @binding(7) var<storage, read> batch: array<u32>;

const KD: u32 = KH * HK;
const VD: u32 = VH * HV;
const IN: u32 = KD + VD + 2u * VH;

var<workgroup> shared_start: u32;

// One position's delta rule on column j of S (in `s`), from its inputs at word `at`.
fn step(s: ptr<function, array<f32, HK>>, at: u32, kh: u32, h: u32, j: u32) {
    let decay = exp(inputs[at + KD + VD + h]);
    let beta = inputs[at + KD + VD + VH + h];
    var kv = 0.0;
    for (var i = 0u; i < HK; i++) {
        (*s)[i] *= decay;
        kv += (*s)[i] * inputs[at + kh * HK + i];
    }
    let delta = (inputs[at + KD + h * HV + j] - kv) * beta;
    for (var i = 0u; i < HK; i++) {
        (*s)[i] += inputs[at + kh * HK + i] * delta;
    }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let n = params.n_tokens;
    if (t >= n) { return; }
    let table = row_table(t);
    let first = row_pos(t);
    // Only a run's first row starts one.
    if (t > 0u && row_table(t - 1u) == table && row_pos(t - 1u) + 1u == first) { return; }
    var end = t + 1u;
    while (end < n && row_table(end) == table && row_pos(end) == row_pos(end - 1u) + 1u) { end++; }
    let slot = (table - TABLE0) / MAX_BLOCKS;
    let ck = slot * VH + h;
    if (lid.x == 0u) { shared_start = ckpt[ck]; }
    workgroupBarrier();
    var start = workgroupUniformLoad(&shared_start);
    if (start > first) { start = 0u; }
    let kh = h % KH;
    let base = ck * HK * HV;
    for (var j = lid.x; j < HV; j += 64u) {
        var s: array<f32, HK>;
        for (var i = 0u; i < HK; i++) {
            s[i] = select(0.0, state[base + i * HV + j], start > 0u);
        }
        for (var p = start; p < first; p++) {
            step(&s, kv_slot(table, p) * IN, kh, h, j);
        }
        for (var r = t; r < end; r++) {
            let pos = row_pos(r);
            step(&s, kv_slot(table, pos) * IN, kh, h, j);
            var o = 0.0;
            for (var i = 0u; i < HK; i++) {
                o += s[i] * q[r * KD + kh * HK + i];
            }
            out[r * VD + h * HV + j] = o;
            let final_row = select(r + 1u == end, r == t, r < decode.n_tokens);
            if (COMMIT && final_row) {
                for (var i = 0u; i < HK; i++) {
                    state[base + i * HV + j] = s[i];
                }
            }
        }
    }
    workgroupBarrier();
    if (lid.x == 0u) {
        // Every invocation has the same count; the first writes it.
        var count = start;
        if (COMMIT) {
            for (var r = t; r < end; r++) {
                if (select(r + 1u == end, r == t, r < decode.n_tokens)) { count = row_pos(r) + 1u; }
            }
        }
        ckpt[ck] = count;
    }
}
