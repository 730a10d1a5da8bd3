// Decode attention, pass 2 of 2, for CPU adapters (after attention_decode_direct.wgsl):
// attention_combine.wgsl's merge with no workgroup memory and no barriers, which a CPU runs as
// separate shader pieces for every lane group. Invocation i takes output value i of the row's
// heads (head i / HEAD_DIM, dimension i % HEAD_DIM): it finds its head's largest split max M
// and the denominator sum_s exp(m_s - M) l_s itself (the head's HEAD_DIM invocations alike, on
// the same records), and its dimension's sum_s exp(m_s - M) mix_s.
// With SINKS, head h's sink logit joins M and the denominator, as in attention_combine.wgsl.
// Bindings as attention_combine. Dispatch: (ceil(N_HEADS HEAD_DIM / 64), rows, 1).
// HEAD_DIM, CHUNK and the batch's accessors come from the host.

override WINDOW: u32 = 0u;
// Records a query head holds (pass 1's stride: `kernels::record_splits`).
override RECORDS: u32 = SPLITS;
override N_HEADS: u32;
override SINKS: bool = false;

@group(0) @binding(0) var<storage, read> partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> batch: array<u32>;
@group(0) @binding(3) var<storage, read> sinks: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = wg.x * 64u + li;
    if (i >= N_HEADS * HEAD_DIM) { return; }
    let row = wg.y;
    let head = i / HEAD_DIM;
    let d = i % HEAD_DIM;
    let seq = row_pos(row) + 1u;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    let used = splits_used(first, seq);
    let h = row * N_HEADS + head;
    let base = h * RECORDS * (HEAD_DIM + 2u);
    var m = -3.0e38;
    for (var c = 0u; c < used; c++) { m = max(m, partials[base + c * (HEAD_DIM + 2u) + HEAD_DIM]); }
    if (SINKS) { m = max(m, sinks[head]); }
    var l = 0.0;
    var o = 0.0;
    for (var c = 0u; c < used; c++) {
        let rec = base + c * (HEAD_DIM + 2u);
        let e = exp(partials[rec + HEAD_DIM] - m);
        l += e * partials[rec + HEAD_DIM + 1u];
        o += e * partials[rec + d];
    }
    if (SINKS) { l += exp(sinks[head] - m); }
    out[h * HEAD_DIM + d] = o / l;
}
