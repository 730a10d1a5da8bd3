//! Assembles WGSL modules from shaders/: enable directives for the device's features, the pass
//! parameters' struct, the KV element type, host constants that size workgroup arrays, the weight
//! block decoding of src/quant and row reduction, then the kernel itself. Pipelines are cached by
//! source and constants.

use super::Gpu;
use crate::arch::Activation;
use crate::quant::BlockFormat;
use std::collections::HashMap;

pub const ACTIVATION: &str = include_str!("../../shaders/activation.wgsl");
pub const REDUCE_WORKGROUP: &str = include_str!("../../shaders/reduce_workgroup.wgsl");
pub const ROPE: &str = include_str!("../../shaders/rope.wgsl");
pub const REDUCE_SUBGROUP: &str = include_str!("../../shaders/reduce_subgroup.wgsl");
pub const SOFTCAP: &str = include_str!("../../shaders/softcap.wgsl");

/// What a kernel needs prepended.
#[derive(Default, Clone, Copy)]
pub struct Needs {
    /// Reads weights of this block format through `dq8`.
    pub weights: Option<&'static BlockFormat>,
    /// Uses `row_sum` (the kernel declares `LANES`).
    pub reduce: bool,
    /// Reads the KV cache (`kv_t`, `k_at`, `v_at`); implies `batch`.
    pub kv: bool,
    /// Reads the batch's rows and block tables (`row_pos`, `row_table`, `kv_slot`; the kernel
    /// binds `batch`).
    pub batch: bool,
    /// Writes it (`store_k`, `store_v`: a pair of values at an even index).
    pub kv_write: bool,
    /// Calls `act`, the gated FFN's activation.
    pub act: Option<Activation>,
    /// Calls `rope_rotate` (shaders/rope.wgsl).
    pub rope: bool,
    /// Calls `softcap` (shaders/softcap.wgsl; the pipeline sets its SOFTCAP override).
    pub softcap: bool,
    /// Calls `q8w` and `q8_dot_add` (shaders/quant/int8.wgsl) for `weights` (a stub `q8w` for
    /// formats without int8 blocks, whose kernels never call it).
    pub int8: bool,
    /// Uses cooperative matrices (`enable wgpu_cooperative_matrix;`: `Gpu::coop`).
    pub coop: bool,
}

/// What a kernel's WGSL is assembled for: the device's features (`Target::of`), or another
/// device's (the SPIR-V instruction counts of `gpu::spirv` take a GPU's with shader-f16 and
/// subgroups on any machine).
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub f16: bool,
    pub subgroups: bool,
    /// The adapter's smallest subgroup (`row_sum` takes one subgroup a row when it is as wide).
    pub subgroup_min: u32,
    pub kv: super::KvStore,
}

impl Target {
    pub fn of(gpu: &Gpu) -> Self {
        Self { f16: gpu.f16, subgroups: gpu.subgroups, subgroup_min: gpu.adapter_info.subgroup_min_size, kv: gpu.kv }
    }
}

pub fn assemble(gpu: &Gpu, kernel: &str, needs: Needs, consts: &[(&str, u32)]) -> String {
    assemble_for(Target::of(gpu), kernel, needs, consts)
}

