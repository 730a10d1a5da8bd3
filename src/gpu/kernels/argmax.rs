//! Wrapper of shaders/argmax.wgsl (greedy decoding on the GPU), and the constraint masks' WGSL
//! that it and the top-k selection read.

use super::{reduce_width, ArgmaxRecords, Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

const ARGMAX: &str = include_str!("../../../shaders/argmax.wgsl");

/// Words of a row's constraint mask (a bit a token, `crate::constraint::Constraint::fill_mask`).
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Bytes of the constraint masks' buffer for steps of up to `rows` decode rows: a flag a row
/// (nonzero: the row is masked), then each row's mask.
pub fn masks_bytes(vocab: usize, rows: usize) -> u64 {
    (rows * (1 + mask_words(vocab))) as u64 * 4
}

/// The constraint masks' buffer of a model whose steps take up to `rows` decode rows (its
/// layout: `masks_bytes(vocab, rows)`).
#[derive(Clone, Copy)]
pub struct Masks<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub rows: usize,
}

/// `row_masked(r)` and `token_allowed(r, i)` over the masks' buffer at `binding` (its layout:
/// `masks_bytes(vocab, rows)`), or, without one, stubs that mask nothing; `MASKED` says which.
pub fn mask_wgsl(binding: Option<(u32, usize)>, vocab: usize) -> String {
    match binding {
        Some((b, rows)) => format!(
            "const MASKED: bool = true;\n\
             @group(0) @binding({b}) var<storage, read> masks: array<u32>;\n\
             fn row_masked(r: u32) -> bool {{ return masks[r] != 0u; }}\n\
             fn token_allowed(r: u32, i: u32) -> bool {{\n\
             \x20   return ((masks[{rows}u + r * {words}u + i / 32u] >> (i % 32u)) & 1u) != 0u;\n\
             }}\n",
            words = mask_words(vocab)
        ),
        None => "const MASKED: bool = false;\n\
                 fn row_masked(r: u32) -> bool { return false; }\n\
                 fn token_allowed(r: u32, i: u32) -> bool { return true; }\n"
            .into(),
    }
}

/// What argmax.wgsl reads: a row's `N` logits.
const ARGMAX_LOGITS: &str = "@group(0) @binding(0) var<storage, read> logits: array<f32>;\n\
    fn value_at(row: u32, i: u32) -> f32 { return logits[row * N + i]; }\n\
    fn token_at(row: u32, i: u32) -> u32 { return i; }\n";

/// What argmax.wgsl reads: a row's `N` records of the lm_head gemv (shaders/gemv_argmax.wgsl).
const ARGMAX_RECORDS: &str = "@group(0) @binding(0) var<storage, read> records: array<vec2<u32>>;\n\
    fn value_at(row: u32, i: u32) -> f32 { return bitcast<f32>(records[row * N + i].x); }\n\
    fn token_at(row: u32, i: u32) -> u32 { return records[row * N + i].y; }\n";

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
    argmax_over(gpu, cache, params, ARGMAX_LOGITS, n, 4, logits, out, max_rows)
}

/// The argmax's second pass over the records an lm_head's `gemv_argmax` wrote (the largest
/// logit of each group of rows, with its token): the same ids into `out` as `argmax` over the
/// logits, non-finite logits flagged alike.
pub fn argmax_records(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    records: ArgmaxRecords,
    out: &wgpu::Buffer,
    max_rows: usize,
) -> Dispatch {
    argmax_over(gpu, cache, params, ARGMAX_RECORDS, records.per_row, 8, records.buffer, out, max_rows)
}

/// argmax.wgsl over `n` values a row of `bytes` each, read as `reads` says.
#[allow(clippy::too_many_arguments)]
fn argmax_over(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    reads: &str,
    n: usize,
    bytes: u64,
    values: &wgpu::Buffer,
    out: &wgpu::Buffer,
    max_rows: usize,
) -> Dispatch {
    let kernel = [&mask_wgsl(None, n), reads, ARGMAX].concat();
    let pipeline =
        cache.get(gpu, "argmax", &kernel, Needs::default(), &[("WG", reduce_width(gpu))], &[("N", n as f64)]);
    let bind_group = gpu.bind_group("argmax", &pipeline, &[values, out, params]);
    let traffic = Traffic { activations: n as u64 * bytes + 4, ..Default::default() };
    Dispatch { label: "argmax", pipeline, bind_group, groups: Groups::fixed(1, max_rows as u32), traffic }
}

/// The argmax again for the rows that `masks` flags, among the tokens each allows (the others
/// keep `out` as it is): encoded for a step's decode rows, after their masks are written.
/// A row's non-finite logits still give 0xffffffff, allowed or not.
pub fn argmax_masked(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    n: usize,
    logits: &wgpu::Buffer,
    out: &wgpu::Buffer,
    masks: Masks,
) -> Dispatch {
    let kernel = [&mask_wgsl(Some((3, masks.rows)), n), ARGMAX_LOGITS, ARGMAX].concat();
    let pipeline =
        cache.get(gpu, "argmax_masked", &kernel, Needs::default(), &[("WG", reduce_width(gpu))], &[("N", n as f64)]);
    let bind_group = gpu.bind_group("argmax_masked", &pipeline, &[logits, out, params, masks.buffer]);
    // Structured output only: the greedy decode ledger never counts it.
    Dispatch {
        label: "argmax_masked",
        pipeline,
        bind_group,
        groups: Groups::per_token(1, 1, 1),
        traffic: Traffic::default(),
    }
}
