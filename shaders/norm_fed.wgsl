// A fed RMSNorm (CPU-style kernels, `kernels::NormIn::Fed`): a product's x is already x times the
// norm's weights, and whatever wrote it (a residual gemv's FEED epilogue, shaders/gemv_feed.wgsl,
// or rms_norm.wgsl's FEED pass) left the sums of the squares of each FEED_ROWS values of x's
// rows, in order; the product multiplies its sums by the row's scale, `fed_scale` (a gemv of a
// sequence's step), or the scale rms_norm.wgsl's FEED pass wrote with it (a gemm, or a gemv of
// several batch rows).
// Every writer sums in the same order and every scale is this function's, so a row gets the
// same bits whichever kernels a pass takes (a gemv or a gemm; a batch or a row alone).
// A row's sums take `sums_stride(its length)` floats, whole vec4s: those past its
// ceil(length / FEED_ROWS) sums are never written, zero from the buffer's creation (WebGPU
// zero-fills), so that the reader loads vec4s (a CPU adapter's invocation would otherwise wait
// on each float in turn).
// COLS, EPS and `norm_sums4(i)` (vec4 i of the sums) come from the kernel that includes this.

const FEED_ROWS: u32 = 8u;

// Floats of a row of `cols` values' sums.
fn sums_stride(cols: u32) -> u32 {
    return (cols + 4u * FEED_ROWS - 1u) / (4u * FEED_ROWS) * 4u;
}

// Batch row m's RMS scale: four running sums (`fed_sums`), in one fixed order, then `fed_rms`.
// A CPU-style gemv adds vec4 i of them in its weight loop's step 4i instead (the loads cost
// less among the weights'), in the same order.
fn fed_scale(m: u32) -> f32 {
    return fed_rms(fed_sums(m));
}

fn fed_sums(m: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    for (var g = 0u; g < COLS / FEED_ROWS; g += 4u) {
        acc += fed_step(m, g);
    }
    return acc;
}

fn fed_rms(acc: vec4<f32>) -> f32 {
    return inverseSqrt(((acc.x + acc.y) + (acc.z + acc.w)) / f32(COLS) + EPS);
}

// The vec4 of batch row m's sums that step g (a multiple of 4) of a loop over COLS / FEED_ROWS
// adds.
fn fed_step(m: u32, g: u32) -> vec4<f32> {
    return norm_sums4(m * (sums_stride(COLS) / 4u) + g / 4u);
}
