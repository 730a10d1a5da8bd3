// Qwen3.5's gated delta rule (src/arch DeltaNet) over the pass's rows. A run is rows of one
// sequence at consecutive positions (a prompt chunk, a decode row and its drafts); workgroup
// (h, t) takes value head h of the run that starts at row t (others return). Invocation j owns
// column j of the head's state S (HK x HV; column j: S[i][j] for every i), in its registers.
// The delta rule of one position: S = S exp(g); S += k (v - S^T k)^T beta; output S^T q.
// The sequence's state slot holds S after its first `ckpt` positions (a count per slot and
// head): the run first replays, from the inputs kept per position (rows of IN: k, v, g, beta),
// the positions from there to its first row; a slot whose count is past that row (its sequence
// went back: a new prompt over an old conversation) starts again from zeros at position 0, as
// a new sequence's (whose counts the host zeroes). A decode run (rows of the pass's first
// `decode.n_tokens`) goes a position at a time; the replay and a prompt chunk go CHUNK
// positions at a time in the chunked (WY) form, as transformers' torch_chunk_gated_delta_rule:
// within a chunk, with gamma the running sum of g and A[t][s] = -beta_t (k_t . k_s)
// exp(gamma_t - gamma_s) for s < t, T = (I - A)^-1 by forward substitution (shared by the
// columns), then per column y_s = beta_s (v_s - exp(gamma_s) k_s . S), u = T y, each row's
// output exp(gamma_t) q_t . S + sum_{s <= t} (q_t . k_s) exp(gamma_t - gamma_s) u_s, and
// S = exp(gamma_last) S + sum_t k_t exp(gamma_last - gamma_t) u_t.
// With COMMIT, the state after a row whose position is final goes back to the slot with its
// count: a decode run's first row (the drafts after it may be rejected), a prompt chunk's last
// row. Without COMMIT (self-speculation's drafts, whose earlier positions are drafts too)
// nothing is kept.
// Bindings: 0 params, 1 decode (the pass's decode rows' params), 2 inputs, 3 q (rows of KD),
// 4 out, 5 state (slots x VH x HK x HV f32), 6 ckpt (slots x VH u32), 7 batch.
// Dispatch: (VH, n_tokens, 1), workgroups of HV.

override COMMIT: bool = true;
// A round's pass dispatches this twice: its prompt chunks' runs (PHASE 1), then its decode rows'
// (PHASE 2), so that a request whose prompt's last token is a decode row of the round (its rest a
// chunk of the same round) finds the chunk's state committed; other passes take every run (0).
override PHASE: u32 = 0u;

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
// A chunk's keys, decays (g, then their running sum gamma), betas, T and q . k.
var<workgroup> kc: array<f32, CHUNK * HK>;
var<workgroup> gam: array<f32, CHUNK>;
var<workgroup> bc: array<f32, CHUNK>;
var<workgroup> tm: array<f32, CHUNK * CHUNK>;
var<workgroup> qk: array<f32, CHUNK * CHUNK>;
var<workgroup> row_copy: array<f32, CHUNK>;

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

@compute @workgroup_size(HV)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let n = params.n_tokens;
    if (t >= n) { return; }
    let table = row_table(t);
    let first = row_pos(t);
    // Only a run's first row starts one.
    if (t > 0u && row_table(t - 1u) == table && row_pos(t - 1u) + 1u == first) { return; }
    let is_decode = t < decode.n_tokens;
    if ((PHASE == 1u && is_decode) || (PHASE == 2u && !is_decode)) { return; }
    var end = t + 1u;
    while (end < n && row_table(end) == table && row_pos(end) == row_pos(end - 1u) + 1u) { end++; }
    let slot = (table - TABLE0) / MAX_BLOCKS;
    let ck = slot * VH + h;
    if (lid.x == 0u) { shared_start = ckpt[ck]; }
    var start = workgroupUniformLoad(&shared_start);
    if (start > first) { start = 0u; }
    let kh = h % KH;
    let base = ck * HK * HV;
    let j = lid.x;
    var s: array<f32, HK>;
    for (var i = 0u; i < HK; i++) {
        s[i] = select(0.0, state[base + i * HV + j], start > 0u);
    }
    // The replay, a chunk at a time.
    for (var p = start; p < first; p += CHUNK) {
        chunk(&s, table, p, min(CHUNK, first - p), 0u, false, kh, h, j);
    }
    var count = start;
    if (is_decode) {
        // A decode run: its first row is final.
        for (var r = t; r < end; r++) {
            let pos = row_pos(r);
            step(&s, kv_slot(table, pos) * IN, kh, h, j);
            var o = 0.0;
            for (var i = 0u; i < HK; i++) {
                o += s[i] * q[r * KD + kh * HK + i];
            }
            out[r * VD + h * HV + j] = o;
            if (COMMIT && r == t) {
                for (var i = 0u; i < HK; i++) {
                    state[base + i * HV + j] = s[i];
                }
                count = pos + 1u;
            }
        }
    } else {
        // A prompt chunk: its last row is final.
        for (var r = t; r < end; r += CHUNK) {
            chunk(&s, table, row_pos(r), min(CHUNK, end - r), r, true, kh, h, j);
        }
        if (COMMIT) {
            for (var i = 0u; i < HK; i++) {
                state[base + i * HV + j] = s[i];
            }
            count = row_pos(end - 1u) + 1u;
        }
    }
    if (COMMIT && lid.x == 0u) {
        ckpt[ck] = count;
    }
}

