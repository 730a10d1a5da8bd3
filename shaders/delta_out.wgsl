// Qwen3.5's Gated DeltaNet output (src/arch DeltaNet): each value head's output of the delta
// rule, RMSNorm'd (weights of HV, eps EPS) and times silu(z), in place, before `out`'s
// projection. Workgroup (h, row) of 64.
// Bindings: 0 params, 1 y (rows of VD), 2 proj (rows of PROJ: z at CONV), 3 norm (HV f32).
// Dispatch: (VH, n_tokens, 1).

override EPS: f32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> proj: array<f32>;
@group(0) @binding(3) var<storage, read> norm: array<f32>;

const KD: u32 = KH * HK;
const VD: u32 = VH * HV;
const CONV: u32 = 2u * KD + VD;
const PROJ: u32 = CONV + VD + 2u * VH;

var<workgroup> sums: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    if (t >= params.n_tokens) { return; }
    let at = t * VD + h * HV;
    var sq = 0.0;
    for (var i = lid.x; i < HV; i += 64u) {
        sq += y[at + i] * y[at + i];
    }
    sums[lid.x] = sq;
    workgroupBarrier();
    for (var w = 32u; w > 0u; w >>= 1u) {
        if (lid.x < w) { sums[lid.x] += sums[lid.x + w]; }
        workgroupBarrier();
    }
    let inv = inverseSqrt(sums[0] / f32(HV) + EPS);
    for (var i = lid.x; i < HV; i += 64u) {
        let z = proj[t * PROJ + CONV + h * HV + i];
        y[at + i] = norm[i] * (y[at + i] * inv) * (z / (1.0 + exp(-z)));
    }
}
