// The prefill gemm over int8 activations (appended to gemm.wgsl; GPU-style kernels over 32-value
// integer blocks: `kernels::gemm`'s int8 path). X comes as quantize_x.wgsl's records (five
// vec4<u32> a block: two slices of 32 signed bytes, then e and sx as f32 bits), W through
// shaders/quant/int8.wgsl's `q8w` (the block's integers, d and m), and each output sums
// d e sum(q_i (254 xq_i + xr_i)) + m sx over the blocks: the integer sums exact
// (dot4I8Packed), the scales in f32, as the int8 decode gemv.
// A workgroup computes 64 tokens x 64 rows, KB blocks of K (KB x 32 values) a step: each of
// the 256 invocations loads one record into workgroup memory (the first 128 a token's, the
// others a row's; two neighbours take one token's or row's consecutive blocks), then
// accumulates 4 tokens (ty * 4 ..) x 4 rows (tx, tx + 16, ..: a warp's loads of rows are
// consecutive vec4s): 256 dot4I8Packed per 24 vec4 loads. A last step past the row's blocks
// reads zeros.
// Binding 2: xq (the records of the pass's rows, COLS / 32 a row); 4: the weights' buffer
// again, as vec4s (int8.wgsl's `body4`).

@group(0) @binding(2) var<storage, read> xq: array<XRec>;
@group(0) @binding(4) var<storage, read> wv: array<vec4<u32>>;

fn weight_vec(i: u32) -> vec4<u32> { return wv[i]; }

const KB: u32 = 2u;

var<workgroup> xi: array<vec4<u32>, 512>;  // [block][quarter][token]: a record's four vec4s of bytes
var<workgroup> wi: array<vec4<u32>, 256>;  // [block][half][row]: lo, hi
var<workgroup> xsc: array<vec2<f32>, 128>;  // [block][token]: (e, sx)
var<workgroup> wsc: array<vec2<f32>, 128>;  // [block][row]: (d, m)

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row0 = wg.x * TN;
    let tok0 = wg.y * TM;
    let n = params.n_tokens;
    let blocks = COLS / 32u;
    let ty = li / 16u;
    let tx = li % 16u;
    // acc[i][j]: token tok0 + ty * 4 + i, row row0 + tx + 16 j.
    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) { acc[i] = vec4<f32>(0.0); }
    // Loader role: block lb of the step of token (li < 128) or row lr.
    let e = li % 128u;
    let lb = e % KB;
    let lr = e / KB;
    for (var b0 = 0u; b0 < blocks; b0 += KB) {
        let b = b0 + lb;
        if (li < 128u) {
            let t = tok0 + lr;
            var rec = XRec();
            if (t < n && b < blocks) { rec = xq[t * blocks + b]; }
            xi[(lb * 4u) * TM + lr] = rec.xa;
            xi[(lb * 4u + 1u) * TM + lr] = rec.xb;
            xi[(lb * 4u + 2u) * TM + lr] = rec.ra;
            xi[(lb * 4u + 3u) * TM + lr] = rec.rb;
            xsc[lb * TM + lr] = bitcast<vec2<f32>>(rec.s.xy);
        } else {
            let r = row0 + lr;
            var q = Q8W(vec4<u32>(0u), vec4<u32>(0u), 0.0, 0.0);
            if (r < ROW_COUNT && b < blocks) { q = q8w(r * ROW_WORDS, b); }
            wi[(lb * 2u) * TN + lr] = q.lo;
            wi[(lb * 2u + 1u) * TN + lr] = q.hi;
            wsc[lb * TN + lr] = vec2<f32>(q.d, q.m);
        }
        workgroupBarrier();
        for (var k = 0u; k < KB; k++) {
            var xa: array<vec4<u32>, 4>;
            var xb: array<vec4<u32>, 4>;
            var ra: array<vec4<u32>, 4>;
            var rb: array<vec4<u32>, 4>;
            var xs: array<vec2<f32>, 4>;
            for (var i = 0u; i < 4u; i++) {
                let t = ty * 4u + i;
                xa[i] = xi[(k * 4u) * TM + t];
                xb[i] = xi[(k * 4u + 1u) * TM + t];
                ra[i] = xi[(k * 4u + 2u) * TM + t];
                rb[i] = xi[(k * 4u + 3u) * TM + t];
                xs[i] = xsc[k * TM + t];
            }
            for (var j = 0u; j < 4u; j++) {
                let r = tx + 16u * j;
                let ws = wsc[k * TN + r];
                let q = Q8W(wi[(k * 2u) * TN + r], wi[(k * 2u + 1u) * TN + r], ws.x, ws.y);
                for (var i = 0u; i < 4u; i++) {
                    acc[i][j] += q.d * xs[i].x * f32(q8_isum(q, xa[i], xb[i], ra[i], rb[i])) + q.m * xs[i].y;
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = tok0 + ty * 4u + i;
        if (t >= n) { break; }
        for (var j = 0u; j < 4u; j++) {
            let r = row0 + tx + 16u * j;
            if (r < ROW_COUNT) { store(t, r, acc[i][j]); }
        }
    }
}
