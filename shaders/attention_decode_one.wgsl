// Decode attention in one dispatch for CPU adapters at short contexts, when a KV head's splits
// (one CHUNK-key tile each) fit one workgroup's invocations: every decode row attends over at
// most 64 / GROUP tiles (`kernels::decode_short_keys`; the host records it beside the two-pass
// kernels and takes it while its rows' contexts are that short). Invocation g writes the record
// of split g / GROUP for query head g % GROUP (`split_record`, as attention_decode_direct.wgsl);
// after the one barrier the workgroup merges its heads' records (`merge_value`, as
// attention_combine_direct.wgsl): the same operations in the same order, so the same bits, and a
// dispatch fewer a layer, which is what a decode step's host time is made of.
// Bindings as attention_decode, then the output and the sinks as attention_combine.
// Dispatch: (1, N_KV_HEADS, rows). HEAD_DIM, CHUNK, `kv_t` and the cache's and batch's accessors
// come from the host; SPLITS (attention_split.wgsl) as the combine's.

@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read> sinks: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let records = 64u / GROUP;
    let row = wg.z;
    let kvh = wg.y;
    let heads = nwg.y * GROUP;
    if (li / GROUP < records) {
        split_record(row, kvh, heads, li % GROUP, li / GROUP, records);
    }
    storageBarrier();
    let seq = row_pos(row) + 1u;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    let used = splits_used(first, seq);
    for (var i = li; i < GROUP * HEAD_DIM; i += 64u) {
        let head = kvh * GROUP + i / HEAD_DIM;
        let h = row * heads + head;
        out[h * HEAD_DIM + i % HEAD_DIM] = merge_value(h * records * (HEAD_DIM + 2u), head, i % HEAD_DIM, used);
    }
}
