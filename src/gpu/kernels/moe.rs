//! Wrappers of the mixture-of-experts kernels: shaders/moe_route.wgsl (the router's choice and
//! weights per token), shaders/moe_gemv.wgsl (the chosen experts' matrix-vector products: only
//! their rows are read) and shaders/moe_combine.wgsl (their weighted sum into the residual
//! stream or a post-norm's input).

use super::{Dispatch, Groups, Traffic};
use crate::arch::{Activation, Experts};
use crate::error::{Error, Result};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::weights::Linear;
use crate::gpu::Gpu;

/// Each token's `used` experts (`ids`, u32) and weights (f32) from its router logits.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    e: &Experts,
    logits: &wgpu::Buffer,
    bias: Option<&wgpu::Buffer>,
    ids: &wgpu::Buffer,
    weights: &wgpu::Buffer,
) -> Dispatch {
    // The bias is the router's (added to the logits) or, with a selection bias in the plan, the
    // selection's (added to the scores that choose).
    let selection = e.selection_bias.is_some() && bias.is_some();
    let overrides = [
        ("COUNT", e.count as f64),
        ("NORMALIZE", e.normalize as u32 as f64),
        ("SCALE", e.scale as f64),
        ("ROUTER_BIAS", (bias.is_some() && !selection) as u32 as f64),
        ("SIGMOID", e.sigmoid as u32 as f64),
        ("SELECTION", selection as u32 as f64),
    ];
    let source = include_str!("../../../shaders/moe_route.wgsl");
    let pipeline = cache.get(gpu, "moe_route", source, Needs::default(), &[("USED", e.used as u32)], &overrides);
    let bind_group = gpu.bind_group("moe_route", &pipeline, &[params, logits, ids, weights, bias.unwrap_or(logits)]);
    let traffic = Traffic { activations: 4 * (e.count + 2 * e.used) as u64, ..Default::default() };
    Dispatch { label: "moe_route", pipeline, bind_group, groups: Groups::per_token(1, 0, 64), traffic }
}

/// Whether `moe_gemv` reads `w`: one part (one buffer, one block type), else an error naming it.
pub fn check_experts(w: &Linear, name: &str) -> Result<()> {
    match w.parts.len() {
        1 => Ok(()),
        n => Err(Error::Unsupported(format!(
            "expert tensors larger than one GPU binding or of two block types ({name}: {n} parts)"
        ))),
    }
}

/// The chosen experts' products: `w` stacks `e.count` experts of `rows` rows (gate then up
/// experts with `pair`: y = act(gate) * up); x is the token's row (`x_per_token`) or each
/// assignment's own; y gets a row of `rows` per assignment (token, chosen expert).
#[allow(clippy::too_many_arguments)]
pub fn moe_gemv(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    e: &Experts,
    w: &Linear,
    rows: usize,
    pair: bool,
    act: Activation,
    x_per_token: bool,
    bias: Option<&wgpu::Buffer>,
    x: &wgpu::Buffer,
    ids: &wgpu::Buffer,
    y: &wgpu::Buffer,
    grouped: Option<&MoeGroups>,
) -> Dispatch {
    let p = &w.parts[0];
    let (alpha, limit) = crate::arch::SWIGLU_OAI;
    let overrides = [
        ("COLS", p.cols as f64),
        ("ROW_WORDS", p.row_words as f64),
        ("ROWS", rows as f64),
        ("COUNT", e.count as f64),
        ("PAIR", pair as u32 as f64),
        ("X_PER_TOKEN", x_per_token as u32 as f64),
        ("BIAS", bias.is_some() as u32 as f64),
        ("OAI", (pair && e.swiglu_oai) as u32 as f64),
        ("ALPHA", alpha as f64),
        ("LIMIT", limit as f64),
        ("GROUPED", grouped.is_some() as u32 as f64),
    ];
    let needs = Needs { weights: Some(p.format), act: Some(act), ..Default::default() };
    let source = include_str!("../../../shaders/moe_gemv.wgsl");
    let pipeline = cache.get(gpu, "moe_gemv", source, needs, &[("USED", e.used as u32)], &overrides);
    let (order, starts) = grouped.map_or((ids, ids), |g| (&g.order, &g.starts));
    let bind_group =
        gpu.bind_group("moe_gemv", &pipeline, &[&p.buffer, x, y, ids, params, bias.unwrap_or(x), order, starts]);
    // A token reads its chosen experts' rows alone: `used` of the `count` experts.
    let matrices = if pair { 2 } else { 1 };
    let traffic = Traffic {
        weights: (matrices * e.used * rows * p.row_words * 4) as u64,
        activations: 4 * (e.used * (p.cols + rows) + e.used) as u64,
        ..Default::default()
    };
    let groups = match grouped {
        // A workgroup per row block and expert (one that no token chose returns at once).
        Some(_) => Groups::fixed((rows as u32).div_ceil(64), e.count as u32),
        None => Groups {
            fixed: [(rows as u32).div_ceil(64), e.used as u32, 1],
            tokens: Some((2, 1)),
            segment: Default::default(),
        },
    };
    Dispatch { label: "moe_gemv", pipeline, bind_group, groups, traffic }
}

/// A pass's assignments grouped by expert (`moe_group`): `moe_gemv`'s GROUPED form reads them.
pub struct MoeGroups {
    /// Assignments (token * used + j), expert by expert.
    pub order: wgpu::Buffer,
    /// Where each expert's assignments start in `order` (count + 1 values).
    pub starts: wgpu::Buffer,
}

/// Groups the pass's assignments (`ids`) by expert into `groups` (shaders/moe_group.wgsl).
pub fn moe_group(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    e: &Experts,
    ids: &wgpu::Buffer,
    groups: &MoeGroups,
) -> Dispatch {
    let source = include_str!("../../../shaders/moe_group.wgsl");
    let consts = [("USED", e.used as u32)];
    let pipeline = cache.get(gpu, "moe_group", source, Needs::default(), &consts, &[("COUNT", e.count as f64)]);
    let bind_group = gpu.bind_group("moe_group", &pipeline, &[params, ids, &groups.order, &groups.starts]);
    let traffic = Traffic { activations: 4 * (2 * e.used + e.count + 1) as u64, ..Default::default() };
    Dispatch { label: "moe_group", pipeline, bind_group, groups: Groups::fixed(1, 1), traffic }
}

/// out (+)= the weighted sum of each token's experts' outputs (rows of `d`).
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    e: &Experts,
    d: usize,
    add: bool,
    y: &wgpu::Buffer,
    weights: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [("D", d as f64), ("ADD", add as u32 as f64)];
    let source = include_str!("../../../shaders/moe_combine.wgsl");
    let pipeline = cache.get(gpu, "moe_combine", source, Needs::default(), &[("USED", e.used as u32)], &overrides);
    let bind_group = gpu.bind_group("moe_combine", &pipeline, &[params, y, weights, out]);
    let traffic = Traffic { activations: 4 * ((e.used + 1 + add as usize) * d + e.used) as u64, ..Default::default() };
    Dispatch {
        label: "moe_combine",
        pipeline,
        bind_group,
        groups: Groups::per_token((d as u32).div_ceil(64), 1, 1),
        traffic,
    }
}
