//! Wrapper of shaders/silu_mul.wgsl (prefill's gated activation).

use super::{Dispatch, Groups};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

pub fn silu_mul(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    ffn: usize,
    gu: &wgpu::Buffer,
    h: &wgpu::Buffer,
) -> Dispatch {
    let pipeline = cache.get(
        gpu,
        "silu_mul",
        include_str!("../../../shaders/silu_mul.wgsl"),
        Needs::default(),
        &[],
        &[("FFN", ffn as f64)],
    );
    let bind_group = gpu.bind_group("silu_mul", &pipeline, &[params, gu, h]);
    Dispatch { label: "silu_mul", pipeline, bind_group, groups: Groups::per_token((ffn as u32).div_ceil(64), 1, 1) }
}
