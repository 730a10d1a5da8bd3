// The decode qkv projection's epilogue (gemv.wgsl EPILOGUE 3), in place of a rope_kv.wgsl pass
// for models whose q and k need only RoPE on adjacent pairs (no bias, no q/k norm): rows 2i and
// 2i + 1 of batch row m's fused q|k|v output, rotated when they are among a q or k head's first
// ROPE_DIM values; q stored to y, k and v written to the cache at the row's position.
// Bindings, after gemv's: 5 rope (vec2 cos,sin per [pos][pair]), 6 k_cache, 7 v_cache, 8 batch.
// HD, ROPE_DIM, Q_DIM, KV_DIM, `kv_t`, the cache's and the batch's accessors come from the host.

@group(0) @binding(5) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> k_cache: array<kv_t>;
@group(0) @binding(7) var<storage, read_write> v_cache: array<kv_t>;
@group(0) @binding(8) var<storage, read> batch: array<u32>;

fn rope_kv_pair(m: u32, row: u32, a: f32, b: f32) {
    let pos = row_pos(m);
    var v = vec2<f32>(a, b);
    let e = row % HD;
    if (row < Q_DIM + KV_DIM && e < ROPE_DIM) { v = rope_rotate(a, b, rope[pos * (ROPE_DIM / 2u) + e / 2u]); }
    if (row < Q_DIM) {
        y[m * Y_STRIDE + row] = v.x;
        y[m * Y_STRIDE + row + 1u] = v.y;
    } else {
        let slot = kv_slot(row_table(m), pos) * KV_DIM;
        if (row < Q_DIM + KV_DIM) {
            store_k(slot + row - Q_DIM, v.x, v.y);
        } else {
            store_v(slot + row - Q_DIM - KV_DIM, v.x, v.y);
        }
    }
}
