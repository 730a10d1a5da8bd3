// Soft-capping (Gemma 2): x becomes SOFTCAP * tanh(x / SOFTCAP) when SOFTCAP > 0, else stays x.
// tanh written as 1 - 2 / (exp(2z) + 1), which cannot overflow into NaN for large |z| the way
// a tanh built from exp can.

override SOFTCAP: f32 = 0.0;

fn softcap(x: f32) -> f32 {
    if (SOFTCAP <= 0.0) { return x; }
    let z = clamp(x / SOFTCAP, -20.0, 20.0);
    return SOFTCAP * (1.0 - 2.0 / (exp(2.0 * z) + 1.0));
}
