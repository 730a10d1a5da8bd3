//! Wrapper of shaders/rope_kv.wgsl, and the RoPE cos/sin table it reads.

use super::{Dispatch, Groups};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;
use crate::model::ModelConfig;

/// (cos, sin) per position and rotated pair, computed in f64: GPU sin/cos of large angles are
/// not accurate enough (Vulkan only bounds their error on [-pi, pi]).
pub fn rope_table(c: &ModelConfig, positions: usize) -> Vec<f32> {
    let inv_freq = crate::model::reference::rope_inv_freq(c);
    let mut table = Vec::with_capacity(positions * inv_freq.len() * 2);
    for pos in 0..positions {
        for &freq in &inv_freq {
            let (sin, cos) = (pos as f64 * freq).sin_cos();
            table.extend([cos as f32, sin as f32]);
        }
    }
    table
}

#[allow(clippy::too_many_arguments)]
pub fn rope_kv(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    c: &ModelConfig,
    qkv: &wgpu::Buffer,
    table: &wgpu::Buffer,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [
        ("HEAD_DIM", c.head_dim as f64),
        ("ROPE_DIM", c.rope_dim as f64),
        ("Q_DIM", c.q_dim() as f64),
        ("KV_DIM", c.kv_dim() as f64),
    ];
    let needs = Needs { kv: true, ..Default::default() };
    let pipeline = cache.get(gpu, "rope_kv", include_str!("../../../shaders/rope_kv.wgsl"), needs, &[], &overrides);
    let bind_group = gpu.bind_group("rope_kv", &pipeline, &[params, qkv, table, k_cache, v_cache]);
    let pairs = (c.q_dim() + 2 * c.kv_dim()) as u32 / 2;
    Dispatch { label: "rope_kv", pipeline, bind_group, groups: Groups::per_token(pairs.div_ceil(64), 1, 1) }
}
