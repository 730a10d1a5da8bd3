// Matrix-vector products for decode: for each of the pass's `params.rows` batch rows m,
// y[m * Y_STRIDE + OUT + r] (= or +=) dot(w[r], x[m]) for the ROW_COUNT weight rows of this part,
// dequantizing on the fly. MB batch rows share each pass over the weights, so a batched step
// reads every weight once per MB sequences (MB = 1 for a single sequence's step). 256 / LANES
// rows per workgroup, LANES lanes per row each taking groups of 8 values, summed with row_sum
// (subgroups when available). GPUs use 32 lanes; CPU adapters 1, so that a row needs no
// reduction and the kernel no barrier (and `cpu_rows` below).
// NORM: x is RMS-normalized on the fly (weights nw, epsilon EPS): every workgroup sums x's squares
// itself, which costs less than a separate normalization pass and its dispatch.
// NORM_FED (CPU adapters, shaders/norm_fed.wgsl; a single batch row): x is x times the norm's
// weights, and binding 3 holds the sums of squares its writer left, which every invocation adds
// up itself for the RMS scale (no barrier). NORM_SCALED: the same x, and binding 3 holds each
// row's scale, worked out by the norm's pass (several rows: each adding its sums would cost more).
// EPILOGUE 0: store. 1: add (residual). 2: gated pair: the part holds ROW_COUNT gate rows then
// ROW_COUNT up rows, and y[OUT + r] = act(gate_r . x) * (up_r . x) (`act` from the host).
// 3: the fused q|k|v rows of a decode step go through `rope_kv_pair` a pair of rows at a time
// (gemv_rope_kv.wgsl: RoPE, then q to y and k, v to the cache; OUT and ROW_COUNT even). The host
// appends `rope_kv_pair`, or an empty one for the other epilogues.
// ARGMAX (the lm_head of a pass that takes its argmax; any epilogue but 3): the argmax's first
// pass as well — each group of rows' largest value, written as a record (value bits, row) for
// shaders/argmax.wgsl to finish. The host appends gemv_argmax.wgsl, or stubs without it.
// FEED (CPU adapters, EPILOGUE 1): the new rows also normalized for the next gemv (NORM_FED)
// as shaders/gemv_feed.wgsl says. The host appends it, or stubs without it.
// CPU adapters (LANES 1) take CPU_ROWS adjacent rows an invocation: lavapipe loads a value once
// per invocation, even one that every invocation shares, so x's loads cost more than the
// weights' unless each serves several rows. A workgroup's 256 rows then take 256 / CPU_ROWS
// invocations; the rest idle (whole SIMD groups of a CPU). CPU_ROWS comes from the host.
// INT8 (GPU-style kernels, 32-value integer blocks: `kernels::gemv_int8`): x comes as
// quantize_x.wgsl's int8 records in binding 3 (normalized there: NORM is off), binding 1 is the
// weights' buffer again, read as vec4s, and each lane takes whole blocks, their products summed
// as integers by dot4I8Packed (shaders/quant/int8.wgsl's `q8w`, `q8_dot_add`).
// Bindings: 0 w, 1 x (vec4 rows of COLS; INT8: w as vec4s), 2 y (rows of Y_STRIDE), 3 nw (the
// norm weights as vec4 bits; INT8: the records; any buffer when neither), 4 params. Dispatch: ceil(ROW_COUNT / (256 / LANES)) workgroups, spread over x and y.
// MB comes from the host.

override COLS: u32;
override ROW_WORDS: u32;
override ROW_COUNT: u32;
override Y_STRIDE: u32;
override OUT: u32 = 0u;
override EPILOGUE: u32 = 0u;
override LANES: u32 = 32u;
override NORM: bool = false;
override NORM_FED: bool = false;
override NORM_SCALED: bool = false;
override EPS: f32 = 0.0;
override INT8: bool = false;
// CPU adapters: a single batch row's CPU_ROWS (8) rows in straight-line code (`cpu_rows8`), and
// several batch rows' from the 8 rows' weights dequantized once a group (`cpu_rows`), for
// adapters that do not unroll loops (SwiftShader; `Gpu::unroll_rows`).
override UNROLL_ROWS: bool = false;
// INT8: x's records a row.
override BLOCKS: u32 = COLS / 32u;

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
// Bindings 1 and 3 come from the host with their accessors (`kernels::GemvProgram`): x and the
// norm weights (`x_vec`, `norm_weights`), or with INT8 the weights again as vec4s and the
// records (`weight_vec`, `x_record`).
@group(0) @binding(4) var<uniform> params: Params;

