//! Wrapper of shaders/argmax.wgsl (greedy decoding on the GPU).

use super::{reduce_width, Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// The argmax of each of the pass's rows of `n` logits into `out` (a u32 a row).
pub fn argmax(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    n: usize,
    logits: &wgpu::Buffer,
    out: &wgpu::Buffer,
    max_rows: usize,
) -> Dispatch {
    let pipeline = cache.get(
        gpu,
        "argmax",
        include_str!("../../../shaders/argmax.wgsl"),
        Needs::default(),
        &[("WG", reduce_width(gpu))],
        &[("N", n as f64)],
    );
    let bind_group = gpu.bind_group("argmax", &pipeline, &[logits, out, params]);
    let traffic = Traffic { activations: n as u64 * 4 + 4, ..Default::default() };
    Dispatch { label: "argmax", pipeline, bind_group, groups: Groups::fixed(1, max_rows as u32), traffic }
}
