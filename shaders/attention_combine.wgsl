// Decode attention, pass 2 of 2: merges the splits attention_decode.wgsl wrote for each query
// head. With M the largest split max, out = sum_s exp(m_s - M) mix_s / sum_s exp(m_s - M) l_s.
// The splits are spread over the invocations (M and the denominator by tree reductions; each
// output dimension summed by CS invocations over a CS-th of the splits each), so no invocation
// walks every split alone.
// With SINKS, head h's sink logit (gpt-oss) joins M and the denominator (exp(sink - M), no value).
// Bindings: 0 partials, 1 out (rows of Q_DIM), 2 batch, 3 sinks. Dispatch: (N_HEADS, rows, 1).
// HEAD_DIM, CHUNK, THREADS (a power of two) and the batch's accessors come from the host.

override WINDOW: u32 = 0u;
// Records a query head holds (pass 1's stride): SPLITS, or more for the direct kernel.
override RECORDS: u32 = SPLITS;
const CS = max(THREADS / HEAD_DIM, 1u);

@group(0) @binding(0) var<storage, read> partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> batch: array<u32>;
@group(0) @binding(3) var<storage, read> sinks: array<f32>;
override SINKS: bool = false;

var<workgroup> red: array<f32, THREADS>;

// The workgroup's max (is_max) or sum of v, in every invocation.
fn reduce(v: f32, t: u32, is_max: bool) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = THREADS / 2u; s > 0u; s >>= 1u) {
        if (t < s) { red[t] = select(red[t] + red[t + s], max(red[t], red[t + s]), is_max); }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let row = wg.y;
    // Head h of all the rows' heads: its records, and its output (rows of N_HEADS heads).
    let h = row * nwg.x + wg.x;
    let seq = row_pos(row) + 1u;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    // The splits pass 1 wrote: those holding keys first .. seq - 1.
    let used = splits_used(first, seq);
    let base = h * RECORDS * (HEAD_DIM + 2u);
    var m = -3.0e38;
    for (var c = t; c < used; c += THREADS) { m = max(m, partials[base + c * (HEAD_DIM + 2u) + HEAD_DIM]); }
    m = reduce(m, t, true);
    if (SINKS) { m = max(m, sinks[wg.x]); }
    var l = 0.0;
    for (var c = t; c < used; c += THREADS) {
        let rec = base + c * (HEAD_DIM + 2u);
        l += exp(partials[rec + HEAD_DIM] - m) * partials[rec + HEAD_DIM + 1u];
    }
    l = reduce(l, t, false);
    if (SINKS) { l += exp(sinks[wg.x] - m); }
    // Dimension t % HEAD_DIM (and every THREADS-th after it when the head is wider) over splits
    // t / HEAD_DIM, stepping by CS.
    let split = t / HEAD_DIM;
    var o = 0.0;
    if (split < CS) {
        for (var d = t % HEAD_DIM; d < HEAD_DIM; d += THREADS) {
            o = 0.0;
            for (var c = split; c < used; c += CS) {
                let rec = base + c * (HEAD_DIM + 2u);
                o += exp(partials[rec + HEAD_DIM] - m) * partials[rec + d];
            }
            if (CS == 1u) { out[h * HEAD_DIM + d] = o / l; }
        }
    }
    if (CS > 1u) {
        red[t] = o;
        workgroupBarrier();
        if (t < HEAD_DIM) {
            var sum = 0.0;
            for (var sp = 0u; sp < CS; sp++) { sum += red[sp * HEAD_DIM + t]; }
            out[h * HEAD_DIM + t] = sum / l;
        }
    }
}
