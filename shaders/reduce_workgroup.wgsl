// Row reduction through workgroup memory (adapters without subgroups). Not a kernel: prepended
// to kernels whose 256 invocations form 8 rows of 32 lanes. `row_sum32` returns, in every lane
// of a row, the sum of `v` over that row's 32 lanes.

struct Lane { @builtin(local_invocation_index) li: u32 }

var<workgroup> red: array<f32, 256>;

fn row_sum32(v: f32, lane: Lane) -> f32 {
    let li = lane.li;
    red[li] = v;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if ((li & 31u) < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    let r = red[li & ~31u];
    workgroupBarrier();
    return r;
}
