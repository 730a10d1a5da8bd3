// Decode attention split over the keys (flash-decoding), pass 1 of 2. One workgroup per
// (split of the keys, KV head) serves every query head of that KV head's group, so each key and
// value of the cache is read once per step, and the work spreads over up to SPLITS workgroups a
// KV head instead of one a head walking all of it (shaders/attention_split.wgsl: a split is whole
// tiles of CHUNK keys, more of them as the context grows). The workgroup walks its tiles with an
// online softmax (a running max, sum and value mix per head, rescaled as the max rises) and
// writes per (query head, split) the largest score m, the sum l of exp(score - m) and the
// unnormalized value mix sum exp(score - m) v; attention_combine.wgsl merges the splits.
// Each batch row (z) is one sequence's query at its position p, over keys 0..=p read through its
// block table. With WINDOW > 0 the query sees only the last WINDOW keys (a sliding-window layer).
// With SOFTCAP a score (after the scale) becomes softcap(score) (Gemma 2; shaders/softcap.wgsl).
// Bindings (declared in attention_decode_io.wgsl): 0 qkv (rows of QKV_STRIDE; q = a row's first
// Q_DIM values), 1 k_cache, 2 v_cache, 3 partials (per row, N_HEADS x SPLITS records of
// HEAD_DIM + 2), 4 batch.
// Dispatch: (SPLITS, N_KV_HEADS, rows): splits past the keys seen exit at once. HEAD_DIM,
// CHUNK, HB, THREADS, `kv_t` and the cache's and batch's accessors come from the host.
// THREADS = CHUNK on CPU adapters: an invocation per key, no partial sums. GPUs use more, so
// that no invocation walks a long chain of loads alone: SLICES invocations share a key's score
// (every SLICES-th dimension each), and KS share a value dimension (a KS-th of the keys each),
// their partial sums added through workgroup memory.

const SLICES = THREADS / CHUNK;
const KS = max(THREADS / HEAD_DIM, 1u);
const KEYS_PER_PART = (CHUNK + KS - 1u) / KS;


