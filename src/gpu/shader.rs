//! Assembles WGSL modules from shaders/: enable directives for the device's features, the KV
//! element type, host constants that size workgroup arrays, the shared quantized-weight access
//! and row reduction, then the kernel itself. Pipelines are cached by source and constants.

use super::Gpu;
use crate::gguf::GgmlType;
use std::collections::HashMap;

pub const QUANT: &str = include_str!("../../shaders/quant.wgsl");
pub const REDUCE_WORKGROUP: &str = include_str!("../../shaders/reduce_workgroup.wgsl");
pub const REDUCE_SUBGROUP: &str = include_str!("../../shaders/reduce_subgroup.wgsl");

/// What a kernel needs prepended.
#[derive(Default, Clone, Copy)]
pub struct Needs {
    /// Reads weights of this type through `dq8`.
    pub weights: Option<GgmlType>,
    /// Uses `row_sum` (the kernel declares `LANES`).
    pub reduce: bool,
    /// Uses `kv_t`.
    pub kv: bool,
}

pub fn dq8_name(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "dq8_f32",
        GgmlType::F16 => "dq8_f16",
        GgmlType::Q4_0 => "dq8_q4_0",
        GgmlType::Q4_1 => "dq8_q4_1",
        GgmlType::Q8_0 => "dq8_q8_0",
        _ => return None,
    })
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
    if let Some(ty) = needs.weights {
        src.push_str(QUANT);
        let f = dq8_name(ty).expect("weight types are checked at upload");
        src.push_str(&format!("fn dq8(base: u32, g: u32) -> Dq8 {{ return {f}(base, g); }}\n"));
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
