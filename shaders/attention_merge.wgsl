// Decode attention's merge of a query head's split records on CPU adapters (shared by
// attention_combine_direct.wgsl and attention_decode_one.wgsl): with no workgroup memory, an
// invocation finds the head's largest split max M and the denominator sum_s exp(m_s - M) l_s
// itself (the head's HEAD_DIM invocations alike, on the same records), and its dimension's
// sum_s exp(m_s - M) mix_s. With SINKS, head h's sink logit joins M and the denominator, as in
// attention_combine.wgsl. Reads `partials` and `sinks` as the kernel binds them.

override SINKS: bool = false;

// Dimension d of query head `head`'s output from its `used` records starting at float `base`.
fn merge_value(base: u32, head: u32, d: u32, used: u32) -> f32 {
    var m = -3.0e38;
    for (var c = 0u; c < used; c++) { m = max(m, partials[base + c * (HEAD_DIM + 2u) + HEAD_DIM]); }
    if (SINKS) { m = max(m, sinks[head]); }
    var l = 0.0;
    var o = 0.0;
    for (var c = 0u; c < used; c++) {
        let rec = base + c * (HEAD_DIM + 2u);
        let e = exp(partials[rec + HEAD_DIM] - m);
        l += e * partials[rec + HEAD_DIM + 1u];
        o += e * partials[rec + d];
    }
    if (SINKS) { l += exp(sinks[head] - m); }
    return o / l;
}
