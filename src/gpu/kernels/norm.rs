//! Wrapper of shaders/rms_norm.wgsl.

use super::{reduce_width, Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// What an RMSNorm pass writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormOut {
    /// Every token's row.
    Store,
    /// Only the last token's row, into row 0 (for the logits).
    StoreLast,
    /// Every token's row, added to the output (a post-norm before the residual add).
    Add,
}

#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    cols: usize,
    eps: f32,
    mode: NormOut,
    x: &wgpu::Buffer,
    weight: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [
        ("COLS", cols as f64),
        ("EPS", eps as f64),
        ("LAST_ONLY", (mode == NormOut::StoreLast) as u32 as f64),
        ("ADD", (mode == NormOut::Add) as u32 as f64),
    ];
    let source = include_str!("../../../shaders/rms_norm.wgsl");
    let pipeline = cache.get(gpu, "rms_norm", source, Needs::default(), &[("WG", reduce_width(gpu))], &overrides);
    let bind_group = gpu.bind_group("rms_norm", &pipeline, &[params, x, weight, out]);
    let groups = if mode == NormOut::StoreLast { Groups::fixed(1, 1) } else { Groups::per_token(1, 0, 1) };
    // x and the weights read, the output written (and read first when added to).
    let f = 4 * cols as u64;
    let traffic =
        Traffic { weights: f, activations: if mode == NormOut::Add { 3 * f } else { 2 * f }, ..Default::default() };
    Dispatch { label: "rms_norm", pipeline, bind_group, groups, traffic }
}
