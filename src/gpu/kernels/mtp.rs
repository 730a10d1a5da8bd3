//! Wrappers of Qwen3.5's MTP head's own kernels: the model's final hidden states kept per
//! position and gathered back (shaders/hidden.wgsl), and the head's input rows
//! (shaders/concat_rows.wgsl).

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// Each row of `x`, RMS-normed with `norm`, into `hidden` at its position (`gather` false); or
/// each row's position's hidden state into row t of `out` (`gather` true).
#[allow(clippy::too_many_arguments)]
pub fn hidden(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    d: usize,
    eps: f32,
    gather: bool,
    x: &wgpu::Buffer,
    norm: &wgpu::Buffer,
    hidden: &wgpu::Buffer,
    out: &wgpu::Buffer,
    batch: &wgpu::Buffer,
) -> Dispatch {
    let needs = Needs { batch: true, ..Default::default() };
    let overrides = [("D", d as f64), ("EPS", eps as f64), ("GATHER", gather as u32 as f64)];
    let pipeline = cache.get(gpu, "hidden", include_str!("../../../shaders/hidden.wgsl"), needs, &[], &overrides);
    let bind_group = gpu.bind_group("hidden", &pipeline, &[params, x, norm, hidden, out, batch]);
    let row = 4 * d as u64;
    let traffic = Traffic { weights: if gather { 0 } else { row }, activations: 2 * row, ..Default::default() };
    let label = if gather { "mtp_gather" } else { "mtp_hidden" };
    Dispatch { label, pipeline, bind_group, groups: Groups::per_token(1, 1, 1), traffic }
}

/// Rows of `a` then `b` (d values each) into rows of 2 d.
pub fn concat_rows(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    d: usize,
    a: &wgpu::Buffer,
    b: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/concat_rows.wgsl");
    let pipeline = cache.get(gpu, "concat_rows", source, Needs::default(), &[], &[("D", d as f64)]);
    let bind_group = gpu.bind_group("concat_rows", &pipeline, &[params, a, b, out]);
    let traffic = Traffic { activations: 16 * d as u64, ..Default::default() };
    Dispatch {
        label: "concat_rows",
        pipeline,
        bind_group,
        groups: Groups::per_token((2 * d as u32).div_ceil(64), 1, 1),
        traffic,
    }
}