// EPILOGUE 3: the workgroup's row results, so that a pair's even row sees its partner.
var<workgroup> pair_rows: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lane: Lane) {
    let group = wg.y * nwg.x + wg.x;
    let r = group * (256u / LANES) + lane.li / LANES;
    let k = lane.li & (LANES - 1u);
    let lr = lane.li / LANES;
    let n_rows = params.rows;
    for (var m0 = 0u; m0 < n_rows; m0 += MB) {
        let nb = min(MB, n_rows - m0);
        // GPUs take MB rows every time (a constant count: the accumulators stay in registers),
        // those past the batch computed and never stored; CPU adapters the batch's rows alone.
        let hn = select(MB, nb, LANES == 1u);
        var scale: array<f32, MB>;
        var a: array<f32, MB>;
        var b: array<f32, MB>;
        for (var j = 0u; j < MB; j++) {
            scale[j] = 1.0;
            a[j] = 0.0;
            b[j] = 0.0;
        }
        if (NORM) {
            for (var j = 0u; j < hn; j++) {
                let xo = (m0 + j) * (COLS / 4u);
                var ss = 0.0;
                for (var i = lane.li; i < COLS / 4u; i += 256u) {
                    let v = x_vec(xo + i);
                    ss += dot(v, v);
                }
                scale[j] = inverseSqrt(block_sum(ss, lane) / f32(COLS) + EPS);
            }
        }
        // (CPU adapters: `cpu_rows`, where it costs least.)
        if ((NORM_FED || NORM_SCALED) && LANES > 1u) {
            for (var j = 0u; j < hn; j++) {
                if (NORM_FED) { scale[j] = fed_scale(m0 + j); }
                if (NORM_SCALED) { scale[j] = row_scale(m0 + j); }
            }
        }
        if (LANES == 1u) {
            let r0 = group * 256u + lane.li * CPU_ROWS;
            if (lane.li < 256u / CPU_ROWS && r0 < ROW_COUNT) {
                cpu_rows(r0, m0, nb, scale);
            }
            continue;
        }
        if (INT8 && r < ROW_COUNT) {
            let base = r * ROW_WORDS;
            let rec0 = m0 * BLOCKS;
            for (var blk = k; blk < BLOCKS; blk += LANES) {
                let v = q8w(base, blk);
                var u = v;
                if (EPILOGUE == 2u) { u = q8w(base + ROW_COUNT * ROW_WORDS, blk); }
                // Batch row m0 + j's record of this block.
                var ri = rec0 + blk;
                for (var j = 0u; j < hn; j++) {
                    let rec = x_record(ri);
                    a[j] = q8_dot_add(a[j], v, rec);
                    if (EPILOGUE == 2u) { b[j] = q8_dot_add(b[j], u, rec); }
                    ri += BLOCKS;
                }
            }
        } else if (r < ROW_COUNT) {
            let base = r * ROW_WORDS;
            for (var g = k; g < COLS / 8u; g += LANES) {
                let v = dq8(base, g);
                var u = v;
                if (EPILOGUE == 2u) { u = dq8(base + ROW_COUNT * ROW_WORDS, g); }
                for (var j = 0u; j < hn; j++) {
                    let xv = x_group(m0 + j, g);
                    let xa = xv.a;
                    let xb = xv.b;
                    a[j] += dot(v.a, xa) + dot(v.b, xb);
                    if (EPILOGUE == 2u) { b[j] += dot(u.a, xa) + dot(u.b, xb); }
                }
            }
        }
        for (var j = 0u; j < hn; j++) {
            a[j] = row_sum(a[j], lane) * scale[j];
            if (EPILOGUE == 2u) { b[j] = row_sum(b[j], lane) * scale[j]; }
        }
        for (var j = 0u; j < hn; j++) {
            let m = m0 + j;
            if (EPILOGUE == 3u) {
                if (k == 0u) { pair_rows[lr] = a[j]; }
                workgroupBarrier();
                if (j < nb && k == 0u && r < ROW_COUNT && lr % 2u == 0u) {
                    rope_kv_pair(m, OUT + r, pair_rows[lr], pair_rows[lr + 1u]);
                }
                workgroupBarrier();
            } else if (j < nb && k == 0u && r < ROW_COUNT) {
                let o = m * Y_STRIDE + OUT + r;
                switch EPILOGUE {
                    case 1u: { y[o] = y[o] + a[j]; }
                    case 2u: { y[o] = act(a[j]) * b[j]; }
                    default: { y[o] = a[j]; }
                }
            }
        }
        if (ARGMAX) {
            for (var j = 0u; j < hn; j++) {
                argmax_rows(m0 + j, j < nb, group, lr, k == 0u && r < ROW_COUNT, a[j], r, lane.li);
            }
        }
    }
}

