// shaders/gemv.wgsl's ARGMAX: the lm_head gemv writes, for each batch row m and each group of
// its weight rows (a workgroup's 256 / LANES on GPUs, an invocation's CPU_ROWS on CPU adapters),
// the group's largest value and its row (the lowest on ties; a NaN or infinity, where the group
// has one, so that shaders/argmax.wgsl flags it) at records[m * RECORDS + RECORD_OUT + group]:
// the argmax's second pass walks those records instead of the whole vocabulary.
// Binding 5 records. RECORDS (every part's records a row) and RECORD_OUT (this part's first)
// come from the host (kernels::ArgmaxRecords).

const ARGMAX: bool = true;
override RECORDS: u32;
override RECORD_OUT: u32;

@group(0) @binding(5) var<storage, read_write> records: array<vec2<u32>>;

var<workgroup> group_value: array<f32, 256>;
var<workgroup> group_row: array<u32, 256>;

fn argmax_non_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u;
}

fn argmax_store(m: u32, group: u32, v: f32, row: u32) {
    records[m * RECORDS + RECORD_OUT + group] = vec2<u32>(bitcast<u32>(v), OUT + row);
}

// GPU-style kernels: row lr of the workgroup (`has`: its lane 0, below ROW_COUNT) hands its
// value v to the first invocation, which keeps the group's record for batch row m (`store`: m is
// in the batch). Called in uniform control flow: it holds barriers.
fn argmax_rows(m: u32, store: bool, group: u32, lr: u32, has: bool, v: f32, r: u32, li: u32) {
    if (has) {
        group_value[lr] = v;
        group_row[lr] = r;
    }
    workgroupBarrier();
    let per = 256u / LANES;
    let first = group * per;
    if (li == 0u && store && first < ROW_COUNT) {
        let n = min(per, ROW_COUNT - first);
        var bv = group_value[0];
        var bi = group_row[0];
        for (var i = 1u; i < n; i++) {
            let a = group_value[i];
            if (!argmax_non_finite(bv) && (argmax_non_finite(a) || a > bv)) {
                bv = a;
                bi = group_row[i];
            }
        }
        argmax_store(m, group, bv, bi);
    }
    workgroupBarrier();
}
