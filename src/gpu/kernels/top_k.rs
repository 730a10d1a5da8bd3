//! Wrapper of shaders/top_k.wgsl (sampling's top-k on the GPU).

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// The largest top-k the GPU selects; samplers with a larger one read all the logits back.
pub const MAX_TOP_K: usize = 1024;

/// Words of the selection's output: the count, then (id, logit bits) pairs.
pub const TOP_K_WORDS: usize = 1 + 2 * MAX_TOP_K;

/// The `want[0]` largest of `n` logits into `out` (`TOP_K_WORDS` words).
pub fn top_k(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    n: usize,
    logits: &wgpu::Buffer,
    want: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let pipeline =
        cache.get(gpu, "top_k", include_str!("../../../shaders/top_k.wgsl"), Needs::default(), &[], &[("N", n as f64)]);
    let bind_group = gpu.bind_group("top_k", &pipeline, &[logits, want, out]);
    // Sampling only: the greedy decode ledger never counts it.
    Dispatch { label: "top_k", pipeline, bind_group, groups: Groups::fixed(1, 1), traffic: Traffic::default() }
}
