//! Wrapper of shaders/top_k.wgsl (sampling's top-k on the GPU).

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// The largest top-k the GPU selects; samplers with a larger one read all the logits back.
pub const MAX_TOP_K: usize = 1024;

/// Words of the selection's output: the count, the tail's sum and the largest |logit|, then
/// (id, logit bits) pairs.
pub const TOP_K_WORDS: usize = 3 + 2 * MAX_TOP_K;

/// The `want[0]` largest of `n` logits into `out` (`TOP_K_WORDS` words); with `tail`, also
/// what a top-p/min-p sampler needs of the rest at temperature `want[1]` (`sampling::Tail`).
pub fn top_k(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    n: usize,
    tail: bool,
    logits: &wgpu::Buffer,
    want: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [("N", n as f64), ("TAIL", tail as u32 as f64)];
    let pipeline =
        cache.get(gpu, "top_k", include_str!("../../../shaders/top_k.wgsl"), Needs::default(), &[], &overrides);
    let bind_group = gpu.bind_group("top_k", &pipeline, &[logits, want, out]);
    // Sampling only: the greedy decode ledger never counts it.
    Dispatch { label: "top_k", pipeline, bind_group, groups: Groups::fixed(1, 1), traffic: Traffic::default() }
}
