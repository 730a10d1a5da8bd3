//! Wrapper of shaders/act_mul.wgsl (prefill's gated activation).

use super::{Dispatch, Groups, Traffic};
use crate::arch::Activation;
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

pub fn act_mul(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    act: Activation,
    ffn: usize,
    gu: &wgpu::Buffer,
    h: &wgpu::Buffer,
) -> Dispatch {
    let needs = Needs { act: Some(act), ..Default::default() };
    let pipeline =
        cache.get(gpu, "act_mul", include_str!("../../../shaders/act_mul.wgsl"), needs, &[], &[("FFN", ffn as f64)]);
    let bind_group = gpu.bind_group("act_mul", &pipeline, &[params, gu, h]);
    let traffic = Traffic { activations: 3 * ffn as u64 * 4, ..Default::default() };
    Dispatch {
        label: "act_mul",
        pipeline,
        bind_group,
        groups: Groups::per_token((ffn as u32).div_ceil(64), 1, 1),
        traffic,
    }
}

/// Adds `bias` (d values) to each of the pass's rows of `x` in place (shaders/bias_add.wgsl).
pub fn bias_add(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    d: usize,
    x: &wgpu::Buffer,
    bias: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/bias_add.wgsl");
    let pipeline = cache.get(gpu, "bias_add", source, Needs::default(), &[], &[("D", d as f64)]);
    let bind_group = gpu.bind_group("bias_add", &pipeline, &[params, x, bias]);
    let traffic = Traffic { weights: 4 * d as u64, activations: 8 * d as u64, ..Default::default() };
    Dispatch {
        label: "bias_add",
        pipeline,
        bind_group,
        groups: Groups::per_token((d as u32).div_ceil(64), 1, 1),
        traffic,
    }
}