// Values 8g .. 8g+7 of batch row m of x, times the norm weights with NORM (the row's RMS scale
// is applied to the sums).
fn x_group(m: u32, g: u32) -> Dq8 {
    let xo = m * (COLS / 4u) + g * 2u;
    var v = Dq8(x_vec(xo), x_vec(xo + 1u));
    if (NORM) {
        v.a *= norm_weights(g * 2u);
        v.b *= norm_weights(g * 2u + 1u);
    }
    return v;
}

// The up rows' dq8x8 for gate|up (EPILOGUE 2); zeros for other matrices, which have none.
fn up8(b: Rows8, g: u32) -> W8 {
    if (EPILOGUE == 2u) { return dq8x8(b, g); }
    return W8();
}

// cpu_rows' sums for batch row m alone and CPU_ROWS 8, the rows written out: rows r0 .. r0 + 3
// and r0 + 4 .. r0 + 7, then (EPILOGUE 2) their up rows, each summed in cpu_rows' order, then
// (NORM_FED) the norm's sums (shaders/norm_fed.wgsl).
fn cpu_rows8(r0: u32, m: u32) -> array<vec4<f32>, 5> {
    // The rows' first words, and their up rows'.
    let b = rows8(r0, ROW_COUNT, ROW_WORDS);
    let up = vec4<u32>(ROW_COUNT * ROW_WORDS);
    let u = Rows8(b.lo + up, b.hi + up);
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    var t0 = vec4<f32>(0.0);
    var t1 = vec4<f32>(0.0);
    var fed = vec4<f32>(0.0);
    for (var g = 0u; g < COLS / 8u; g++) {
        if (NORM_FED && g % 4u == 0u) { fed += fed_step(m, g); }
        let x = x_group(m, g);
        s0 += dot8x4(b.lo, g, x);
        s1 += dot8x4(b.hi, g, x);
        if (EPILOGUE == 2u) {
            t0 += dot8x4(u.lo, g, x);
            t1 += dot8x4(u.hi, g, x);
        }
    }
    return array<vec4<f32>, 5>(s0, s1, t0, t1, fed);
}

