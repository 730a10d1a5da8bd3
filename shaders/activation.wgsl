// Gated-FFN activations; the host appends `fn act(x: f32) -> f32` choosing one (src/arch).

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

// GELU, tanh approximation: 0.5 x (1 + tanh(z)) written as x sigmoid(2z), which cannot
// overflow into NaN for large |z| the way a tanh built from exp can.
fn gelu_tanh(x: f32) -> f32 {
    let z = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return x / (1.0 + exp(-2.0 * z));
}
