// Decode attention, pass 2 of 2, for CPU adapters (after attention_decode_direct.wgsl):
// attention_combine.wgsl's merge with no workgroup memory and no barriers, which a CPU runs as
// separate shader pieces for every lane group. Invocation i takes output value i of the row's
// heads (head i / HEAD_DIM, dimension i % HEAD_DIM): `merge_value` (attention_merge.wgsl).
// Bindings as attention_combine. Dispatch: (ceil(N_HEADS HEAD_DIM / 64), rows, 1).
// HEAD_DIM, CHUNK and the batch's accessors come from the host.

override WINDOW: u32 = 0u;
// Records a query head holds (pass 1's stride: `kernels::record_splits`).
override RECORDS: u32 = SPLITS;
override N_HEADS: u32;

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
    let seq = row_pos(row) + 1u;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    let h = row * N_HEADS + head;
    out[h * HEAD_DIM + i % HEAD_DIM] = merge_value(h * RECORDS * (HEAD_DIM + 2u), head, i % HEAD_DIM, splits_used(first, seq));
}
