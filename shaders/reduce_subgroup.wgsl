// Row reduction with subgroup operations, used when every subgroup fits within a row (the host
// checks LANES >= the adapter's largest subgroup). Same contract as reduce_workgroup.wgsl.

struct Lane {
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
}

var<workgroup> red: array<f32, 256>;

// Where every subgroup is a row wide (SUBGROUP_MIN, from the host: the adapter's smallest) one
// subgroupAdd sums a row; narrower subgroups (SwiftShader's 4, Intel's 8 or 16) meet in
// workgroup memory. The choice rests on constants: WGSL's uniformity analysis counts
// subgroup_size as non-uniform, and Chrome rejects a barrier after a branch on it.
fn row_sum(v: f32, lane: Lane) -> f32 {
    if (LANES == 1u) { return v; }
    let s = subgroupAdd(v);
    if (SUBGROUP_MIN >= LANES) { return s; }
    if (lane.sg_lane == 0u) { red[lane.li / lane.sg_size] = s; }
    workgroupBarrier();
    let per_row = LANES / lane.sg_size;
    let first = (lane.li / LANES) * per_row;
    var r = 0.0;
    for (var i = 0u; i < per_row; i++) { r += red[first + i]; }
    workgroupBarrier();
    return r;
}

fn block_sum(v: f32, lane: Lane) -> f32 {
    let s = subgroupAdd(v);
    if (lane.sg_lane == 0u) { red[lane.li / lane.sg_size] = s; }
    workgroupBarrier();
    var r = 0.0;
    for (var i = 0u; i < 256u / lane.sg_size; i++) { r += red[i]; }
    workgroupBarrier();
    return r;
}
