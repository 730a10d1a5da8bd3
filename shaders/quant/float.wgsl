// Unquantized rows: F32 (1 word / value), F16 and BF16 (2 values / word, low half first).

fn dq8_f32(base: u32, g: u32) -> Dq8 {
    let i = base + g * 8u;
    return Dq8(bitcast<vec4<f32>>(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u])),
               bitcast<vec4<f32>>(vec4<u32>(w[i + 4u], w[i + 5u], w[i + 6u], w[i + 7u])));
}

fn dq8_f16(base: u32, g: u32) -> Dq8 {
    let i = base + g * 4u;
    return Dq8(vec4<f32>(unpack2x16float(w[i]), unpack2x16float(w[i + 1u])),
               vec4<f32>(unpack2x16float(w[i + 2u]), unpack2x16float(w[i + 3u])));
}

fn bf16_pair(v: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xffff0000u));
}

fn dq8_bf16(base: u32, g: u32) -> Dq8 {
    let i = base + g * 4u;
    return Dq8(vec4<f32>(bf16_pair(w[i]), bf16_pair(w[i + 1u])), vec4<f32>(bf16_pair(w[i + 2u]), bf16_pair(w[i + 3u])));
}
