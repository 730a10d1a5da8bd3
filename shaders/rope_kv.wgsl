// RoPE and KV-cache write in one pass over the fused q|k|v rows of n_tokens tokens.
// GGUF's llama Q/K rows are permuted so that RoPE rotates adjacent pairs (x[2i], x[2i+1]) of each
// head by angle pos * base^(-2i/ROPE_DIM); cos/sin come from a table computed in f64 at load.
// q is rotated in place; rotated k and plain v go to the cache at position start_pos + t.
// Bindings: 0 params, 1 qkv, 2 rope (vec2 cos,sin per [pos][pair]), 3 k_cache, 4 v_cache.
// Dispatch: (ceil((Q_DIM + 2 KV_DIM) / 2 / 64), n_tokens, 1). `kv_t` (f16 or f32) comes from the host.

struct Params { n_tokens: u32, start_pos: u32, seq_len: u32, pad: u32 }

override HEAD_DIM: u32;
override ROPE_DIM: u32;
override Q_DIM: u32;
override KV_DIM: u32;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> k_cache: array<kv_t>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<kv_t>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = Q_DIM + 2u * KV_DIM;
    let e = gid.x * 2u;
    let t = gid.y;
    if (e >= row || t >= params.n_tokens) { return; }
    let pos = params.start_pos + t;
    let src = t * row + e;
    var a = qkv[src];
    var b = qkv[src + 1u];
    let i = e % HEAD_DIM;
    if (e < Q_DIM + KV_DIM && i < ROPE_DIM) {
        let cs = rope[pos * (ROPE_DIM / 2u) + i / 2u];
        let ra = a * cs.x - b * cs.y;
        b = a * cs.y + b * cs.x;
        a = ra;
    }
    if (e < Q_DIM) {
        qkv[src] = a;
        qkv[src + 1u] = b;
    } else if (e < Q_DIM + KV_DIM) {
        let c = pos * KV_DIM + e - Q_DIM;
        k_cache[c] = kv_t(a);
        k_cache[c + 1u] = kv_t(b);
    } else {
        let c = pos * KV_DIM + e - Q_DIM - KV_DIM;
        v_cache[c] = kv_t(a);
        v_cache[c + 1u] = kv_t(b);
    }
}
