// A mixture of experts' matrix-vector products: for each token t and each of its USED chosen
// experts j (assignment a = t * USED + j, expert ids[a]), y[a * ROWS + r] = dot(w[expert's row
// r], x[its row]) for r < ROWS, dequantizing on the fly; only the chosen experts' rows are read.
// w stacks COUNT experts of ROWS rows each (ggml's [COLS, ROWS, COUNT] tensor); with PAIR it
// holds the gate experts' rows then the up experts' (2 COUNT ROWS rows) and y gets
// act(gate . x) * (up . x). x's row is the token's (X_PER_TOKEN: gate and up read the token's
// normalized input) or the assignment's own (down reads its expert's hidden vector).
// Bindings: 0 w, 1 x (vec4, rows of COLS), 2 y, 3 ids, 4 params.
// Dispatch: (ceil(ROWS / 64), USED, n_tokens). `dq8` (src/quant) and `act` come from the host.

override COLS: u32;
override ROW_WORDS: u32;
override ROWS: u32;
override COUNT: u32;
override PAIR: bool = false;
override X_PER_TOKEN: bool = true;

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<uniform> params: Params;

fn row_dot(row: u32, x0: u32) -> f32 {
    let base = row * ROW_WORDS;
    var acc = 0.0;
    for (var g = 0u; g < COLS / 8u; g++) {
        let v = dq8(base, g);
        acc += dot(v.a, x[x0 + 2u * g]) + dot(v.b, x[x0 + 2u * g + 1u]);
    }
    return acc;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let t = gid.z;
    if (r >= ROWS || t >= params.n_tokens) { return; }
    let a = t * USED + gid.y;
    let expert = ids[a];
    let x0 = select(a, t, X_PER_TOKEN) * (COLS / 4u);
    let gate = row_dot(expert * ROWS + r, x0);
    if (PAIR) {
        y[a * ROWS + r] = act(gate) * row_dot((COUNT + expert) * ROWS + r, x0);
    } else {
        y[a * ROWS + r] = gate;
    }
}
