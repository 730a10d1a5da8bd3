// Embedding lookup: x[t] = dequantized row tokens[t] of the embedding table, times SCALE.
// Bindings: 0 params (uniform), 1 w (table rows ROW_START.. of this part), 2 tokens, 3 x (out).
// Dispatch: (ceil(COLS / 8 / WG), n_tokens, 1); one invocation writes 8 values.

override COLS: u32;
override ROW_WORDS: u32;
override ROW_START: u32 = 0u;
override ROW_COUNT: u32;
override WG: u32 = 64u;
override SCALE: f32 = 1.0;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read_write> x: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let g = gid.x;
    let t = gid.y;
    if (g >= COLS / 8u || t >= params.n_tokens) { return; }
    let id = tokens[t];
    if (id < ROW_START || id >= ROW_START + ROW_COUNT) { return; }
    let v = dq8((id - ROW_START) * ROW_WORDS, g);
    let o = (t * COLS) / 4u + g * 2u;
    x[o] = v.a * SCALE;
    x[o + 1u] = v.b * SCALE;
}
