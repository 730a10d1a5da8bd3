// Decode attention split over the keys (flash-decoding), pass 1 of 2. One workgroup per
// (chunk of CHUNK keys, KV head) serves every query head of that KV head's group, so each key and
// value of the cache is read once per step, and the work spreads over the context's chunks
// instead of one workgroup per head walking all of it. Per (query head, chunk) it writes the
// chunk's largest score m, the sum l of exp(score - m) and the unnormalized value mix
// sum exp(score - m) v; attention_combine.wgsl merges the chunks (online softmax).
// With WINDOW > 0 the query at seq_len - 1 sees only the last WINDOW keys (a sliding-window layer).
// Bindings: 0 params, 1 qkv (q = first Q_DIM values), 2 k_cache, 3 v_cache,
// 4 partials (N_HEADS x MAX_CHUNKS records of HEAD_DIM + 2). Dispatch: (MAX_CHUNKS, N_KV_HEADS):
// chunks outside the keys seen exit at once. HEAD_DIM, CHUNK, HB and `kv_t` come from the host.

struct Params { n_tokens: u32, start_pos: u32, seq_len: u32, kv_base: u32 }

override KV_DIM: u32;
override GROUP: u32;
override MAX_CHUNKS: u32;
override SCALE: f32;
override WINDOW: u32 = 0u;
const NEG: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<kv_t>;
@group(0) @binding(3) var<storage, read> v_cache: array<kv_t>;
@group(0) @binding(4) var<storage, read_write> partials: array<f32>;

// A batch of HB query heads at a time (all of a group unless it has more).
var<workgroup> q: array<f32, HB * HEAD_DIM>;
var<workgroup> p: array<f32, HB * CHUNK>;
var<workgroup> head_max: array<f32, HB>;

@compute @workgroup_size(CHUNK)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let chunk = wg.x;
    let kvh = wg.y;
    let seq = params.seq_len;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    let lo = max(chunk * CHUNK, first);
    let hi = min(chunk * CHUNK + CHUNK, seq);
    if (lo >= hi) { return; }
    let key = chunk * CHUNK + t;
    let valid = key >= lo && key < hi;
    let kv = kvh * HEAD_DIM;

    for (var h0 = 0u; h0 < GROUP; h0 += HB) {
        let nb = min(HB, GROUP - h0);
        let head0 = kvh * GROUP + h0;
        for (var i = t; i < nb * HEAD_DIM; i += CHUNK) { q[i] = qkv[head0 * HEAD_DIM + i] * SCALE; }
        workgroupBarrier();

        // Scores: invocation t takes key t of the chunk against the batch's heads.
        // Zeroed by hand: a `var` in a loop body is fresh each iteration by the spec, but
        // SwiftShader's WebGPU keeps the last iteration's values.
        var acc: array<f32, HB>;
        for (var j = 0u; j < HB; j++) { acc[j] = 0.0; }
        if (valid) {
            let kb = key * KV_DIM + kv;
            for (var d = 0u; d < HEAD_DIM; d++) {
                let k = k_at(kb + d);
                for (var j = 0u; j < nb; j++) { acc[j] += q[j * HEAD_DIM + d] * k; }
            }
        }
        for (var j = 0u; j < nb; j++) { p[j * CHUNK + t] = select(NEG, acc[j], valid); }
        workgroupBarrier();
        if (t < nb) {
            var m = NEG;
            for (var k = lo - chunk * CHUNK; k < hi - chunk * CHUNK; k++) { m = max(m, p[t * CHUNK + k]); }
            head_max[t] = m;
        }
        workgroupBarrier();
        for (var j = 0u; j < nb; j++) {
            p[j * CHUNK + t] = select(0.0, exp(p[j * CHUNK + t] - head_max[j]), valid);
        }
        workgroupBarrier();

        // Value mix: invocation t takes dimensions t, t + CHUNK, ... of every head in the batch,
        // each value read once for all of them.
        for (var d = t; d < HEAD_DIM; d += CHUNK) {
            var mix: array<f32, HB>;
            for (var j = 0u; j < HB; j++) { mix[j] = 0.0; }
            for (var s = lo; s < hi; s++) {
                let v = v_at(s * KV_DIM + kv + d);
                let k = s - chunk * CHUNK;
                for (var j = 0u; j < nb; j++) { mix[j] += p[j * CHUNK + k] * v; }
            }
            for (var j = 0u; j < nb; j++) {
                partials[((head0 + j) * MAX_CHUNKS + chunk) * (HEAD_DIM + 2u) + d] = mix[j];
            }
        }
        if (t < nb) {
            var l = 0.0;
            for (var k = lo - chunk * CHUNK; k < hi - chunk * CHUNK; k++) { l += p[t * CHUNK + k]; }
            let rec = ((head0 + t) * MAX_CHUNKS + chunk) * (HEAD_DIM + 2u);
            partials[rec + HEAD_DIM] = head_max[t];
            partials[rec + HEAD_DIM + 1u] = l;
        }
        workgroupBarrier();
    }
}
