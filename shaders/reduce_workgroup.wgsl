// Row reduction through workgroup memory (adapters without subgroups). Not a kernel: prepended
// to kernels whose 256 invocations form rows of LANES lanes (LANES a power of two, at most 32;
// 1 on CPU adapters, where one invocation owns a row and nothing needs reducing).
// `row_sum` returns, in every lane of a row, the sum of `v` over that row's lanes; `block_sum`
// the sum over the whole workgroup.

struct Lane { @builtin(local_invocation_index) li: u32 }

var<workgroup> red: array<f32, 256>;

fn row_sum(v: f32, lane: Lane) -> f32 {
    if (LANES == 1u) { return v; }
    let li = lane.li;
    red[li] = v;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if ((li & (LANES - 1u)) < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    let r = red[li & ~(LANES - 1u)];
    workgroupBarrier();
    return r;
}

fn block_sum(v: f32, lane: Lane) -> f32 {
    red[lane.li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lane.li < s) { red[lane.li] += red[lane.li + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
