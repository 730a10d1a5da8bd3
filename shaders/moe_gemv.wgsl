// A mixture of experts' matrix-vector products: for each token t and each of its USED chosen
// experts j (assignment a = t * USED + j, expert ids[a]), y[a * ROWS + r] = dot(w[expert's row
// r], x[its row]) for r < ROWS, dequantizing on the fly; only the chosen experts' rows are read.
// w stacks COUNT experts of ROWS rows each (ggml's [COLS, ROWS, COUNT] tensor); with PAIR it
// holds the gate experts' rows then the up experts' (2 COUNT ROWS rows) and y gets
// act(gate . x) * (up . x). x's row is the token's (X_PER_TOKEN: gate and up read the token's
// normalized input) or the assignment's own (down reads its expert's hidden vector).
// With BIAS each expert's bias rows are added (gpt-oss: bias holds the gate experts' then the up
// experts' with PAIR, as w's rows); with OAI, PAIR's activation is gpt-oss's clamped SwiGLU:
// (clamp(up, -LIMIT, LIMIT) + 1) * g * sigmoid(ALPHA g), g = min(gate, LIMIT).
// Bindings: 0 w, 1 x (vec4, rows of COLS), 2 y, 3 ids, 4 params, 5 bias (any buffer without BIAS).
// Dispatch: (ceil(ROWS / 64), USED, n_tokens). `dq8` (src/quant) and `act` come from the host.

override COLS: u32;
override ROW_WORDS: u32;
override ROWS: u32;
override COUNT: u32;
override PAIR: bool = false;
override X_PER_TOKEN: bool = true;
override BIAS: bool = false;
override OAI: bool = false;
override ALPHA: f32 = 1.702;
override LIMIT: f32 = 7.0;

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<uniform> params: Params;
@group(0) @binding(5) var<storage, read> bias: array<f32>;

// Row `row`'s product, plus its bias with BIAS.
fn biased(row: u32, x0: u32) -> f32 {
    return row_dot(row, x0) + select(0.0, bias[row], BIAS);
}

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
    let gate = biased(expert * ROWS + r, x0);
    if (PAIR) {
        let up = biased((COUNT + expert) * ROWS + r, x0);
        if (OAI) {
            let g = min(gate, LIMIT);
            y[a * ROWS + r] = (clamp(up, -LIMIT, LIMIT) + 1.0) * g / (1.0 + exp(-ALPHA * g));
        } else {
            y[a * ROWS + r] = act(gate) * up;
        }
    } else {
        y[a * ROWS + r] = gate;
    }
}
