// Decode attention, pass 2 of 2: merges the chunks attention_decode.wgsl wrote for each query
// head. With M the largest chunk max, out = sum_c exp(m_c - M) mix_c / sum_c exp(m_c - M) l_c.
// Bindings: 0 params, 1 partials, 2 out (Q_DIM). Dispatch: (N_HEADS, 1, 1). HEAD_DIM, CHUNK and
// WG come from the host.

struct Params { n_tokens: u32, start_pos: u32, seq_len: u32, kv_base: u32 }

override MAX_CHUNKS: u32;
override WINDOW: u32 = 0u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> partials: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wg.x;
    let seq = params.seq_len;
    var first = 0u;
    if (WINDOW > 0u && seq > WINDOW) { first = seq - WINDOW; }
    // The chunks pass 1 wrote: those holding keys first .. seq - 1.
    let c0 = first / CHUNK;
    let c1 = (seq - 1u) / CHUNK;
    let base = h * MAX_CHUNKS * (HEAD_DIM + 2u);
    var m = -3.0e38;
    for (var c = c0; c <= c1; c++) { m = max(m, partials[base + c * (HEAD_DIM + 2u) + HEAD_DIM]); }
    var l = 0.0;
    for (var c = c0; c <= c1; c++) {
        let rec = base + c * (HEAD_DIM + 2u);
        l += exp(partials[rec + HEAD_DIM] - m) * partials[rec + HEAD_DIM + 1u];
    }
    for (var d = t; d < HEAD_DIM; d += WG) {
        var o = 0.0;
        for (var c = c0; c <= c1; c++) {
            let rec = base + c * (HEAD_DIM + 2u);
            o += exp(partials[rec + HEAD_DIM] - m) * partials[rec + d];
        }
        out[h * HEAD_DIM + d] = o / l;
    }
}
