// The prefill gemm over f32 activations (appended to gemm.wgsl). GPUs: a workgroup computes
// 64 tokens x 64 rows, stepping through K in blocks of 32 values: the X tile and the
// dequantized W tile go to workgroup memory (k-major, so 4 tokens or 4 rows are one vec4), and
// each invocation accumulates a 4 x 4 block of outputs: 16 multiply-adds per two vec4 loads.
// COLS is a multiple of 8; a last K block past COLS reads zeros.
// DIRECT (CPU adapters): 64 invocations of 8 rows x 8 tokens, read straight from storage with
// no workgroup memory and no barriers; the CPU's caches do the tiling. With NORM_FED
// (shaders/norm_fed.wgsl) each token's sums times its RMS scale, `row_scale` (from the host).
// Binding 2: x (vec4 rows of COLS).

override DIRECT: bool = false;
override NORM_FED: bool = false;
// DIRECT: the 8 rows' weights held in straight-line code (`Gpu::unroll_rows`).
override UNROLL_ROWS: bool = false;

const TK: u32 = 32u;

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

var<workgroup> xs: array<vec4<f32>, 512>;  // [TK][TM / 4]
var<workgroup> ws: array<vec4<f32>, 512>;  // [TK][TN / 4]

// Invocations: 256, or 64 with DIRECT.
override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row0 = wg.x * TN;
    let tok0 = wg.y * TM;
    let n = params.n_tokens;
    // This invocation's outputs: tokens tok0 + ty*4 .. +4, rows row0 + tx*4 .. +4.
    let ty = li / 16u;
    let tx = li % 16u;
    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) { acc[i] = vec4<f32>(0.0); }
    // Loader roles: X values (token lt, k lk .. lk+8) and one W group of 8 (row wr, group wg8).
    let lt = li / 4u;
    let lk = (li % 4u) * 8u;
    let wr = li / 4u;
    let wg8 = li % 4u;
    if (DIRECT) {
        // 8 rows x 8 tokens per invocation (64 of them: WG): each dequantized group of 8
        // weights serves 8 tokens, each x value loaded 8 rows.
        let dx = li % 8u;
        let dy = li / 8u;
        // Invocations whose 8 tokens all lie past the prompt (a short prompt leaves most of the
        // 64-token tile empty) skip the product: the 8 of them that share dy are a SIMD group on
        // a CPU.
        let live = tok0 + dy * 8u < n;
        var acc8: array<array<f32, 8>, 8>;
        if (UNROLL_ROWS) {
            var lo: array<vec4<f32>, 8>;
            var hi: array<vec4<f32>, 8>;
            let b = rows8(row0 + dx * 8u, ROW_COUNT, ROW_WORDS);
            for (var g = 0u; g < select(0u, COLS / 8u, live); g++) {
                let w = dq8x8(b, g);
                for (var i = 0u; i < 8u; i++) {
                    let t = min(tok0 + dy * 8u + i, n - 1u);
                    let d = dot8x8(w, Dq8(x[(t * COLS) / 4u + g * 2u], x[(t * COLS) / 4u + g * 2u + 1u]));
                    lo[i] += d.lo;
                    hi[i] += d.hi;
                }
            }
            for (var i = 0u; i < 8u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc8[i][j] = lo[i][j];
                    acc8[i][j + 4u] = hi[i][j];
                }
            }
        }
        for (var g = 0u; g < select(0u, COLS / 8u, live && !UNROLL_ROWS); g++) {
            var wv: array<Dq8, 8>;
            for (var j = 0u; j < 8u; j++) {
                let r = min(row0 + dx * 8u + j, ROW_COUNT - 1u);
                wv[j] = dq8(r * ROW_WORDS, g);
            }
            for (var i = 0u; i < 8u; i++) {
                let t = min(tok0 + dy * 8u + i, n - 1u);
                let xa = x[(t * COLS) / 4u + g * 2u];
                let xb = x[(t * COLS) / 4u + g * 2u + 1u];
                for (var j = 0u; j < 8u; j++) {
                    acc8[i][j] += dot(wv[j].a, xa) + dot(wv[j].b, xb);
                }
            }
        }
        // The tokens' RMS scales ahead of the stores: a call in their loop would keep LLVM
        // (lavapipe) from unrolling it, and the accumulators would leave the registers.
        var scale: array<f32, 8>;
        for (var i = 0u; i < 8u; i++) {
            scale[i] = 1.0;
            if (NORM_FED) { scale[i] = row_scale(min(tok0 + dy * 8u + i, n - 1u)); }
        }
        for (var i = 0u; i < 8u; i++) {
            let t = tok0 + dy * 8u + i;
            if (t >= n) { break; }
            for (var j = 0u; j < 8u; j++) {
                let r = row0 + dx * 8u + j;
                if (r >= ROW_COUNT) { break; }
                store(t, r, acc8[i][j] * scale[i]);
            }
        }
        return;
    }
    for (var k0 = 0u; k0 < select(COLS, 0u, DIRECT); k0 += TK) {
        let t = tok0 + lt;
        for (var i = 0u; i < 8u; i++) {
            let e = t * COLS + k0 + lk + i;
            xs[(lk + i) * 16u + lt / 4u][lt % 4u] = select(0.0, x[e / 4u][e % 4u], t < n && k0 + lk + i < COLS);
        }
        var v = Dq8(vec4<f32>(0.0), vec4<f32>(0.0));
        if (row0 + wr < ROW_COUNT && k0 + wg8 * 8u < COLS) { v = dq8((row0 + wr) * ROW_WORDS, k0 / 8u + wg8); }
        let kb = wg8 * 8u;
        for (var i = 0u; i < 4u; i++) {
            ws[(kb + i) * 16u + wr / 4u][wr % 4u] = v.a[i];
            ws[(kb + 4u + i) * 16u + wr / 4u][wr % 4u] = v.b[i];
        }
        workgroupBarrier();
        for (var k = 0u; k < TK; k++) {
            let xv = xs[k * 16u + ty];
            let wv = ws[k * 16u + tx];
            acc[0] += xv.x * wv;
            acc[1] += xv.y * wv;
            acc[2] += xv.z * wv;
            acc[3] += xv.w * wv;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = tok0 + ty * 4u + i;
        if (t >= n) { break; }
        for (var j = 0u; j < 4u; j++) {
            let r = row0 + tx * 4u + j;
            if (r >= ROW_COUNT) { break; }
            store(t, r, acc[i][j]);
        }
    }
}
