// RoPE's rotation of one pair (a, b) — adjacent values or a head's halves — by the angle whose
// (cos, sin) the host's f64 table holds. Shared by rope_kv.wgsl and gemv_rope_kv.wgsl.
fn rope_rotate(a: f32, b: f32, cs: vec2<f32>) -> vec2<f32> {
    return vec2<f32>(a * cs.x - b * cs.y, a * cs.y + b * cs.x);
}
