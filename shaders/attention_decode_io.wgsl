// Decode attention's first pass, the declarations its two kernels share (attention_decode.wgsl,
// tiled, for GPUs; attention_decode_direct.wgsl for CPU adapters): the overrides the host sets
// for both and the bindings. ONE_TILE (a split is always one tile) is the tiled kernel's; the
// direct one walks a split whole either way.

override KV_DIM: u32;
override GROUP: u32;
override QKV_STRIDE: u32;
override SCALE: f32;
override WINDOW: u32 = 0u;
override ONE_TILE: bool = false;
const NEG: f32 = -3.0e38;

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<kv_t>;
@group(0) @binding(2) var<storage, read> v_cache: array<kv_t>;
@group(0) @binding(3) var<storage, read_write> partials: array<f32>;
@group(0) @binding(4) var<storage, read> batch: array<u32>;
