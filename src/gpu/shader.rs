//! Assembles WGSL modules from shaders/: enable directives for the device's features, the KV
//! element type, host constants that size workgroup arrays, the weight block decoding of src/quant
//! and row reduction, then the kernel itself. Pipelines are cached by source and constants.

use super::Gpu;
use crate::arch::Activation;
use crate::quant::BlockFormat;
use std::collections::HashMap;

pub const ACTIVATION: &str = include_str!("../../shaders/activation.wgsl");
pub const REDUCE_WORKGROUP: &str = include_str!("../../shaders/reduce_workgroup.wgsl");
pub const REDUCE_SUBGROUP: &str = include_str!("../../shaders/reduce_subgroup.wgsl");

/// What a kernel needs prepended.
#[derive(Default, Clone, Copy)]
pub struct Needs {
    /// Reads weights of this block format through `dq8`.
    pub weights: Option<&'static BlockFormat>,
    /// Uses `row_sum` (the kernel declares `LANES`).
    pub reduce: bool,
    /// Uses `kv_t`.
    pub kv: bool,
    /// Calls `act`, the gated FFN's activation.
    pub act: Option<Activation>,
}

pub fn assemble(gpu: &Gpu, kernel: &str, needs: Needs, consts: &[(&str, u32)]) -> String {
    let mut src = String::new();
    if gpu.f16 {
        src.push_str("enable f16;\n");
    }
    // naga accepts subgroup built-ins without the directive and rejects it; browsers require it.
    if gpu.subgroups && needs.reduce && cfg!(target_arch = "wasm32") {
        src.push_str("enable subgroups;\n");
    }
    if needs.kv {
        src.push_str(if gpu.f16 { "alias kv_t = f16;\n" } else { "alias kv_t = f32;\n" });
    }
    for (name, value) in consts {
        src.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    if let Some(format) = needs.weights {
        src.push_str(&crate::quant::wgsl_prelude());
        src.push_str(format.wgsl);
        src.push_str(&format!("fn dq8(base: u32, g: u32) -> Dq8 {{ return {}(base, g); }}\n", format.wgsl_fn));
    }
    if let Some(act) = needs.act {
        src.push_str(ACTIVATION);
        let f = match act {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu_tanh",
        };
        src.push_str(&format!("fn act(x: f32) -> f32 {{ return {f}(x); }}\n"));
    }
    if needs.reduce {
        src.push_str(if gpu.subgroups { REDUCE_SUBGROUP } else { REDUCE_WORKGROUP });
    }
    src.push_str(kernel);
    src
}

/// Compiled pipelines by (label, source, constants): layers share their kernels.
#[derive(Default)]
pub struct PipelineCache {
    pipelines: HashMap<String, wgpu::ComputePipeline>,
}

impl PipelineCache {
    pub fn get(
        &mut self,
        gpu: &Gpu,
        label: &str,
        kernel: &str,
        needs: Needs,
        consts: &[(&str, u32)],
        overrides: &[(&str, f64)],
    ) -> wgpu::ComputePipeline {
        let source = assemble(gpu, kernel, needs, consts);
        let key = format!("{label}|{overrides:?}|{source}");
        self.pipelines.entry(key).or_insert_with(|| gpu.pipeline(label, &source, overrides)).clone()
    }
}
