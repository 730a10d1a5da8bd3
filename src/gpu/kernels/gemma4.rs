//! Wrappers of Gemma 4's own kernels: its per-layer inputs (shaders/ple_inputs.wgsl), a
//! layer's per-layer embedding gate (shaders/ple_gate.wgsl) and its output scalar
//! (shaders/scale_rows.wgsl).

use super::{Dispatch, Groups, Traffic};
use crate::arch::Activation;
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// Each token's per-layer inputs, in place in `tok` (its token-table rows): `proj` over
/// sqrt(d), RMS-normed per layer with `norm`, plus `tok`, over sqrt(2).
#[allow(clippy::too_many_arguments)]
pub fn ple_inputs(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    layers: usize,
    width: usize,
    d: usize,
    eps: f32,
    proj: &wgpu::Buffer,
    tok: &wgpu::Buffer,
    norm: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/ple_inputs.wgsl");
    let overrides = [("L", layers as f64), ("W", width as f64), ("D", d as f64), ("EPS", eps as f64)];
    let pipeline = cache.get(gpu, "ple_inputs", source, Needs::default(), &[], &overrides);
    let bind_group = gpu.bind_group("ple_inputs", &pipeline, &[params, proj, tok, norm]);
    let all = 4 * (layers * width) as u64;
    let traffic = Traffic { weights: 4 * width as u64, activations: 3 * all, ..Default::default() };
    Dispatch { label: "ple_inputs", pipeline, bind_group, groups: Groups::per_token(layers as u32, 1, 1), traffic }
}

/// Layer `layer`'s per-layer embedding gate: `g` (its inp_gate projection) through `act`, times
/// the layer's per-layer inputs, in place.
#[allow(clippy::too_many_arguments)]
pub fn ple_gate(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    act: Activation,
    layers: usize,
    width: usize,
    layer: usize,
    g: &wgpu::Buffer,
    inputs: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/ple_gate.wgsl");
    let overrides = [("L", layers as f64), ("W", width as f64), ("LAYER", layer as f64)];
    let needs = Needs { act: Some(act), ..Default::default() };
    let pipeline = cache.get(gpu, "ple_gate", source, needs, &[], &overrides);
    let bind_group = gpu.bind_group("ple_gate", &pipeline, &[params, g, inputs]);
    let traffic = Traffic { activations: 3 * 4 * width as u64, ..Default::default() };
    let groups = Groups::per_token((width as u32).div_ceil(64), 1, 1);
    Dispatch { label: "ple_gate", pipeline, bind_group, groups, traffic }
}

/// Each row of `x` (d values) times the scalar in `scale`, in place.
pub fn scale_rows(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    d: usize,
    x: &wgpu::Buffer,
    scale: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/scale_rows.wgsl");
    let pipeline = cache.get(gpu, "scale_rows", source, Needs::default(), &[], &[("D", d as f64)]);
    let bind_group = gpu.bind_group("scale_rows", &pipeline, &[params, x, scale]);
    let traffic = Traffic { weights: 4, activations: 2 * 4 * d as u64, ..Default::default() };
    Dispatch {
        label: "scale_rows",
        pipeline,
        bind_group,
        groups: Groups::per_token((d as u32).div_ceil(64), 1, 1),
        traffic,
    }
}
