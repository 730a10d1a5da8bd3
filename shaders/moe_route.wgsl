// A mixture of experts' router, per token (src/model/cpu.rs `route`, the CPU reference): each of
// its COUNT experts' score — the softmax probability of its router logit, or with SIGMOID the
// logit's sigmoid (LFM2-MoE) — the USED experts with the largest scores (plus, with SELECTION,
// a bias that chooses but does not weigh: LFM2-MoE's; the lowest index first among equals), and
// their weights: their scores, divided by their sum with NORMALIZE, times SCALE.
// With ROUTER_BIAS the router's bias is added to the logits first (gpt-oss).
// Bindings: 0 params, 1 logits (rows of COUNT), 2 ids (rows of USED u32), 3 weights (rows of
// USED f32), 4 bias (COUNT; any buffer without ROUTER_BIAS or SELECTION). Dispatch:
// (ceil(n_tokens / 64), 1, 1): an invocation per token.

override COUNT: u32;
override NORMALIZE: bool = true;
override SCALE: f32 = 1.0;
override ROUTER_BIAS: bool = false;
override SIGMOID: bool = false;
override SELECTION: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> weights: array<f32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;

fn logit(base: u32, e: u32) -> f32 {
    return select(logits[base + e], logits[base + e] + bias[e], ROUTER_BIAS);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x;
    if (t >= params.n_tokens) { return; }
    let base = t * COUNT;
    var m = logit(base, 0u);
    for (var e = 1u; e < COUNT; e++) { m = max(m, logit(base, e)); }
    var sum = 0.0;
    for (var e = 0u; e < COUNT; e++) { sum += exp(logit(base, e) - m); }
    // Experts taken so far, a bit each (COUNT <= 1024).
    var taken: array<u32, 32>;
    for (var i = 0u; i < 32u; i++) { taken[i] = 0u; }
    var p: array<f32, USED>;
    var picked = 0.0;
    for (var j = 0u; j < USED; j++) {
        var best = 0u;
        var best_v = -3.0e38;
        var best_p = 0.0;
        var found = false;
        for (var e = 0u; e < COUNT; e++) {
            let x = logit(base, e);
            let score = select(exp(x - m) / sum, 1.0 / (1.0 + exp(-x)), SIGMOID);
            let v = score + select(0.0, bias[e], SELECTION);
            if ((taken[e / 32u] & (1u << (e % 32u))) == 0u && (!found || v > best_v)) {
                best = e;
                best_v = v;
                best_p = score;
                found = true;
            }
        }
        taken[best / 32u] |= 1u << (best % 32u);
        ids[t * USED + j] = best;
        p[j] = best_p;
        picked += best_p;
    }
    let norm = select(1.0, picked, NORMALIZE);
    for (var j = 0u; j < USED; j++) { weights[t * USED + j] = p[j] / norm * SCALE; }
}
