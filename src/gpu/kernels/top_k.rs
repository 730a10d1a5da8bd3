//! Wrapper of shaders/top_k.wgsl (sampling's top-k on the GPU, a workgroup a row of logits).

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// The largest top-k the GPU selects; samplers with a larger one read all the logits back.
pub const MAX_TOP_K: usize = 1024;

/// Candidates a top-p/min-p sampler takes from the GPU: with the tail's two words, a row's
/// selection is 8 KiB (`NUCLEUS_K` pairs of 8 bytes and 8 bytes of tail), read beside its argmax.
pub const NUCLEUS_K: usize = MAX_TOP_K - 1;

/// What the draw writes for a row whose top-p/min-p cut its selection cannot place
/// (`Sampler::sample_nucleus` would say None): the host draws from all the row's logits.
pub const UNDECIDED: u32 = u32::MAX - 1;

/// Words of a row of the draw's parameters (shaders/draw.wgsl's `Draw`: u, T, top_p, min_p as
/// f32 bits, then 1 for a nucleus row).
pub const DRAW_WORDS: usize = 5;

/// Words of a row's selection: the count, the tail's sum and the largest |logit|, then
/// (id, logit bits) pairs.
pub const TOP_K_WORDS: usize = 3 + 2 * MAX_TOP_K;

/// For each of a pass's rows (its token count) of `n` logits: the `want[2 r]` largest into
/// row r's `TOP_K_WORDS` words of `out` (none when 0); with a temperature's bits in
/// `want[2 r + 1]` (not 0), also what a top-p/min-p sampler needs of the rest
/// (`sampling::Tail`). A row that `masks` flags selects among the tokens its mask allows
/// (`kernels::mask_wgsl`; its k at most their count).
pub fn top_k(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    n: usize,
    logits: &wgpu::Buffer,
    want: &wgpu::Buffer,
    out: &wgpu::Buffer,
    masks: super::Masks,
) -> Dispatch {
    let overrides = [("N", n as f64), ("OUT", TOP_K_WORDS as f64)];
    let kernel = super::mask_wgsl(Some((3, masks.rows)), n) + include_str!("../../../shaders/top_k.wgsl");
    let pipeline = cache.get(gpu, "top_k", &kernel, Needs::default(), &[], &overrides);
    let bind_group = gpu.bind_group("top_k", &pipeline, &[logits, want, out, masks.buffer]);
    // Sampling only: the greedy decode ledger never counts it.
    Dispatch { label: "top_k", pipeline, bind_group, groups: Groups::per_token(1, 0, 1), traffic: Traffic::default() }
}

/// The seeded draw for each of a pass's rows whose `draws` entry has a temperature
/// (shaders/draw.wgsl: `DRAW_WORDS` a row), from its selection in `selection` (`top_k`'s output
/// over `n` logits; a nucleus row's with the tail) into `out` (the step's ids, where the argmax
/// was; a row whose logits were not finite keeps its flag, a nucleus row the selection cannot
/// cut gets `UNDECIDED`).
pub fn draw(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    n: usize,
    selection: &wgpu::Buffer,
    draws: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [("OUT", TOP_K_WORDS as f64), ("N", n as f64), ("TAIL_REL_ERROR", crate::sampling::TAIL_REL_ERROR)];
    let kernel = include_str!("../../../shaders/draw.wgsl");
    let pipeline = cache.get(gpu, "draw", kernel, Needs::default(), &[("WG", super::reduce_width(gpu))], &overrides);
    let bind_group = gpu.bind_group("draw", &pipeline, &[selection, draws, out]);
    // Sampling only: the greedy decode ledger never counts it.
    Dispatch { label: "draw", pipeline, bind_group, groups: Groups::per_token(1, 0, 1), traffic: Traffic::default() }
}
