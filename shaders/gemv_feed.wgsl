// shaders/gemv.wgsl's FEED: a CPU-style residual gemv (EPILOGUE 1, CPU_ROWS = FEED_ROWS rows an
// invocation) whose output goes next through an RMSNorm into another product. Besides y += W x
// it writes that product's input, each new row of y times the norm's weight (binding 3,
// `norm_weights`), and each invocation's sum of its rows' squares (shaders/norm_fed.wgsl): the
// norm's own pass and dispatch go. OUT is a multiple of CPU_ROWS.
// Bindings, after gemv's: 5 feed_x (rows of Y_STRIDE), 6 feed_sums (rows of sums_stride(Y_STRIDE)).

const FEED: bool = true;
const_assert CPU_ROWS == FEED_ROWS;

@group(0) @binding(5) var<storage, read_write> feed_x: array<f32>;
@group(0) @binding(6) var<storage, read_write> feed_sums: array<f32>;

// Row `row` of batch row m's new y, v: the next gemv's input.
fn feed_row(m: u32, row: u32, v: f32) {
    feed_x[m * Y_STRIDE + row] = v * norm_weights(row / 4u)[row % 4u];
}

// The sum of the squares of batch row m's rows part * CPU_ROWS .. + CPU_ROWS - 1.
fn feed_sum(m: u32, part: u32, ss: f32) {
    feed_sums[m * sums_stride(Y_STRIDE) + part] = ss;
}
