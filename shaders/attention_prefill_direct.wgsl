// Prefill attention for CPU adapters (lavapipe, SwiftShader), which run a workgroup's invocations
// as the lanes of SIMD registers: invocation i is query q0 + i of head wg.y, reading K and V
// straight from the cache with an online softmax, no workgroup memory and no barriers. The lanes
// are consecutive queries of one head at the same key in every step, so each K and V value they
// read is one address for all of them (one load), where the tiled kernel's (attention_prefill)
// K-tile reads gather across lanes and its barriers split the shader on a CPU.
// With WINDOW > 0 a query at p sees keys p - WINDOW + 1 .. p (a sliding-window layer).
// A score (after the scale) goes through softcap (shaders/softcap.wgsl: Gemma 2, else the identity).
// Bindings as attention_prefill. Dispatch: (ceil(n_tokens / 64), N_HEADS, 1). HD, `kv_t` and the
// cache's and batch's accessors come from the host.

override Q_DIM: u32;
override KV_DIM: u32;
override GROUP: u32;
override SCALE: f32;
override WINDOW: u32 = 0u;
override UNIFORM_KEYS: bool = true;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<kv_t>;
@group(0) @binding(3) var<storage, read> v_cache: array<kv_t>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> batch: array<u32>;
// With SINKS, each head's sink logit (gpt-oss): it starts the softmax as a score with no value.
@group(0) @binding(6) var<storage, read> sinks: array<f32>;
override SINKS: bool = false;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n = params.n_tokens;
    let row0 = params.first;
    let start = row_pos(row0);
    let table = row_table(row0);
    let t = wg.x * 64u + li;
    // Lanes past the last query repeat it, in step with the others, and store nothing.
    let tq = min(t, n - 1u);
    let h = wg.y;
    let kv = (h / GROUP) * HD;
    let p = start + tq;
    // q and the output as vec4s: a quarter of the loop steps, and 4 keys per step, so the output
    // is rescaled once per 4 keys.
    var q: array<vec4<f32>, HD / 4u>;
    var o: array<vec4<f32>, HD / 4u>;
    let qrow = (row0 + tq) * (Q_DIM + 2u * KV_DIM) + h * HD;
    for (var d = 0u; d < HD / 4u; d++) {
        let i = qrow + 4u * d;
        q[d] = vec4<f32>(qkv[i], qkv[i + 1u], qkv[i + 2u], qkv[i + 3u]) * SCALE;
        o[d] = vec4<f32>(0.0);
    }
    // Every lane starts at the workgroup's first visible key, so the lanes stay on one key; a
    // key a lane does not see (past its query, before its window) weighs 0, and one past its
    // query is read at its query's position, never past the keys written.
    var first = 0u;
    var k_first = 0u;
    if (WINDOW > 0u && p + 1u > WINDOW) { first = p + 1u - WINDOW; }
    let p0 = start + wg.x * 64u;
    if (WINDOW > 0u && p0 + 1u > WINDOW) { k_first = p0 + 1u - WINDOW; }
    // UNIFORM_KEYS: every lane walks the keys up to the workgroup's last query, so that the
    // key, its row and its loads are the same for all lanes (uniform: one load, not a gather
    // of 64, where the compiler sees it: Mesa 26's lavapipe), and a lane's keys past its own
    // query weigh 0 and leave its sums as they were (a rescale by 1): the same bits. Without
    // it (SwiftShader, which gathers either way) each lane stops at its own query.
    let p_last = select(p, start + min(wg.x * 64u + 63u, n - 1u), UNIFORM_KEYS);
    var m = select(-1.0e30, sinks[h], SINKS);
    var sum = select(0.0, 1.0, SINKS);
    for (var s0 = k_first; s0 <= p_last; s0 += 4u) {
        // The 4 keys' rows in the cache (a key past the workgroup's last query read at that
        // query's row), written out: no loop over them and no picked component, which
        // SwiftShader's Subzero would keep (it unrolls nothing).
        let r = vec4<u32>(kv_slot(table, min(s0, p_last)), kv_slot(table, min(s0 + 1u, p_last)),
                          kv_slot(table, min(s0 + 2u, p_last)), kv_slot(table, min(s0 + 3u, p_last))) * KV_DIM + kv;
        var score = vec4<f32>(0.0);
        for (var d = 0u; d < HD / 4u; d++) {
            let e = 4u * d;
            let qd = q[d];
            score += vec4<f32>(dot(qd, k4_at(r.x + e)), dot(qd, k4_at(r.y + e)), dot(qd, k4_at(r.z + e)),
                               dot(qd, k4_at(r.w + e)));
        }
        let keys = vec4<u32>(s0) + vec4<u32>(0u, 1u, 2u, 3u);
        score = select(vec4<f32>(softcap(score.x), softcap(score.y), softcap(score.z), softcap(score.w)),
                       vec4<f32>(-1.0e30), (keys > vec4<u32>(p)) | (keys < vec4<u32>(first)));
        let m_new = max(m, max(max(score.x, score.y), max(score.z, score.w)));
        let rescale = exp(m - m_new);
        let w = select(vec4<f32>(0.0), exp(score - m_new), score > vec4<f32>(-1.0e29));
        sum = sum * rescale + w.x + w.y + w.z + w.w;
        for (var d = 0u; d < HD / 4u; d++) {
            let e = 4u * d;
            o[d] = o[d] * rescale + w.x * v4_at(r.x + e) + w.y * v4_at(r.y + e) + w.z * v4_at(r.z + e)
                + w.w * v4_at(r.w + e);
        }
        m = m_new;
    }
    if (t < n) {
        for (var d = 0u; d < HD / 4u; d++) {
            let i = (row0 + t) * Q_DIM + h * HD + 4u * d;
            out[i] = o[d].x / sum;
            out[i + 1u] = o[d].y / sum;
            out[i + 2u] = o[d].z / sum;
            out[i + 3u] = o[d].w / sum;
        }
    }
}
