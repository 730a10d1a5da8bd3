//! Wrapper of shaders/rms_norm.wgsl.

use super::{reduce_width, Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

const RMS_NORM: &str = include_str!("../../../shaders/rms_norm.wgsl");
pub(crate) const NORM_FED: &str = include_str!("../../../shaders/norm_fed.wgsl");

/// rms_norm.wgsl's FEED: the sums written to binding 4, the rows' scales to binding 5.
const FEED: &str = "@group(0) @binding(4) var<storage, read_write> sums: array<f32>;\n\
    @group(0) @binding(5) var<storage, read_write> scales: array<f32>;\n\
    fn norm_sums4(i: u32) -> vec4<f32> { return vec4<f32>(sums[4u * i], sums[4u * i + 1u], sums[4u * i + 2u], sums[4u * i + 3u]); }\n\
    fn feed_sum(i: u32, ss: f32) { sums[i] = ss; }\n\
    fn feed_scale(row: u32, s: f32) { scales[row] = s; }\n";

/// rms_norm.wgsl without FEED.
const NO_FEED: &str = "fn norm_sums4(i: u32) -> vec4<f32> { return vec4<f32>(); }\n\
    fn feed_sum(i: u32, ss: f32) {}\n\
    fn feed_scale(row: u32, s: f32) {}\n";

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
    norm_pass(gpu, cache, params, cols, eps, mode, None, x, weight, out)
}

/// The RMSNorm ahead of a fed product on CPU-style kernels (shaders/norm_fed.wgsl, `NormIn::Fed`):
/// x times the norm's `weight` into `out`, the sums of x's squares into `sums`
/// (`kernels::feed_sums_bytes`) and each row's RMS scale into `scales` (a float a row: a gemm's,
/// `kernels::gemm_normed`), for every token's row, or with `last_only` the last token's into row 0.
/// The product applies the scale.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_feed(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    cols: usize,
    eps: f32,
    last_only: bool,
    x: &wgpu::Buffer,
    weight: &wgpu::Buffer,
    out: &wgpu::Buffer,
    sums: &wgpu::Buffer,
    scales: &wgpu::Buffer,
) -> Dispatch {
    let mode = if last_only { NormOut::StoreLast } else { NormOut::Store };
    norm_pass(gpu, cache, params, cols, eps, mode, Some((sums, scales)), x, weight, out)
}

/// rms_norm.wgsl's pass, with FEED where `feed` has the sums and scales it writes.
#[allow(clippy::too_many_arguments)]
fn norm_pass(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    cols: usize,
    eps: f32,
    mode: NormOut,
    feed: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
    x: &wgpu::Buffer,
    weight: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [
        ("COLS", cols as f64),
        ("EPS", eps as f64),
        ("LAST_ONLY", (mode == NormOut::StoreLast) as u32 as f64),
        ("ADD", (mode == NormOut::Add) as u32 as f64),
        ("FEED", feed.is_some() as u32 as f64),
    ];
    let source = [RMS_NORM, NORM_FED, if feed.is_some() { FEED } else { NO_FEED }].concat();
    let pipeline = cache.get(gpu, "rms_norm", &source, Needs::default(), &[("WG", reduce_width(gpu))], &overrides);
    let mut buffers = vec![params, x, weight, out];
    buffers.extend(feed.into_iter().flat_map(|(sums, scales)| [sums, scales]));
    let bind_group = gpu.bind_group("rms_norm", &pipeline, &buffers);
    let groups = if mode == NormOut::StoreLast { Groups::fixed(1, 1) } else { Groups::per_token(1, 0, 1) };
    // x and the weights read, the output written (and read first when added to); fed, the sums
    // and the scale written too.
    let f = 4 * cols as u64;
    let written =
        if mode == NormOut::Add { 2 * f } else { f } + feed.map_or(0, |_| super::feed_sums_bytes(1, cols) + 4);
    let traffic = Traffic { weights: f, activations: f + written, ..Default::default() };
    Dispatch { label: "rms_norm", pipeline, bind_group, groups, traffic }
}
