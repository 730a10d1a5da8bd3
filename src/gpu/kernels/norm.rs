//! Wrapper of shaders/rms_norm.wgsl.

use super::{Dispatch, Groups};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// RMSNorm of every token's row (`last_only`: only the last token's, into row 0).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    cols: usize,
    eps: f32,
    last_only: bool,
    x: &wgpu::Buffer,
    weight: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [("COLS", cols as f64), ("EPS", eps as f64), ("LAST_ONLY", last_only as u32 as f64)];
    let pipeline =
        cache.get(gpu, "rms_norm", include_str!("../../../shaders/rms_norm.wgsl"), Needs::default(), &[], &overrides);
    let bind_group = gpu.bind_group("rms_norm", &pipeline, &[params, x, weight, out]);
    let groups = if last_only { Groups::fixed(1, 1) } else { Groups::per_token(1, 0, 1) };
    Dispatch { label: "rms_norm", pipeline, bind_group, groups }
}
