//! Wrappers of shaders/attention_decode.wgsl and shaders/attention_prefill.wgsl.

use super::{Dispatch, Groups};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;
use crate::model::reference::AttentionKind;
use crate::model::ModelConfig;

/// Queries per prefill workgroup.
const BQ: u32 = 8;

#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    c: &ModelConfig,
    kind: AttentionKind,
    context: usize,
    qkv: &wgpu::Buffer,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
    scores: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [
        ("HEAD_DIM", c.head_dim as f64),
        ("KV_DIM", c.kv_dim() as f64),
        ("GROUP", (c.n_heads / c.n_kv_heads) as f64),
        ("CTX", context as f64),
        ("SCALE", kind.scale as f64),
        ("WINDOW", kind.window.unwrap_or(0) as f64),
    ];
    let needs = Needs { kv: true, ..Default::default() };
    let pipeline = cache.get(
        gpu,
        "attention_decode",
        include_str!("../../../shaders/attention_decode.wgsl"),
        needs,
        &[],
        &overrides,
    );
    let bind_group = gpu.bind_group("attention_decode", &pipeline, &[params, qkv, k_cache, v_cache, scores, out]);
    Dispatch { label: "attention_decode", pipeline, bind_group, groups: Groups::fixed(c.n_heads as u32, 1) }
}

/// Key-block length that keeps the tiles within the device's workgroup memory.
fn key_block(head_dim: u32, workgroup_bytes: u32) -> u32 {
    let fixed = (BQ * head_dim + 3 * BQ) * 4;
    let per_key = (2 * head_dim + BQ) * 4;
    (workgroup_bytes.saturating_sub(fixed) / per_key).clamp(1, 32)
}

#[allow(clippy::too_many_arguments)]
pub fn attention_prefill(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    c: &ModelConfig,
    kind: AttentionKind,
    qkv: &wgpu::Buffer,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Dispatch {
    let hd = c.head_dim as u32;
    let bk = key_block(hd, gpu.limits.max_compute_workgroup_storage_size);
    let consts = [("HD", hd), ("BQ", BQ), ("BK", bk)];
    let overrides = [
        ("Q_DIM", c.q_dim() as f64),
        ("KV_DIM", c.kv_dim() as f64),
        ("GROUP", (c.n_heads / c.n_kv_heads) as f64),
        ("SCALE", kind.scale as f64),
        ("WINDOW", kind.window.unwrap_or(0) as f64),
    ];
    let needs = Needs { kv: true, ..Default::default() };
    let pipeline = cache.get(
        gpu,
        "attention_prefill",
        include_str!("../../../shaders/attention_prefill.wgsl"),
        needs,
        &consts,
        &overrides,
    );
    let bind_group = gpu.bind_group("attention_prefill", &pipeline, &[params, qkv, k_cache, v_cache, out]);
    let mut groups = Groups::per_token(1, 0, BQ);
    groups.fixed[1] = c.n_heads as u32;
    Dispatch { label: "attention_prefill", pipeline, bind_group, groups }
}
