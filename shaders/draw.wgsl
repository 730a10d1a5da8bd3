// The seeded draw of a sampler on the GPU, after shaders/top_k.wgsl's selection: what the host's
// `Sampler::sample_top_k` (a top-k sampler) or `Sampler::sample_nucleus` (top-p/min-p without
// top-k, from the largest logits and the tail's sum) does, so that a sampled row reads back its
// token alone and the next step can be submitted before it is read (sampled decoding pipelined
// like greedy).
// Per row, one workgroup: the selection's pairs sorted by logit, largest first (ties to the lower
// id), each divided by T; a logit whose l / T is not finite (for a nucleus row: the largest
// |logit| of the row's vocabulary) leaves the largest alone (all the mass on it); else weights
// exp(l / T - l_max / T); top-p keeps the first whose running weight reaches top_p of the whole
// (with the tail's sum for a nucleus row), min-p those of weight >= min_p; then the token where
// u times the kept weight's sum falls. u is the sampler's next uniform, drawn by the host.
// A nucleus row whose cut the selection cannot place (as `sample_nucleus` says None: the running
// weight reaches the cut within the tail's error bound TAIL_REL_ERROR, or only past the
// selection; min-p alone: its smallest candidate is still kept) gets UNDECIDED instead of a
// token: the host draws from all the logits with the same u.
// Bindings: 0 selection (top_k.wgsl's rows of OUT words: count, tail sum, largest |logit|, then
// the pairs), 1 draws (per row a `Draw`; T 0 = not a drawing row), 2 out (the step's ids: the
// argmax's, 0xffffffff where the logits were not finite, which stays).
// Dispatch: (rows, 1, 1). WG (invocations, a power of two) comes from the host: 256 on GPUs,
// 8 on CPU adapters, where each barrier of the sort switches between all of a workgroup's SIMD
// groups (kernels::reduce_width). N: the vocabulary (a selection of N is the whole row).

struct Draw {
    u: f32,
    t: f32,
    top_p: f32,
    min_p: f32,
    // 1: a top-p/min-p sampler without top-k (the selection has the tail's words).
    nucleus: u32,
}

override OUT: u32;
override N: u32;
override TAIL_REL_ERROR: f32;
const SIZE: u32 = 1024u;
const NONE: u32 = 0xffffffffu;
const UNDECIDED: u32 = 0xfffffffeu;

@group(0) @binding(0) var<storage, read> selection: array<u32>;
@group(0) @binding(1) var<storage, read> draws: array<Draw>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

var<workgroup> ids: array<u32, SIZE>;
var<workgroup> vals: array<f32, SIZE>;
// The row's candidate count (0: not a drawing row), read by every invocation as one.
var<workgroup> row_n: u32;
var<workgroup> overflow: atomic<u32>;

fn non_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u;
}

// Candidate a goes before b: a larger logit, or the same and a lower id; empty slots last.
fn before(a: u32, b: u32) -> bool {
    if (ids[a] == NONE) { return false; }
    if (ids[b] == NONE) { return true; }
    return vals[a] > vals[b] || (vals[a] == vals[b] && ids[a] < ids[b]);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x;
    let d = draws[row];
    let base = row * OUT;
    if (li == 0u) {
        row_n = select(min(selection[base], SIZE), 0u, d.t == 0.0 || out[row] == NONE);
        atomicStore(&overflow, 0u);
    }
    let n = workgroupUniformLoad(&row_n);
    if (n == 0u) { return; }
    let t = d.t;
    var size = 1u;
    while (size < n) { size <<= 1u; }
    for (var i = li; i < size; i += WG) {
        ids[i] = select(NONE, selection[base + 3u + 2u * i], i < n);
        vals[i] = select(0.0, bitcast<f32>(selection[base + 4u + 2u * i]), i < n);
    }
    workgroupBarrier();
    // Bitonic sort of the `size` slots into `before` order.
    for (var k = 2u; k <= size; k <<= 1u) {
        for (var j = k >> 1u; j > 0u; j >>= 1u) {
            for (var i = li; i < size; i += WG) {
                let l = i ^ j;
                if (l > i) {
                    let first = (i & k) == 0u;
                    if ((first && before(l, i)) || (!first && before(i, l))) {
                        let id = ids[i];
                        let v = vals[i];
                        ids[i] = ids[l];
                        vals[i] = vals[l];
                        ids[l] = id;
                        vals[l] = v;
                    }
                }
            }
            workgroupBarrier();
        }
    }
    // The tempered logits' weights, as the host's `temper`.
    let top = vals[0] / t;
    workgroupBarrier();
    for (var i = li; i < n; i += WG) {
        let l = vals[i] / t;
        if (non_finite(l)) { atomicStore(&overflow, 1u); }
        vals[i] = exp(l - top);
    }
    workgroupBarrier();
    if (li != 0u) { return; }
    let nucleus = d.nucleus != 0u;
    if (atomicLoad(&overflow) != 0u || (nucleus && non_finite(bitcast<f32>(selection[base + 2u]) / t))) {
        out[row] = ids[0];
        return;
    }
    // A nucleus row: the weight of the rest of the vocabulary, and whether there is any.
    let tail = select(0.0, bitcast<f32>(selection[base + 1u]), nucleus);
    let complete = n >= N;
    // top-p: the first candidates whose running weight reaches top_p of the whole.
    var keep = n;
    if (d.top_p < 1.0) {
        var z = tail;
        for (var i = 0u; i < n; i++) { z += vals[i]; }
        let goal = d.top_p * z;
        // The tail's error moves the goal within [lo, hi): a running weight there could be cut
        // either side of.
        let err = d.top_p * tail * TAIL_REL_ERROR;
        var mass = 0.0;
        keep = 0u;
        for (var i = 0u; i < n; i++) {
            mass += vals[i];
            if (nucleus && mass >= goal - err && mass < goal + err) {
                out[row] = UNDECIDED;
                return;
            }
            if (mass >= goal) {
                keep = i + 1u;
                break;
            }
        }
        if (keep == 0u) {
            // Not reached: the cut lies past the candidates (or, in a whole row, rounding left
            // it unreached: all are kept).
            if (nucleus && !complete) {
                out[row] = UNDECIDED;
                return;
            }
            keep = n;
        }
    } else if (nucleus && !complete && vals[n - 1u] >= d.min_p) {
        // min-p alone keeps every candidate: more tokens past them may be kept too.
        out[row] = UNDECIDED;
        return;
    }
    // min-p, then the draw over what is kept (the largest always is: its weight is 1).
    var total = 0.0;
    for (var i = 0u; i < keep; i++) {
        if (vals[i] >= d.min_p) { total += vals[i]; }
    }
    var r = d.u * total;
    var id = ids[0];
    for (var i = 0u; i < keep; i++) {
        if (vals[i] >= d.min_p) {
            id = ids[i];
            r -= vals[i];
            if (r < 0.0) { break; }
        }
    }
    out[row] = id;
}
