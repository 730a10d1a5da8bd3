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
// GROUPED (a pass of several tokens): workgroup (row block, expert e) takes expert e's
// assignments (`moe_group`'s order[starts[e] .. starts[e + 1]]), 8 at a time, each weight block
// dequantized once for all of them: an expert's rows are read once for every token that chose
// it (an expert no token chose is not read). Each product sums in the same order as alone.
// Bindings: 0 w, 1 x (vec4, rows of COLS), 2 y, 3 ids, 4 params, 5 bias (any buffer without BIAS),
// 6 order, 7 starts (any buffers without GROUPED).
// Dispatch: (ceil(ROWS / 64), USED, n_tokens); GROUPED: (ceil(ROWS / 64), COUNT, 1). `dq8`
// (src/quant) and `act` come from the host.

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
override GROUPED: bool = false;

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<uniform> params: Params;
@group(0) @binding(5) var<storage, read> bias: array<f32>;
@group(0) @binding(6) var<storage, read> order: array<u32>;
@group(0) @binding(7) var<storage, read> starts: array<u32>;

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

// y's row r of assignment a from its gate (and up) products.
fn store(a: u32, r: u32, gate: f32, up: f32) {
    if (PAIR) {
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

// Row r of expert e for each of its assignments, 8 at a time.
fn grouped(r: u32, e: u32) {
    let end = starts[e + 1u];
    let row_g = e * ROWS + r;
    let row_u = (COUNT + e) * ROWS + r;
    for (var i = starts[e]; i < end; i += 8u) {
        let m = min(8u, end - i);
        var x0: array<u32, 8>;
        for (var k = 0u; k < m; k++) {
            let a = order[i + k];
            x0[k] = select(a, a / USED, X_PER_TOKEN) * (COLS / 4u);
        }
        var acc_g: array<f32, 8>;
        var acc_u: array<f32, 8>;
        for (var g = 0u; g < COLS / 8u; g++) {
            let v = dq8(row_g * ROW_WORDS, g);
            for (var k = 0u; k < m; k++) {
                acc_g[k] += dot(v.a, x[x0[k] + 2u * g]) + dot(v.b, x[x0[k] + 2u * g + 1u]);
            }
            if (PAIR) {
                let u = dq8(row_u * ROW_WORDS, g);
                for (var k = 0u; k < m; k++) {
                    acc_u[k] += dot(u.a, x[x0[k] + 2u * g]) + dot(u.b, x[x0[k] + 2u * g + 1u]);
                }
            }
        }
        for (var k = 0u; k < m; k++) {
            let gate = acc_g[k] + select(0.0, bias[row_g], BIAS);
            let up = acc_u[k] + select(0.0, bias[row_u], BIAS && PAIR);
            store(order[i + k], r, gate, up);
        }
    }
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    if (GROUPED) {
        if (r < ROWS) { grouped(r, gid.y); }
        return;
    }
    let t = gid.z;
    if (r >= ROWS || t >= params.n_tokens) { return; }
    let a = t * USED + gid.y;
    let expert = ids[a];
    let x0 = select(a, t, X_PER_TOKEN) * (COLS / 4u);
    let gate = biased(expert * ROWS + r, x0);
    var up = 0.0;
    if (PAIR) {
        up = biased((COUNT + expert) * ROWS + r, x0);
    }
    store(a, r, gate, up);
}