/// `assemble` for `gpu`'s features as `target` has them.
pub fn assemble_for(gpu: Target, kernel: &str, needs: Needs, consts: &[(&str, u32)]) -> String {
    let mut src = String::new();
    if gpu.f16 {
        src.push_str("enable f16;\n");
    }
    if needs.coop {
        src.push_str("enable wgpu_cooperative_matrix;\n");
    }
    // naga accepts subgroup built-ins without the directive and rejects it; browsers require it.
    if gpu.subgroups && needs.reduce && cfg!(target_arch = "wasm32") {
        src.push_str("enable subgroups;\n");
    }
    src.push_str(super::kernels::PARAMS_WGSL);
    if needs.kv || needs.kv_write || needs.batch {
        src.push_str(&batch_prelude());
    }
    if needs.kv || needs.kv_write {
        src.push_str(&kv_prelude(gpu.kv, needs.kv_write));
    }
    for (name, value) in consts {
        src.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    if let Some(format) = needs.weights {
        src.push_str(&crate::quant::wgsl_prelude());
        src.push_str(format.wgsl);
        src.push_str(&format!("fn dq8(base: u32, g: u32) -> Dq8 {{ return {}(base, g); }}\n", format.wgsl_fn));
        if needs.int8 {
            src.push_str(crate::quant::WGSL_INT8);
            let call = format.int8_fn().map_or("Q8W()".to_string(), |f| format!("{f}(base, b)"));
            src.push_str(&format!("fn q8w(base: u32, b: u32) -> Q8W {{ return {call}; }}\n"));
        }
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
        if gpu.subgroups {
            src.push_str(&format!("const SUBGROUP_MIN: u32 = {}u;\n", gpu.subgroup_min));
            src.push_str(REDUCE_SUBGROUP);
        } else {
            src.push_str(REDUCE_WORKGROUP);
        }
    }
    if needs.rope {
        src.push_str(ROPE);
    }
    if needs.softcap {
        src.push_str(SOFTCAP);
    }
    src.push_str(kernel);
    src
}

/// The batch buffer's accessors (layout: `kernels::BatchLayout`): row r of a pass is the token
/// at position `row_pos(r)` of the sequence whose block table starts at word `row_table(r)`; its
/// keys and values live in cache row `kv_slot(table, pos)` (the pool's block of that position).
fn batch_prelude() -> String {
    format!(
        "const KV_BLOCK: u32 = {block}u;\n\
         fn row_pos(r: u32) -> u32 {{ return batch[2u * r]; }}\n\
         fn row_table(r: u32) -> u32 {{ return batch[2u * r + 1u]; }}\n\
         fn kv_slot(table: u32, pos: u32) -> u32 {{ return batch[table + pos / KV_BLOCK] * KV_BLOCK + pos % KV_BLOCK; }}\n",
        block = super::kernels::KV_BLOCK
    )
}

/// The KV cache's element type and accessors, for kernels that bind `k_cache` and `v_cache`:
/// `k_at(i)`, `v_at(i)` read value i of the cache (a position's values start at its
/// `kv_slot(..) * KV_DIM`), `k4_at(i)`, `v4_at(i)` values i .. i + 3 (i even: packed, two
/// words, no per-value pick); with `write`, `store_k(i, a, b)` and `store_v` write values i and
/// i + 1 (i even: a packed word holds the pair).
fn kv_prelude(kv: super::KvStore, write: bool) -> String {
    use super::KvStore::*;
    let (ty, load, load4, store) = match kv {
        F32 | F16 => (
            if kv == F16 { "f16" } else { "f32" },
            "f32(CACHE[j])",
            "vec4<f32>(f32(CACHE[j]), f32(CACHE[j + 1u]), f32(CACHE[j + 2u]), f32(CACHE[j + 3u]))",
            "CACHE[j] = kv_t(a); CACHE[j + 1u] = kv_t(b);",
        ),
        PackedF16 => (
            "u32",
            "unpack2x16float(CACHE[j >> 1u])[j & 1u]",
            "vec4<f32>(unpack2x16float(CACHE[j >> 1u]), unpack2x16float(CACHE[(j >> 1u) + 1u]))",
            "CACHE[j >> 1u] = pack2x16float(vec2<f32>(a, b));",
        ),
    };
    let mut src = format!("alias kv_t = {ty};\n");
    for (name, cache) in [("k", "k_cache"), ("v", "v_cache")] {
        let (load, load4) = (load.replace("CACHE", cache), load4.replace("CACHE", cache));
        src.push_str(&format!("fn {name}_at(j: u32) -> f32 {{ return {load}; }}\n"));
        src.push_str(&format!("fn {name}4_at(j: u32) -> vec4<f32> {{ return {load4}; }}\n"));
        if write {
            let body = store.replace("CACHE", cache);
            src.push_str(&format!("fn store_{name}(j: u32, a: f32, b: f32) {{ {body} }}\n"));
        }
    }
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
