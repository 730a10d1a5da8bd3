// A mixture of experts' assignments (token t's j-th chosen expert: a = t * USED + j, expert
// ids[a]) grouped by expert, for `moe_gemv`'s GROUPED form, which reads each chosen expert's rows
// once for all its tokens: starts[e] .. starts[e + 1] of `order` are expert e's assignments (in
// order). One invocation: a counting sort of at most MAX_ROWS x USED assignments.
// Bindings: 0 params, 1 ids, 2 order (n_tokens x USED u32), 3 starts (COUNT + 1 u32).
// Dispatch: (1, 1, 1).

override COUNT: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> order: array<u32>;
@group(0) @binding(3) var<storage, read_write> starts: array<u32>;

var<workgroup> taken: array<u32, COUNT>;

@compute @workgroup_size(1)
fn main() {
    let n = params.n_tokens * USED;
    for (var e = 0u; e <= COUNT; e++) { starts[e] = 0u; }
    for (var a = 0u; a < n; a++) { starts[ids[a] + 1u] += 1u; }
    for (var e = 0u; e < COUNT; e++) {
        starts[e + 1u] += starts[e];
        taken[e] = 0u;
    }
    for (var a = 0u; a < n; a++) {
        let e = ids[a];
        order[starts[e] + taken[e]] = a;
        taken[e] += 1u;
    }
}
