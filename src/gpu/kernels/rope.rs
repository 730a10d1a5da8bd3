//! Wrapper of shaders/rope_kv.wgsl (bias, q/k norms, RoPE, KV-cache write), and the RoPE cos/sin
//! table it reads.

use super::{Dispatch, Groups, Traffic};
use crate::arch::{Rope, RopeStyle};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::weights::Linear;
use crate::gpu::Gpu;
use crate::model::ModelConfig;

/// (cos, sin) per position and rotated pair (times `Rope::mscale`), computed in f64: GPU sin/cos of large angles are
/// not accurate enough (Vulkan only bounds their error on [-pi, pi]). A RoPE that rotates
/// nothing (`Rope::none`) gets one unread pair: a buffer is never empty.
pub fn rope_table(rope: &Rope, positions: usize) -> Vec<f32> {
    let inv_freq = rope.inv_freq();
    if inv_freq.is_empty() {
        return vec![1.0, 0.0];
    }
    let mut table = Vec::with_capacity(positions * inv_freq.len() * 2);
    for pos in 0..positions {
        for &freq in &inv_freq {
            let (sin, cos) = (pos as f64 * freq).sin_cos();
            table.extend([(cos * rope.mscale) as f32, (sin * rope.mscale) as f32]);
        }
    }
    table
}

/// What happens to q, k and v before attention, besides RoPE.
pub struct QkvExtras<'a> {
    /// q|k|v biases.
    pub bias: Option<&'a wgpu::Buffer>,
    /// q_norm then k_norm weights (head_dim each), and the epsilon.
    pub qk_norm: Option<(&'a wgpu::Buffer, f32)>,
    /// Each V head RMS-normed without weights, with this epsilon (Gemma 4).
    pub v_norm: Option<f32>,
    /// q alone: the layer reads another layer's keys and values (Gemma 4's KV sharing).
    pub q_only: bool,
}

/// Where the decode qkv projection sends its rows when it does rope_kv's work itself
/// (gemv_rope_kv.wgsl): the rows' positions and block tables (batch), the RoPE table and the
/// layer's cache.
pub struct RopeKvFold<'a> {
    pub config: &'a ModelConfig,
    pub rope: &'a Rope,
    pub batch: &'a wgpu::Buffer,
    pub table: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
}

impl RopeKvFold<'_> {
    /// Whether the projection `qkv` can take over rope_kv's pass: RoPE on adjacent pairs is all
    /// q and k need (no bias, no q/k norm, which need a whole head), and no pair of rows is
    /// split between two parts of the matrix.
    pub fn applies(&self, extras: &QkvExtras, qkv: &Linear) -> bool {
        self.rope.style == RopeStyle::Adjacent
            && extras.bias.is_none()
            && extras.qk_norm.is_none()
            && extras.v_norm.is_none()
            && !extras.q_only
            && self.config.head_dim % 2 == 0
            && self.rope.dim % 2 == 0
            && qkv.parts.iter().all(|p| !p.pair && p.rows % 2 == 0 && p.out % 2 == 0)
    }

    /// gemv_rope_kv.wgsl's constants.
    pub fn consts(&self) -> [(&'static str, u32); 4] {
        let c = self.config;
        [
            ("HD", c.head_dim as u32),
            ("ROPE_DIM", self.rope.dim as u32),
            ("Q_DIM", c.q_dim() as u32),
            ("KV_DIM", c.kv_dim() as u32),
        ]
    }

    /// Rows `[out, out + rows)` of q|k|v: bytes of q stored, of the table read, of the cache
    /// written (`kv_bytes` a value).
    pub fn traffic(&self, out: usize, rows: usize, kv_bytes: u64) -> Traffic {
        let (q, kv) = (self.config.q_dim(), self.config.kv_dim());
        let overlap = |lo: usize, hi: usize| (out + rows).min(hi).saturating_sub(out.max(lo)) as u64;
        let (q_rows, k_rows, v_rows) = (overlap(0, q), overlap(q, q + kv), overlap(q + kv, q + 2 * kv));
        Traffic {
            activations: 4 * q_rows + 4 * self.rope.dim as u64,
            kv_written: (k_rows + v_rows) * kv_bytes,
            ..Default::default()
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn rope_kv(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    c: &ModelConfig,
    rope: &Rope,
    extras: QkvExtras,
    qkv: &wgpu::Buffer,
    table: &wgpu::Buffer,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
    batch: &wgpu::Buffer,
) -> Dispatch {
    let hd = c.head_dim as u32;
    let (per, wg) = super::head_invocations(hd);
    let consts = [("HD", hd), ("VPI", per), ("WG", wg), ("WG_POW2", wg.next_power_of_two())];
    let overrides = [
        ("ROPE_DIM", rope.dim as f64),
        ("N_Q_HEADS", c.n_heads as f64),
        ("N_KV_HEADS", c.n_kv_heads as f64),
        ("NEOX", (rope.style == RopeStyle::NeoX) as u32 as f64),
        ("BIAS", extras.bias.is_some() as u32 as f64),
        ("QK_NORM", extras.qk_norm.is_some() as u32 as f64),
        ("V_NORM", extras.v_norm.is_some() as u32 as f64),
        ("EPS", extras.qk_norm.map(|n| n.1).or(extras.v_norm).unwrap_or(0.0) as f64),
    ];
    let needs = Needs { kv_write: true, rope: true, ..Default::default() };
    let pipeline = cache.get(gpu, "rope_kv", include_str!("../../../shaders/rope_kv.wgsl"), needs, &consts, &overrides);
    let bias = extras.bias.unwrap_or(table);
    let norm = extras.qk_norm.map_or(table, |n| n.0);
    let bind_group = gpu.bind_group("rope_kv", &pipeline, &[params, qkv, table, k_cache, v_cache, bias, norm, batch]);
    let heads = if extras.q_only { c.n_heads } else { c.n_heads + 2 * c.n_kv_heads } as u32;
    // The qkv row and this position's cos/sin read, q rotated in place, k and v into the cache.
    let (q, kv) = (c.q_dim() as u64, c.kv_dim() as u64);
    let traffic = Traffic {
        weights: extras.bias.map_or(0, |_| 4 * (q + 2 * kv)) + extras.qk_norm.map_or(0, |_| 8 * c.head_dim as u64),
        activations: 4 * (q + 2 * kv) + 4 * rope.dim as u64 + 4 * q,
        kv_written: 2 * kv * gpu.kv_bytes(),
        ..Default::default()
    };
    Dispatch { label: "rope_kv", pipeline, bind_group, groups: Groups::per_token(heads, 1, 1), traffic }
}
