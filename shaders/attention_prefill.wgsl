// Prefill attention, tiled over query and key blocks (flash attention): a workgroup takes BQ
// rows, BQ / HEADS queries of HEADS heads that share a KV head (HEADS = GROUP: each K/V tile read
// serves all of them; 1 where they do not fit), and walks the causal key range in blocks of BK,
// keeping a running max and sum per row (online softmax); invocation d of WG = HD / VPI owns
// output dimensions d, d + WG, ... of the BQ rows. Row r is query r / HEADS of the block, head
// r % HEADS of the workgroup's.
// With WINDOW > 0 a query at p sees keys p - WINDOW + 1 .. p (a sliding-window layer).
// A score (after the scale) goes through softcap (shaders/softcap.wgsl: Gemma 2, else the identity).
// The dispatch's tokens are rows params.first.. of the pass, consecutive positions of one sequence
// (the first row's position and block table): a prefill pass's rows, or a chunk of a round's.
// Bindings: 0 params, 1 qkv (rows of Q_DIM + 2 KV_DIM), 2 k_cache, 3 v_cache, 4 out (rows of Q_DIM),
// 5 batch. Dispatch: (ceil(n_tokens / (BQ / HEADS)), N_HEADS / HEADS, 1). HD, VPI, WG, BQ (at
// most WG), BK, HEADS (dividing BQ), `kv_t` and the cache's and batch's accessors come from the host.

override Q_DIM: u32;
override KV_DIM: u32;
override GROUP: u32;
override SCALE: f32;
override WINDOW: u32 = 0u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<kv_t>;
@group(0) @binding(3) var<storage, read> v_cache: array<kv_t>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> batch: array<u32>;
// With SINKS, each head's sink logit (gpt-oss): it starts the softmax as a score with no value.
@group(0) @binding(6) var<storage, read> sinks: array<f32>;
override SINKS: bool = false;

// Rows of the key and score tiles are padded by one word: the invocations of a warp read keys
// j, j + 1, ... at the same dimension, which with a row stride of HD words (a multiple of the 32
// banks) would all hit one bank.
const KS: u32 = HD + 1u;
const SS: u32 = BK + 1u;

// Queries a block.
const QB: u32 = BQ / HEADS;

var<workgroup> qt: array<f32, BQ * HD>;
var<workgroup> kt: array<f32, BK * KS>;
var<workgroup> vt: array<f32, BK * HD>;
var<workgroup> st: array<f32, BQ * SS>;
var<workgroup> row_max: array<f32, BQ>;
var<workgroup> row_sum: array<f32, BQ>;
var<workgroup> row_scale: array<f32, BQ>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) d: u32) {
    let n = params.n_tokens;
    let row0 = params.first;
    let start = row_pos(row0);
    let table = row_table(row0);
    let q0 = wg.x * QB;
    let h0 = wg.y * HEADS;
    let kv = (h0 / GROUP) * HD;
    let row = Q_DIM + 2u * KV_DIM;
    for (var r = 0u; r < BQ; r++) {
        let t = q0 + r / HEADS;
        let h = h0 + r % HEADS;
        for (var i = d; i < HD; i += WG) {
            qt[r * HD + i] = select(0.0, qkv[(row0 + min(t, n - 1u)) * row + h * HD + i] * SCALE, t < n);
        }
    }
    if (d < BQ) {
        row_max[d] = select(-1.0e30, sinks[h0 + d % HEADS], SINKS);
        row_sum[d] = select(0.0, 1.0, SINKS);
    }
    // Output dimension d + v WG of query r at o[r * VPI + v].
    var o: array<f32, BQ * VPI>;
    for (var r = 0u; r < BQ * VPI; r++) { o[r] = 0.0; }
    let n_keys = start + min(q0 + QB, n);
    // Keys before the first query's window are masked for every query of the block.
    var k_first = 0u;
    if (WINDOW > 0u && start + q0 + 1u > WINDOW) { k_first = start + q0 + 1u - WINDOW; }
    workgroupBarrier();

    for (var k0 = k_first; k0 < n_keys; k0 += BK) {
        for (var j = 0u; j < BK; j++) {
            let s = k0 + j;
            // A key past the last is read at the last (and masked): its block may not exist.
            let c = kv_slot(table, min(s, n_keys - 1u)) * KV_DIM + kv;
            for (var i = d; i < HD; i += WG) {
                kt[j * KS + i] = select(0.0, k_at(c + i), s < n_keys);
                vt[j * HD + i] = select(0.0, v_at(c + i), s < n_keys);
            }
        }
        workgroupBarrier();
        for (var e = d; e < BQ * BK; e += WG) {
            let r = e / BK;
            let j = e % BK;
            var acc = 0.0;
            for (var i = 0u; i < HD; i++) { acc += qt[r * HD + i] * kt[j * KS + i]; }
            let t = q0 + r / HEADS;
            let p = start + t;
            let visible = k0 + j <= p && t < n && (WINDOW == 0u || p - (k0 + j) < WINDOW);
            st[r * SS + j] = select(-1.0e30, softcap(acc), visible);
        }
        workgroupBarrier();
        if (d < BQ) {
            var m = row_max[d];
            for (var j = 0u; j < BK; j++) { m = max(m, st[d * SS + j]); }
            let scale = exp(row_max[d] - m);
            var sum = 0.0;
            for (var j = 0u; j < BK; j++) {
                // A row whose keys are all masked so far (m still the mask value) adds nothing.
                let p = select(0.0, exp(st[d * SS + j] - m), st[d * SS + j] > -1.0e29);
                st[d * SS + j] = p;
                sum += p;
            }
            row_sum[d] = row_sum[d] * scale + sum;
            row_max[d] = m;
            row_scale[d] = scale;
        }
        workgroupBarrier();
        for (var r = 0u; r < BQ; r++) {
            for (var v = 0u; v < VPI; v++) {
                var acc = o[r * VPI + v] * row_scale[r];
                for (var j = 0u; j < BK; j++) { acc += st[r * SS + j] * vt[j * HD + d + v * WG]; }
                o[r * VPI + v] = acc;
            }
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < BQ; r++) {
        let t = q0 + r / HEADS;
        let h = h0 + r % HEADS;
        if (t < n) {
            for (var v = 0u; v < VPI; v++) { out[(row0 + t) * Q_DIM + h * HD + d + v * WG] = o[r * VPI + v] / row_sum[r]; }
        }
    }
}
