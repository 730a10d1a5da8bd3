//! Wrapper of shaders/short_conv.wgsl (LFM2's gated short convolution).

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// The two dispatches of a short-convolution layer over the pass's rows: each row's B * x
/// into `state` at its position, then C * the convolution into `out` (rows of `d`).
#[allow(clippy::too_many_arguments)]
pub fn short_conv(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    d: usize,
    kernel: usize,
    bcx: &wgpu::Buffer,
    state: &wgpu::Buffer,
    taps: &wgpu::Buffer,
    out: &wgpu::Buffer,
    batch: &wgpu::Buffer,
) -> [Dispatch; 2] {
    let needs = Needs { batch: true, ..Default::default() };
    let source = include_str!("../../../shaders/short_conv.wgsl");
    let row = 4 * d as u64;
    [false, true].map(|apply| {
        let overrides = [("D", d as f64), ("APPLY", apply as u32 as f64)];
        let pipeline = cache.get(gpu, "short_conv", source, needs, &[("L", kernel as u32)], &overrides);
        let bind_group = gpu.bind_group("short_conv", &pipeline, &[params, bcx, state, taps, out, batch]);
        // Writing: B and x read, the state row written. Applying: C read, the last `kernel`
        // positions' state and the taps read, the output written.
        let traffic = match apply {
            false => Traffic { activations: 3 * row, ..Default::default() },
            true => {
                Traffic { weights: row * kernel as u64, activations: (2 + kernel as u64) * row, ..Default::default() }
            }
        };
        let label = if apply { "short_conv" } else { "short_conv_state" };
        Dispatch { label, pipeline, bind_group, groups: Groups::per_token((d as u32).div_ceil(64), 1, 1), traffic }
    })
}
