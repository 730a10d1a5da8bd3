//! Wrapper of shaders/softcap_rows.wgsl (final-logit soft-capping, Gemma 2).

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// Soft-caps the pass's rows of `n` logits in place: `params.rows` rows, or every token's with
/// `all_tokens` (at most `max_rows`).
#[allow(clippy::too_many_arguments)]
pub fn softcap_rows(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    n: usize,
    cap: f32,
    all_tokens: bool,
    logits: &wgpu::Buffer,
    max_rows: usize,
) -> Dispatch {
    let needs = Needs { softcap: true, ..Default::default() };
    let overrides = [("N", n as f64), ("SOFTCAP", cap as f64), ("ALL_TOKENS", all_tokens as u32 as f64)];
    let source = include_str!("../../../shaders/softcap_rows.wgsl");
    let pipeline = cache.get(gpu, "softcap_rows", source, needs, &[], &overrides);
    let bind_group = gpu.bind_group("softcap_rows", &pipeline, &[params, logits]);
    // A row's logits read and written.
    let traffic = Traffic { activations: 8 * n as u64, ..Default::default() };
    let groups = Groups::fixed((n as u32).div_ceil(64), max_rows as u32);
    Dispatch { label: "softcap_rows", pipeline, bind_group, groups, traffic }
}