// Rows r0 .. r0 + CPU_ROWS - 1 (those below ROW_COUNT stored) for batch rows m0 .. m0 + nb - 1,
// each row's dot product summed in the order the lanes-per-row path sums it.
fn cpu_rows(r0: u32, m0: u32, nb: u32, scale: array<f32, MB>) {
    var acc: array<array<f32, CPU_ROWS>, MB>;
    var acc_up: array<array<f32, CPU_ROWS>, MB>;
    // NORM_FED (a single batch row: the host's): its sums of squares, added in the weight loop
    // (`fed_step`).
    var fed_ss = vec4<f32>(0.0);
    let unrolled = UNROLL_ROWS && nb == 1u && CPU_ROWS == 8u;
    if (unrolled) {
        let s = cpu_rows8(r0, m0);
        fed_ss = s[4];
        for (var i = 0u; i < 4u; i++) {
            acc[0][i] = s[0][i];
            acc[0][i + 4u] = s[1][i];
            acc_up[0][i] = s[2][i];
            acc_up[0][i + 4u] = s[3][i];
        }
    }
    // Rows written out for several batch rows: the 8 rows' weights dequantized once a group,
    // then each batch row's sums (a vector a 4 rows) updated with them.
    let batched = UNROLL_ROWS && MB > 1u && nb > 1u && CPU_ROWS == 8u;
    if (batched) {
        let b = rows8(r0, ROW_COUNT, ROW_WORDS);
        let up = vec4<u32>(ROW_COUNT * ROW_WORDS);
        let ub = Rows8(b.lo + up, b.hi + up);
        var s: array<vec4<f32>, 4 * MB>;
        for (var g = 0u; g < COLS / 8u; g++) {
            let w = dq8x8(b, g);
            let u = up8(ub, g);
            for (var j = 0u; j < nb; j++) {
                let x = x_group(m0 + j, g);
                let d = dot8x8(w, x);
                s[4u * j] += d.lo;
                s[4u * j + 1u] += d.hi;
                if (EPILOGUE == 2u) {
                    let e = dot8x8(u, x);
                    s[4u * j + 2u] += e.lo;
                    s[4u * j + 3u] += e.hi;
                }
            }
        }
        for (var j = 0u; j < nb; j++) {
            for (var i = 0u; i < 4u; i++) {
                acc[j][i] = s[4u * j][i];
                acc[j][i + 4u] = s[4u * j + 1u][i];
                acc_up[j][i] = s[4u * j + 2u][i];
                acc_up[j][i + 4u] = s[4u * j + 3u][i];
            }
        }
    }
    for (var g = 0u; g < select(COLS / 8u, 0u, unrolled || batched); g++) {
        var v: array<Dq8, CPU_ROWS>;
        var u: array<Dq8, CPU_ROWS>;
        for (var i = 0u; i < CPU_ROWS; i++) {
            let base = min(r0 + i, ROW_COUNT - 1u) * ROW_WORDS;
            v[i] = dq8(base, g);
            if (EPILOGUE == 2u) { u[i] = dq8(base + ROW_COUNT * ROW_WORDS, g); }
        }
        if (NORM_FED && g % 4u == 0u) { fed_ss += fed_step(m0, g); }
        for (var j = 0u; j < nb; j++) {
            let xv = x_group(m0 + j, g);
            let xa = xv.a;
            let xb = xv.b;
            for (var i = 0u; i < CPU_ROWS; i++) {
                acc[j][i] += dot(v[i].a, xa) + dot(v[i].b, xb);
                if (EPILOGUE == 2u) { acc_up[j][i] += dot(u[i].a, xa) + dot(u[i].b, xb); }
            }
        }
    }
    for (var j = 0u; j < nb; j++) {
        let m = m0 + j;
        var sj = scale[j];
        if (NORM_FED) { sj = fed_rms(fed_ss); }
        if (NORM_SCALED) { sj = row_scale(m); }
        // FEED: the squares of the rows' new values.
        var ss = 0.0;
        for (var i = 0u; i < CPU_ROWS; i++) {
            if (r0 + i >= ROW_COUNT) { break; }
            let a = acc[j][i] * sj;
            if (EPILOGUE == 3u) {
                // ROW_COUNT and r0 are even: rows i and i + 1 are a pair.
                if (i % 2u == 0u) { rope_kv_pair(m, OUT + r0 + i, a, acc[j][i + 1u] * sj); }
                continue;
            }
            let o = m * Y_STRIDE + OUT + r0 + i;
            switch EPILOGUE {
                case 1u: {
                    let v = y[o] + a;
                    y[o] = v;
                    if (FEED) {
                        feed_row(m, OUT + r0 + i, v);
                        ss += v * v;
                    }
                }
                case 2u: { y[o] = act(a) * (acc_up[j][i] * sj); }
                default: { y[o] = a; }
            }
        }
        if (FEED) { feed_sum(m, (OUT + r0) / CPU_ROWS, ss); }
        if (ARGMAX) {
            // The invocation's rows are a record's (its first the lowest on ties; a non-finite
            // value wins, so that the second pass flags it).
            var bv = acc[j][0] * sj;
            var bi = 0u;
            for (var i = 1u; i < CPU_ROWS; i++) {
                if (r0 + i >= ROW_COUNT) { break; }
                let a = acc[j][i] * sj;
                if (!argmax_non_finite(bv) && (argmax_non_finite(a) || a > bv)) {
                    bv = a;
                    bi = i;
                }
            }
            argmax_store(m, r0 / CPU_ROWS, bv, r0 + bi);
        }
    }
}
