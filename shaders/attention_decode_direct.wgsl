// Decode attention for CPU adapters (lavapipe, SwiftShader), pass 1 of 2: attention_decode.wgsl's
// split records written with no workgroup memory and no barriers (`split_record`,
// attention_split_record.wgsl). Invocation g of KV head wg.y's workgroups takes split g / GROUP
// and query head g % GROUP of the group: the lanes of a group's heads read the same key and value
// (one address). attention_combine_direct.wgsl merges the records.
// A split is one CHUNK-key tile (CPU adapters split a context into as many as it has), so
// the kernel needs no SPLITS: a query head's records are as many as the dispatch has
// invocations for, nwg.x 64 / GROUP (`kernels::record_splits`): one pipeline, any context.
// Bindings as attention_decode. Dispatch: (ceil(splits GROUP / 64), N_KV_HEADS, rows): lanes past
// the splits holding keys exit at once. HEAD_DIM, CHUNK, `kv_t` and the cache's and batch's
// accessors come from the host.

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let g = wg.x * 64u + li;
    let records = nwg.x * 64u / GROUP;
    if (g / GROUP >= records) { return; }
    split_record(wg.z, wg.y, nwg.y * GROUP, g % GROUP, g / GROUP, records);
}
