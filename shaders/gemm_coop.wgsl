// The prefill gemm on cooperative matrices (appended to gemm.wgsl; natively, where the adapter
// lists CT x CT x CT products of f16 matrices into f32 at subgroup scope: `Gpu::coop`, with CT 16
// (tensor cores on NVIDIA) or 8 (lavapipe). The host declares CT and the types CoopA (X's
// tokens x K), CoopB (K x W's rows) and CoopC (tokens x rows, f32).
// A workgroup computes 64 tokens x 64 rows; each of its (32 / CT)^2 subgroups a 2 CT x 2 CT
// block as 2 x 2 accumulators. K is walked in steps of 32: the X tile (rounded to f16) and the
// dequantized W tile (rounded to f16) go to workgroup memory, two buffers of each so that one
// step's loads overlap the other's products (one barrier a step). The accumulators leave
// through a CT x CT f32 tile of workgroup memory per subgroup, so that the epilogue (store,
// add, a gated pair's columns) and the edges past the prompt or the rows are gemm.wgsl's
// `store`, as in gemm_f32.wgsl.
// f16 holds values up to 65504: an activation past that would become infinite, which the
// tests of the golden models on this path (tests/golden/gpu.rs) would show.
// WG: (32 / CT)^2 subgroups (the host sets it from the adapter's one subgroup size).
// Binding 2: x (vec4 rows of COLS).

override WG: u32 = 128u;

const TK: u32 = 32u;
// Row stride of the X and W tiles in halves: TK plus 8, so that rows start 16 bytes apart in
// different banks and every matrix load starts on a 16-byte boundary.
const LD: u32 = 40u;
const TILE: u32 = 64u * LD;
// Subgroups along a side of the workgroup's tile.
const SIDE: u32 = 32u / CT;

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

var<workgroup> xs: array<f16, 5120>;  // [2][TM][LD]
var<workgroup> ws: array<f16, 5120>;  // [2][TN][LD]
var<workgroup> cs: array<f32, 1024>;  // [SIDE^2 subgroups][CT][CT]

// Step k0's tiles into buffer `buf`: X's 64 tokens x 32 values (zeros past the prompt), W's
// 64 rows x 32 values dequantized (zeros past the rows); both zeros past COLS (a multiple of 8).
fn load_tiles(buf: u32, k0: u32, tok0: u32, row0: u32, li: u32) {
    let n = params.n_tokens;
    for (var i = li; i < TM * TK / 4u; i += WG) {
        let t = i / (TK / 4u);
        let k = (i % (TK / 4u)) * 4u;
        var v = vec4<f32>(0.0);
        if (tok0 + t < n && k0 + k < COLS) { v = x[((tok0 + t) * COLS + k0 + k) / 4u]; }
        let o = buf * TILE + t * LD + k;
        xs[o] = f16(v.x);
        xs[o + 1u] = f16(v.y);
        xs[o + 2u] = f16(v.z);
        xs[o + 3u] = f16(v.w);
    }
    for (var i = li; i < TN * TK / 8u; i += WG) {
        let r = i / (TK / 8u);
        let g = i % (TK / 8u);
        var d = Dq8(vec4<f32>(0.0), vec4<f32>(0.0));
        if (row0 + r < ROW_COUNT && k0 + g * 8u < COLS) { d = dq8((row0 + r) * ROW_WORDS, k0 / 8u + g); }
        let o = buf * TILE + r * LD + g * 8u;
        for (var j = 0u; j < 4u; j++) {
            ws[o + j] = f16(d.a[j]);
            ws[o + 4u + j] = f16(d.b[j]);
        }
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let row0 = wg.x * TN;
    let tok0 = wg.y * TM;
    // This subgroup's block: tokens qt .. qt + 2 CT, rows qr .. qr + 2 CT of the tile.
    let qt = (sg / SIDE) * 2u * CT;
    let qr = (sg % SIDE) * 2u * CT;
    var c00 = CoopC();
    var c01 = CoopC();
    var c10 = CoopC();
    var c11 = CoopC();
    load_tiles(0u, 0u, tok0, row0, li);
    workgroupBarrier();
    let steps = (COLS + TK - 1u) / TK;
    for (var s = 0u; s < steps; s++) {
        let buf = s % 2u;
        // The next step's tiles into the other buffer, whose last readers finished before the
        // barrier that ended the previous step.
        if (s + 1u < steps) { load_tiles(1u - buf, (s + 1u) * TK, tok0, row0, li); }
        for (var kk = 0u; kk < TK; kk += CT) {
            let xo = buf * TILE + qt * LD + kk;
            let wo = buf * TILE + qr * LD + kk;
            // X row-major (token t, k at t LD + k); W's rows are B's columns (k, row r at r LD + k).
            let a0 = coopLoadT<CoopA>(&xs[xo], LD);
            let a1 = coopLoadT<CoopA>(&xs[xo + CT * LD], LD);
            let b0 = coopLoad<CoopB>(&ws[wo], LD);
            let b1 = coopLoad<CoopB>(&ws[wo + CT * LD], LD);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
        }
        workgroupBarrier();
    }
    // Each accumulator through this subgroup's CT x CT tile of cs to the epilogue.
    let n = params.n_tokens;
    let own = sg * CT * CT;
    for (var q = 0u; q < 4u; q++) {
        var c = c00;
        if (q == 1u) { c = c01; }
        if (q == 2u) { c = c10; }
        if (q == 3u) { c = c11; }
        coopStoreT(c, &cs[own], CT);
        workgroupBarrier();
        for (var e = lane; e < CT * CT; e += sg_size) {
            let t = tok0 + qt + (q / 2u) * CT + e / CT;
            let r = row0 + qr + (q % 2u) * CT + e % CT;
            if (t < n && r < ROW_COUNT) { store(t, r, cs[own + e]); }
        }
        workgroupBarrier();
    }
}
