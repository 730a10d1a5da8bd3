// Qwen3.5's Gated DeltaNet before its recurrence (src/arch DeltaNet), in two dispatches over the
// pass's rows, as the short convolution's: without PREP, each row's q|k|v projection (the first
// CONV values of its `proj` row) goes to the layer's convolution input at its position (rows of
// CONV f32, paged by the sequence's block table like the KV cache). With PREP, workgroup
// (y, row): y < KH is key head y, whose q and k channels get the causal depthwise convolution
// over positions pos - L + 1 .. pos (taps oldest first, zero before position 0), SiLU and an L2
// norm (transformers' eps 1e-6), q then divided by sqrt(HK): q into `q` (rows of KD), k into
// the layer's delta-rule inputs at the row's position; y >= KH is value head y - KH, whose v
// channels get the convolution and SiLU into the inputs, and whose g = a * softplus(alpha +
// dt_bias) and beta = sigmoid(b) follow (inputs rows of IN: k (KD), v (VD), g (VH), beta (VH)).
// Bindings: 0 params, 1 proj (rows of PROJ: q|k|v (CONV), z (VD), b (VH), alpha (VH)),
// 2 conv_in, 3 taps (CONV x L f32), 4 inputs, 5 q, 6 dt_bias (VH), 7 a (VH), 8 batch.
// Dispatch: without PREP (ceil(CONV / 64), n_tokens, 1); with (KH + VH, n_tokens, 1).

override PREP: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> proj: array<f32>;
@group(0) @binding(2) var<storage, read_write> conv_in: array<f32>;
@group(0) @binding(3) var<storage, read> taps: array<f32>;
@group(0) @binding(4) var<storage, read_write> inputs: array<f32>;
@group(0) @binding(5) var<storage, read_write> q: array<f32>;
@group(0) @binding(6) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(7) var<storage, read> a: array<f32>;
@group(0) @binding(8) var<storage, read> batch: array<u32>;

const KD: u32 = KH * HK;
const VD: u32 = VH * HV;
const CONV: u32 = 2u * KD + VD;
const PROJ: u32 = CONV + VD + 2u * VH;
const IN: u32 = KD + VD + 2u * VH;

var<workgroup> sums: array<vec2<f32>, 64>;

// Channel c of the row at `pos` after the convolution and SiLU.
fn conv_silu(table: u32, pos: u32, c: u32) -> f32 {
    var s = 0.0;
    for (var j = 0u; j < L; j++) {
        if (pos + j + 1u >= L) {
            s += taps[c * L + j] * conv_in[kv_slot(table, pos + j + 1u - L) * CONV + c];
        }
    }
    return s / (1.0 + exp(-s));
}

fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    return log(1.0 + exp(x));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = wid.y;
    if (t >= params.n_tokens) { return; }
    let pos = row_pos(t);
    let table = row_table(t);
    if (!PREP) {
        let c = wid.x * 64u + lid.x;
        if (c < CONV) {
            conv_in[kv_slot(table, pos) * CONV + c] = proj[t * PROJ + c];
        }
        return;
    }
    let slot = kv_slot(table, pos) * IN;
    let y = wid.x;
    if (y < KH) {
        // Key head y: its q and k channels, each L2-normalized over the head.
        var sq = vec2<f32>(0.0);
        for (var i = lid.x; i < HK; i += 64u) {
            let qv = conv_silu(table, pos, y * HK + i);
            let kv = conv_silu(table, pos, KD + y * HK + i);
            q[t * KD + y * HK + i] = qv;
            inputs[slot + y * HK + i] = kv;
            sq += vec2<f32>(qv * qv, kv * kv);
        }
        sums[lid.x] = sq;
        workgroupBarrier();
        for (var w = 32u; w > 0u; w >>= 1u) {
            if (lid.x < w) { sums[lid.x] += sums[lid.x + w]; }
            workgroupBarrier();
        }
        let inv = inverseSqrt(sums[0] + vec2<f32>(1e-6));
        let q_scale = inv.x / sqrt(f32(HK));
        for (var i = lid.x; i < HK; i += 64u) {
            q[t * KD + y * HK + i] *= q_scale;
            inputs[slot + y * HK + i] *= inv.y;
        }
        return;
    }
    let h = y - KH;
    for (var i = lid.x; i < HV; i += 64u) {
        inputs[slot + KD + h * HV + i] = conv_silu(table, pos, 2u * KD + h * HV + i);
    }
    if (lid.x == 0u) {
        let b = proj[t * PROJ + CONV + VD + h];
        let alpha = proj[t * PROJ + CONV + VD + VH + h];
        inputs[slot + KD + VD + h] = a[h] * softplus(alpha + dt_bias[h]);
        inputs[slot + KD + VD + VH + h] = 1.0 / (1.0 + exp(-b));
    }
}
