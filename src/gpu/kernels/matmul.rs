//! Wrappers of shaders/gemv.wgsl (decode, one token) and shaders/gemm.wgsl (prefill, tiled).

use super::{Dispatch, Groups, Traffic};
use crate::arch::Activation;
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::weights::Linear;
use crate::gpu::{Gpu, KernelStyle};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    Store,
    /// Adds to the output (residual connection).
    Add,
}

/// y = W x for one token, or W rms_norm(x) with `norm` = (norm weights, epsilon). Gated-pair
/// parts write act(gate) * up; others store or add.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    w: &Linear,
    act: Activation,
    epilogue: Epilogue,
    norm: Option<(&wgpu::Buffer, f32)>,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
) -> Vec<Dispatch> {
    w.parts
        .iter()
        .map(|p| {
            let mode = match (p.pair, epilogue) {
                (true, _) => 2,
                (false, Epilogue::Add) => 1,
                (false, Epilogue::Store) => 0,
            };
            let overrides = [
                ("COLS", p.cols as f64),
                ("ROW_WORDS", p.row_words as f64),
                ("ROW_COUNT", p.rows as f64),
                ("OUT", p.out as f64),
                ("EPILOGUE", mode as f64),
                ("LANES", gpu.gemv_lanes() as f64),
                ("NORM", norm.is_some() as u32 as f64),
                ("EPS", norm.map_or(0.0, |n| n.1 as f64)),
            ];
            let needs = Needs {
                weights: Some(p.format),
                reduce: true,
                act: Some(if p.pair { act } else { Activation::Silu }),
                ..Default::default()
            };
            let pipeline = cache.get(gpu, "gemv", include_str!("../../../shaders/gemv.wgsl"), needs, &[], &overrides);
            let bind_group = gpu.bind_group("gemv", &pipeline, &[&p.buffer, x, y, norm.map_or(x, |n| n.0)]);
            let rows_per_group = 256 / gpu.gemv_lanes();
            let groups = Groups::spread(
                (p.rows as u32).div_ceil(rows_per_group),
                gpu.limits.max_compute_workgroups_per_dimension,
            );
            // The part's rows, x (and the norm weights), y written (and read first when added to).
            let out_rows = p.rows as u64 * 4;
            let traffic = Traffic {
                weights: p.buffer.size() + norm.map_or(0, |_| 4 * p.cols as u64),
                activations: 4 * p.cols as u64
                    + if epilogue == Epilogue::Add && !p.pair { 2 * out_rows } else { out_rows },
                ..Default::default()
            };
            Dispatch { label: "gemv", pipeline, bind_group, groups, traffic }
        })
        .collect()
}

/// Y = X W^T for the pass's tokens; `y_stride` is Y's row length. Gated-pair parts write gate
/// values to columns [0, rows) and up values to [rows, 2 rows) (act_mul follows).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    w: &Linear,
    epilogue: Epilogue,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    w.parts
        .iter()
        .map(|p| {
            let rows = if p.pair { 2 * p.rows } else { p.rows };
            let overrides = [
                ("COLS", p.cols as f64),
                ("ROW_WORDS", p.row_words as f64),
                ("ROW_COUNT", rows as f64),
                ("Y_STRIDE", y_stride as f64),
                ("OUT", p.out as f64),
                ("EPILOGUE", (epilogue == Epilogue::Add) as u32 as f64),
                ("PAIR", p.pair as u32 as f64),
                ("HALF", p.rows as f64),
                ("PAIR_OFFSET", w.rows as f64),
                ("DIRECT", (gpu.style == KernelStyle::Cpu) as u32 as f64),
            ];
            let needs = Needs { weights: Some(p.format), ..Default::default() };
            let pipeline = cache.get(gpu, "gemm", include_str!("../../../shaders/gemm.wgsl"), needs, &[], &overrides);
            let bind_group = gpu.bind_group("gemm", &pipeline, &[params, &p.buffer, x, y]);
            Dispatch {
                label: "gemm",
                pipeline,
                bind_group,
                groups: Groups::per_token((rows as u32).div_ceil(64), 1, 64),
                traffic: Traffic {
                    weights: p.buffer.size(),
                    activations: 4 * (p.cols + rows) as u64,
                    ..Default::default()
                },
            }
        })
        .collect()
}
