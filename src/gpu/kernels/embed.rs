//! Wrapper of shaders/embed.wgsl: embedding lookup over quantized table parts.

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::weights::Linear;
use crate::gpu::Gpu;

const WG: u32 = 64;

/// One dispatch per table part; each writes the rows of the tokens its part holds, times `scale`.
pub fn embed(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    table: &Linear,
    scale: f32,
    tokens: &wgpu::Buffer,
    x: &wgpu::Buffer,
) -> Vec<Dispatch> {
    table
        .parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let overrides = [
                ("COLS", p.cols as f64),
                ("ROW_WORDS", p.row_words as f64),
                ("ROW_START", p.out as f64),
                ("ROW_COUNT", p.rows as f64),
                ("WG", WG as f64),
                ("SCALE", scale as f64),
            ];
            let needs = Needs { weights: Some(p.format), ..Default::default() };
            let pipeline = cache.get(gpu, "embed", include_str!("../../../shaders/embed.wgsl"), needs, &[], &overrides);
            let bind_group = gpu.bind_group("embed", &pipeline, &[params, &p.buffer, tokens, x]);
            let groups = Groups::per_token((p.cols as u32 / 8).div_ceil(WG), 1, 1);
            // One row of one part (the ledger counts it once), the token id, the output row.
            let row = if i == 0 { p.row_words as u64 * 4 } else { 0 };
            let traffic = Traffic { weights: row, activations: 4 + 4 * p.cols as u64, ..Default::default() };
            Dispatch { label: "embed", pipeline, bind_group, groups, traffic }
        })
        .collect()
}
