// Decode attention: one query per head over the cache (seq_len keys, or the last WINDOW of them
// for a sliding-window layer), grouped-query heads.
// One workgroup per head: scores into a scratch buffer, numerically stable softmax (max, exp,
// sum), then the value mix with 256 / HEAD_DIM key slices per output dimension.
// Bindings: 0 params, 1 qkv (q = first Q_DIM values), 2 k_cache, 3 v_cache, 4 scores
// (N_HEADS x CTX), 5 out (Q_DIM). Dispatch: (N_HEADS, 1, 1). `kv_t` comes from the host.

struct Params { n_tokens: u32, start_pos: u32, seq_len: u32, pad: u32 }

override HEAD_DIM: u32;
override KV_DIM: u32;
override GROUP: u32;
override CTX: u32;
override SCALE: f32;
override WINDOW: u32 = 0u;
const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<kv_t>;
@group(0) @binding(3) var<storage, read> v_cache: array<kv_t>;
@group(0) @binding(4) var<storage, read_write> scores: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> q: array<f32, 256>;
var<workgroup> red: array<f32, WG>;

fn reduce(v: f32, li: u32, is_max: bool) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            if (is_max) { red[li] = max(red[li], red[li + s]); } else { red[li] += red[li + s]; }
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg.x;
    let kv = (h / GROUP) * HEAD_DIM;
    let seq = params.seq_len;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    let sbase = h * CTX;
    if (li < HEAD_DIM) { q[li] = qkv[h * HEAD_DIM + li] * SCALE; }
    workgroupBarrier();

    var m = -3.0e38;
    for (var s = first + li; s < seq; s += WG) {
        var acc = 0.0;
        let kb = s * KV_DIM + kv;
        for (var d = 0u; d < HEAD_DIM; d++) { acc += q[d] * f32(k_cache[kb + d]); }
        scores[sbase + s] = acc;
        m = max(m, acc);
    }
    m = reduce(m, li, true);

    var sum = 0.0;
    for (var s = first + li; s < seq; s += WG) {
        let e = exp(scores[sbase + s] - m);
        scores[sbase + s] = e;
        sum += e;
    }
    sum = reduce(sum, li, false);
    storageBarrier();

    let slices = WG / HEAD_DIM;
    let d = li % HEAD_DIM;
    let slice = li / HEAD_DIM;
    var acc = 0.0;
    if (slice < slices) {
        for (var s = first + slice; s < seq; s += slices) {
            acc += scores[sbase + s] * f32(v_cache[s * KV_DIM + kv + d]);
        }
    }
    red[li] = acc;
    workgroupBarrier();
    if (li < HEAD_DIM) {
        var total = 0.0;
        for (var j = 0u; j < slices; j++) { total += red[j * HEAD_DIM + li]; }
        out[h * HEAD_DIM + li] = total / sum;
    }
}