// The delta rule over positions p0 .. p0 + m (m <= CHUNK) in the chunked form, on column j
// (in `s`); with `rows`, position p0 + t's output goes to row row0 + t of `out`.
fn chunk(s: ptr<function, array<f32, HK>>, table: u32, p0: u32, m: u32, row0: u32, rows: bool, kh: u32, h: u32, j: u32) {
    for (var x = j; x < m * HK; x += HV) {
        let tt = x / HK;
        kc[x] = inputs[kv_slot(table, p0 + tt) * IN + kh * HK + x % HK];
    }
    if (j < m) {
        let at = kv_slot(table, p0 + j) * IN;
        gam[j] = inputs[at + KD + VD + h];
        bc[j] = inputs[at + KD + VD + VH + h];
    }
    workgroupBarrier();
    if (j == 0u) {
        for (var tt = 1u; tt < m; tt++) { gam[tt] += gam[tt - 1u]; }
    }
    workgroupBarrier();
    // A (strictly lower), and q . k with its decays (lower, the diagonal included).
    for (var x = j; x < m * m; x += HV) {
        let tt = x / m;
        let ss = x % m;
        var kk = 0.0;
        var qq = 0.0;
        if (ss <= tt) {
            for (var i = 0u; i < HK; i++) {
                kk += kc[tt * HK + i] * kc[ss * HK + i];
                if (rows) { qq += q[(row0 + tt) * KD + kh * HK + i] * kc[ss * HK + i]; }
            }
        }
        let decay = exp(gam[tt] - gam[ss]);
        tm[tt * CHUNK + ss] = select(0.0, -bc[tt] * kk * decay, ss < tt);
        qk[tt * CHUNK + ss] = select(0.0, qq * decay, ss <= tt);
    }
    workgroupBarrier();
    // T = (I - A)^-1: row i from the rows before it.
    for (var i = 1u; i < m; i++) {
        if (j < i) { row_copy[j] = tm[i * CHUNK + j]; }
        workgroupBarrier();
        if (j < i) {
            var v = row_copy[j];
            for (var x = j + 1u; x < i; x++) { v += row_copy[x] * tm[x * CHUNK + j]; }
            tm[i * CHUNK + j] = v;
        }
        workgroupBarrier();
    }
    // This column: y, u = T y (T's unit diagonal added here), the outputs, the new state.
    var u: array<f32, CHUNK>;
    for (var tt = 0u; tt < m; tt++) {
        let at = kv_slot(table, p0 + tt) * IN;
        var ks = 0.0;
        for (var i = 0u; i < HK; i++) { ks += kc[tt * HK + i] * (*s)[i]; }
        u[tt] = bc[tt] * (inputs[at + KD + h * HV + j] - exp(gam[tt]) * ks);
    }
    for (var tt = m; tt > 0u; tt--) {
        let r = tt - 1u;
        var v = u[r];
        for (var x = 0u; x < r; x++) { v += tm[r * CHUNK + x] * u[x]; }
        u[r] = v;
    }
    if (rows) {
        for (var tt = 0u; tt < m; tt++) {
            var qs = 0.0;
            for (var i = 0u; i < HK; i++) { qs += q[(row0 + tt) * KD + kh * HK + i] * (*s)[i]; }
            var o = exp(gam[tt]) * qs;
            for (var x = 0u; x <= tt; x++) { o += qk[tt * CHUNK + x] * u[x]; }
            out[(row0 + tt) * VD + h * HV + j] = o;
        }
    }
    let last = gam[m - 1u];
    for (var i = 0u; i < HK; i++) {
        var v = exp(last) * (*s)[i];
        for (var tt = 0u; tt < m; tt++) { v += kc[tt * HK + i] * exp(last - gam[tt]) * u[tt]; }
        (*s)[i] = v;
    }
    workgroupBarrier();
}