// A batch of HB query heads at a time (all of a group unless it has more).
var<workgroup> q: array<f32, HB * HEAD_DIM>;
var<workgroup> p: array<f32, HB * CHUNK>;
var<workgroup> head_max: array<f32, HB>;
// Partial sums: of the scores [head][key][slice], then of the value mix [head][split][dim].
var<workgroup> part: array<f32, HB * THREADS>;
// Where each key of the tile starts in the cache (its block's row), looked up once.
var<workgroup> key_row: array<u32, CHUNK>;
// The running value mix of each head of the batch, and the factor exp(old max - new max) that
// rescales it and the running sum when a tile raises the max.
var<workgroup> mix_run: array<f32, HB * HEAD_DIM>;
var<workgroup> sum_run: array<f32, HB>;
var<workgroup> rescale: array<f32, HB>;

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let split = wg.x;
    let kvh = wg.y;
    let row = wg.z;
    let seq = row_pos(row) + 1u;
    let table = row_table(row);
    // This row's records and q.
    let rec0 = row * nwg.y * GROUP * SPLITS;
    let q0 = row * QKV_STRIDE;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    let keys = split_keys(first, seq, split);
    if (keys.x >= keys.y) { return; }
    // The key of a tile this invocation scores (a slice of it).
    let kk = t / SLICES;
    let slice = t % SLICES;
    let kv = kvh * HEAD_DIM;

    for (var h0 = 0u; h0 < GROUP; h0 += HB) {
        let nb = min(HB, GROUP - h0);
        // GPUs loop over every head of a full batch (a constant count: the loops unroll and the
        // private arrays stay in registers), a short last batch's extra sums never stored; CPU
        // adapters (LLVM keeps the arrays cheaply) over the batch's heads alone.
        let hn = select(nb, HB, SLICES > 1u);
        let head0 = kvh * GROUP + h0;
        for (var i = t; i < nb * HEAD_DIM; i += THREADS) {
            q[i] = qkv[q0 + head0 * HEAD_DIM + i] * SCALE;
            mix_run[i] = 0.0;
        }
        if (t < nb) {
            head_max[t] = NEG;
            sum_run[t] = 0.0;
        }

        // ONE_TILE (CPU adapters): a split is always one tile, and the loop's constant single
        // trip folds away (lavapipe runs a loop around barriers with a dynamic count 2x slower).
        let tiles = select((keys.y - keys.x + CHUNK - 1u) / CHUNK, 1u, ONE_TILE);
        for (var tile = 0u; tile < tiles; tile++) {
            let c0 = keys.x + tile * CHUNK;
            let n = min(CHUNK, keys.y - c0);
            for (var i = t; i < CHUNK; i += THREADS) { key_row[i] = kv_slot(table, c0 + min(i, n - 1u)) * KV_DIM + kv; }
            workgroupBarrier();
            let valid = kk < n;

            // Scores of the batch's heads. Zeroed by hand: a `var` in a loop body is fresh each
            // iteration by the spec, but SwiftShader's WebGPU keeps the last iteration's values.
            var acc: array<f32, HB>;
            for (var j = 0u; j < HB; j++) { acc[j] = 0.0; }
            if (valid) {
                let kb = key_row[kk];
                for (var d = slice; d < HEAD_DIM; d += SLICES) {
                    let k = k_at(kb + d);
                    for (var j = 0u; j < hn; j++) { acc[j] += q[j * HEAD_DIM + d] * k; }
                }
            }
            if (SLICES == 1u) {
                for (var j = 0u; j < hn; j++) {
                    if (j < nb) { p[j * CHUNK + kk] = select(NEG, softcap(acc[j]), valid); }
                }
            } else {
                for (var j = 0u; j < hn; j++) {
                    if (j < nb) { part[(j * CHUNK + kk) * SLICES + slice] = acc[j]; }
                }
                workgroupBarrier();
                for (var i = t; i < nb * CHUNK; i += THREADS) {
                    var sum = 0.0;
                    for (var sl = 0u; sl < SLICES; sl++) { sum += part[i * SLICES + sl]; }
                    p[i] = select(NEG, softcap(sum), i % CHUNK < n);
                }
            }
            workgroupBarrier();
            // The running max over this tile too, and the factor that rescales what came before.
            if (t < nb) {
                var m = head_max[t];
                for (var k = 0u; k < n; k++) { m = max(m, p[t * CHUNK + k]); }
                rescale[t] = exp(head_max[t] - m);
                head_max[t] = m;
            }
            workgroupBarrier();
            for (var i = t; i < nb * CHUNK; i += THREADS) {
                p[i] = select(0.0, exp(p[i] - head_max[i / CHUNK]), i % CHUNK < n);
            }
            workgroupBarrier();
            if (t < nb) {
                var l = 0.0;
                for (var k = 0u; k < n; k++) { l += p[t * CHUNK + k]; }
                sum_run[t] = sum_run[t] * rescale[t] + l;
            }

            // Value mix: invocation t takes dimension t % HEAD_DIM (and every THREADS-th after
            // it when the head is wider) over split t / HEAD_DIM of the tile's keys, for every
            // head in the batch: each value read once for all of them.
            let ks = t / HEAD_DIM;
            if (ks < KS) {
                let s0 = min(n, ks * KEYS_PER_PART);
                let s1 = min(n, (ks + 1u) * KEYS_PER_PART);
                for (var d = t % HEAD_DIM; d < HEAD_DIM; d += THREADS) {
                    var mix: array<f32, HB>;
                    for (var j = 0u; j < HB; j++) { mix[j] = 0.0; }
                    for (var s = s0; s < s1; s++) {
                        let v = v_at(key_row[s] + d);
                        for (var j = 0u; j < hn; j++) { mix[j] += p[j * CHUNK + s] * v; }
                    }
                    for (var j = 0u; j < hn; j++) {
                        if (j >= nb) { break; }
                        if (KS == 1u) {
                            let i = j * HEAD_DIM + d;
                            mix_run[i] = mix_run[i] * rescale[j] + mix[j];
                        } else {
                            part[(j * KS + ks) * HEAD_DIM + d] = mix[j];
                        }
                    }
                }
            }
            if (KS > 1u) {
                workgroupBarrier();
                for (var i = t; i < nb * HEAD_DIM; i += THREADS) {
                    let j = i / HEAD_DIM;
                    var sum = 0.0;
                    for (var sp = 0u; sp < KS; sp++) { sum += part[(j * KS + sp) * HEAD_DIM + i % HEAD_DIM]; }
                    mix_run[i] = mix_run[i] * rescale[j] + sum;
                }
            }
            workgroupBarrier();
        }

        for (var i = t; i < nb * HEAD_DIM; i += THREADS) {
            let j = i / HEAD_DIM;
            partials[(rec0 + (head0 + j) * SPLITS + split) * (HEAD_DIM + 2u) + i % HEAD_DIM] = mix_run[i];
        }
        if (t < nb) {
            let rec = (rec0 + (head0 + t) * SPLITS + split) * (HEAD_DIM + 2u);
            partials[rec + HEAD_DIM] = head_max[t];
            partials[rec + HEAD_DIM + 1u] = sum_run[t];
        }
        workgroupBarrier();
    }
}
