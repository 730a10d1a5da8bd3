// A mixture of experts' assignments (token t's j-th chosen expert: a = t * USED + j, expert
// ids[a]) grouped by expert, for `moe_gemv`'s GROUPED form, which reads each chosen expert's rows
// once for all its tokens: starts[e] .. starts[e + 1] of `order` are expert e's assignments (in
// no particular order: each assignment's product is its own). A counting sort: the counts by
// atomics, their running sum by one invocation, then each assignment to its expert's next slot.
// Bindings: 0 params, 1 ids, 2 order (n_tokens x USED u32), 3 starts (COUNT + 1 u32).
// Dispatch: (1, 1, 1), a workgroup of 64.

override COUNT: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> order: array<u32>;
@group(0) @binding(3) var<storage, read_write> starts: array<u32>;

// Each expert's count, then its next free slot in `order`.
var<workgroup> next: array<atomic<u32>, COUNT>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) {
    let n = params.n_tokens * USED;
    for (var e = i; e < COUNT; e += 64u) { atomicStore(&next[e], 0u); }
    workgroupBarrier();
    for (var a = i; a < n; a += 64u) { atomicAdd(&next[ids[a]], 1u); }
    workgroupBarrier();
    if (i == 0u) {
        var at = 0u;
        for (var e = 0u; e < COUNT; e++) {
            starts[e] = at;
            let count = atomicLoad(&next[e]);
            atomicStore(&next[e], at);
            at += count;
        }
        starts[COUNT] = at;
    }
    workgroupBarrier();
    for (var a = i; a < n; a += 64u) { order[atomicAdd(&next[ids[a]], 1u)] = a; }
}
