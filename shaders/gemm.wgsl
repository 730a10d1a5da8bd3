// Tiled matrix-matrix products for prefill, what their kernels share: Y[t][OUT + r] (= or +=)
// dot(w[r], X[t]) for the n_tokens rows of X and the ROW_COUNT weight rows of this part, a
// workgroup a tile of TM tokens x TN rows. The host appends one kernel: gemm_f32.wgsl (X in
// f32) or gemm_int8.wgsl (X as int8 blocks).
// PAIR: the part holds HALF gate rows then HALF up rows; row r >= HALF is written to column
// PAIR_OFFSET + OUT + r - HALF (silu * mul follows in a separate pass).
// EPILOGUE 0: store. 1: add (residual).
// Bindings: 0 params, 1 w, 2 x (the kernel's), 3 y (4: gemm_int8's). Dispatch: (ceil(ROW_COUNT / TN),
// ceil(n_tokens / TM), 1).

override COLS: u32;
override ROW_WORDS: u32;
override ROW_COUNT: u32;
override Y_STRIDE: u32;
override OUT: u32 = 0u;
override EPILOGUE: u32 = 0u;
override PAIR: bool = false;
override HALF: u32 = 0u;
override PAIR_OFFSET: u32 = 0u;

const TM: u32 = 64u;
const TN: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// Output (token t, row r) of this part: its column (a gated pair's second half after
// PAIR_OFFSET) and the epilogue.
fn store(t: u32, r: u32, v: f32) {
    var col = OUT + r;
    if (PAIR && r >= HALF) { col = PAIR_OFFSET + OUT + r - HALF; }
    let o = t * Y_STRIDE + col;
    if (EPILOGUE == 1u) { y[o] = y[o] + v; } else { y[o] = v; }
}
