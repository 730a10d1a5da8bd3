// Row reduction with subgroup operations (used when the adapter's subgroups are at most 32 wide,
// so a subgroup never spans two rows). Same contract as reduce_workgroup.wgsl.

struct Lane {
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
}

var<workgroup> red: array<f32, 256>;

fn row_sum32(v: f32, lane: Lane) -> f32 {
    let s = subgroupAdd(v);
    if (lane.sg_lane == 0u) { red[lane.li / lane.sg_size] = s; }
    workgroupBarrier();
    let per_row = 32u / lane.sg_size;
    let first = (lane.li / 32u) * per_row;
    var r = 0.0;
    for (var i = 0u; i < per_row; i++) { r += red[first + i]; }
    workgroupBarrier();
    return r;
}
