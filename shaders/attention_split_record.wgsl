// Decode attention's split records on CPU adapters (attention_decode_direct.wgsl, and
// attention_decode_one.wgsl at short contexts), with no workgroup memory and no barriers. A CPU
// runs a workgroup's invocations as the lanes of SIMD registers, and a barrier splits the shader
// into pieces run one after another for every lane group (SwiftShader switches coroutines at
// each); here an invocation walks the keys of one split for one query head alone: their scores,
// the softmax's weights, then the value mix. Each record is the split's largest score m, the sum
// l of exp(score - m) and the unnormalized value mix sum exp(score - m) v, for
// attention_merge.wgsl to merge.
// With WINDOW > 0 the query sees only the last WINDOW keys (a sliding-window layer).
// With SOFTCAP a score (after the scale) becomes softcap(score) (Gemma 2; shaders/softcap.wgsl).

// Row `row`'s record of split `split` (one CHUNK-key tile) for query head `head` of KV head
// `kvh`, at `records` records a head and `heads` query heads a row; nothing past the keys.
fn split_record(row: u32, kvh: u32, heads: u32, group_head: u32, split: u32, records: u32) {
    let head = kvh * GROUP + group_head;
    let seq = row_pos(row) + 1u;
    let table = row_table(row);
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    let x = min(first + split * CHUNK, seq);
    let keys = vec2<u32>(x, min(x + CHUNK, seq));
    if (keys.x >= keys.y) { return; }
    let kv = kvh * HEAD_DIM;

    // The split's scores, then their weights (a split is at most CHUNK keys: a tile on a CPU
    // adapter), then the value mix. Both walk the head's dimensions 4 at a time outside the
    // keys: each q vector is loaded once a split, not once a key, and each key's cache slot is
    // worked out once (`slot`), not again for every 4 dimensions (a third less time in
    // lavapipe at 60-600 keys; SwiftShader the same). Each score still sums its dimensions in
    // order, so the bits are those of a key-at-a-time loop. No private arrays of a head's width:
    // their registers make each pipeline a long compile for a CPU adapter's LLVM (q and the mix
    // held that way made a cold-cache load of Gemma 3 on lavapipe 40% longer and saved no more).
    let qrow = row * QKV_STRIDE + head * HEAD_DIM;
    let n = keys.y - keys.x;
    var slot: array<u32, CHUNK>;
    var p: array<f32, CHUNK>;
    for (var s = 0u; s < n; s++) {
        slot[s] = kv_slot(table, keys.x + s) * KV_DIM + kv;
        p[s] = 0.0;
    }
    for (var d = 0u; d < HEAD_DIM; d += 4u) {
        let q4 = vec4<f32>(qkv[qrow + d], qkv[qrow + d + 1u], qkv[qrow + d + 2u], qkv[qrow + d + 3u]);
        for (var s = 0u; s < n; s++) {
            p[s] += dot(q4, k4_at(slot[s] + d));
        }
    }
    var m = NEG;
    for (var s = 0u; s < n; s++) {
        p[s] = softcap(p[s] * SCALE);
        m = max(m, p[s]);
    }
    var sum = 0.0;
    for (var s = 0u; s < n; s++) {
        p[s] = exp(p[s] - m);
        sum += p[s];
    }
    let rec = ((row * heads + head) * records + split) * (HEAD_DIM + 2u);
    for (var d = 0u; d < HEAD_DIM; d += 4u) {
        var acc = vec4<f32>(0.0);
        for (var s = 0u; s < n; s++) {
            acc += p[s] * v4_at(slot[s] + d);
        }
        partials[rec + d] = acc.x;
        partials[rec + d + 1u] = acc.y;
        partials[rec + d + 2u] = acc.z;
        partials[rec + d + 3u] = acc.w;
    }
    partials[rec + HEAD_DIM] = m;
    partials[rec + HEAD_DIM + 1u] = sum;
}
