//! Wrappers of Qwen3.5's Gated DeltaNet kernels (shaders/delta_prep.wgsl, delta_scan.wgsl,
//! delta_out.wgsl), of its gated attention's gate (shaders/gate_mul.wgsl) and of Qwen3.5-MoE's
//! shared expert's gated sum (shaders/sigmoid_add.wgsl).

use super::{BatchLayout, Dispatch, Groups, Traffic};
use crate::arch::DeltaShape;
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

/// The shape's constants, as the kernels name them.
fn consts(s: &DeltaShape) -> [(&'static str, u32); 5] {
    [
        ("L", s.kernel as u32),
        ("KH", s.k_heads as u32),
        ("HK", s.head_k as u32),
        ("VH", s.v_heads as u32),
        ("HV", s.head_v as u32),
    ]
}

/// Positions of a chunk of the chunked delta rule: 16, fewer for key heads past 128 values (a
/// chunk's keys stay within 8 KiB of workgroup memory) or value heads under 16.
fn chunk(s: &DeltaShape) -> usize {
    // An invocation per state column: the chunk's per-position loads and the forward
    // substitution need one per position, so no more positions than columns.
    (2048 / s.head_k).clamp(1, 16).min(s.head_v)
}

/// Values of a row of the layer's input projection: q|k|v, z, b and alpha.
pub fn delta_proj(s: &DeltaShape) -> usize {
    s.conv_dim() + s.value_dim() + 2 * s.v_heads
}

/// The two dispatches before the recurrence, over the pass's rows: each row's q|k|v (from
/// `proj`) into the layer's convolution input at its position, then the convolution, SiLU and
/// L2 norms: q into `q`, k, v, g and beta into the layer's `inputs` at the row's position.
#[allow(clippy::too_many_arguments)]
pub fn delta_prep(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    s: &DeltaShape,
    proj: &wgpu::Buffer,
    conv_in: &wgpu::Buffer,
    taps: &wgpu::Buffer,
    inputs: &wgpu::Buffer,
    q: &wgpu::Buffer,
    dt_bias: &wgpu::Buffer,
    a: &wgpu::Buffer,
    batch: &wgpu::Buffer,
) -> [Dispatch; 2] {
    let needs = Needs { batch: true, ..Default::default() };
    let source = include_str!("../../../shaders/delta_prep.wgsl");
    let conv = s.conv_dim() as u64 * 4;
    [false, true].map(|prep| {
        let overrides = [("PREP", prep as u32 as f64)];
        let pipeline = cache.get(gpu, "delta_prep", source, needs, &consts(s), &overrides);
        let bind_group =
            gpu.bind_group("delta_prep", &pipeline, &[params, proj, conv_in, taps, inputs, q, dt_bias, a, batch]);
        let (label, groups, traffic) = match prep {
            false => (
                "delta_conv_in",
                Groups::per_token((s.conv_dim() as u32).div_ceil(64), 1, 1),
                Traffic { activations: 2 * conv, ..Default::default() },
            ),
            true => (
                "delta_prep",
                Groups::per_token((s.k_heads + s.v_heads) as u32, 1, 1),
                Traffic {
                    weights: conv * s.kernel as u64 + 8 * s.v_heads as u64,
                    activations: conv * s.kernel as u64 + 4 * (s.inputs() + s.key_dim()) as u64,
                    ..Default::default()
                },
            ),
        };
        Dispatch { label, pipeline, bind_group, groups, traffic }
    })
}

/// The gated delta rule of every run of the pass's rows (`shaders/delta_scan.wgsl`): each
/// value head's output into `out`; with `commit`, the state after each final row back to its
/// sequence's slot. `decode`: the params whose row count is the pass's decode rows; `phase`: 0
/// every run, 1 the prompt chunks' alone, 2 the decode rows' alone (a round: 1 then 2).
#[allow(clippy::too_many_arguments)]
pub fn delta_scan(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    decode: &wgpu::Buffer,
    s: &DeltaShape,
    layout: BatchLayout,
    commit: bool,
    phase: u32,
    inputs: &wgpu::Buffer,
    q: &wgpu::Buffer,
    out: &wgpu::Buffer,
    state: &wgpu::Buffer,
    ckpt: &wgpu::Buffer,
    batch: &wgpu::Buffer,
) -> Dispatch {
    let needs = Needs { batch: true, ..Default::default() };
    let source = include_str!("../../../shaders/delta_scan.wgsl");
    let mut c = consts(s).to_vec();
    c.extend([
        ("TABLE0", layout.table(0) as u32),
        ("MAX_BLOCKS", layout.max_blocks as u32),
        ("CHUNK", chunk(s) as u32),
    ]);
    let overrides = [("COMMIT", commit as u32 as f64), ("PHASE", phase as f64)];
    let pipeline = cache.get(gpu, "delta_scan", source, needs, &c, &overrides);
    let bind_group = gpu.bind_group("delta_scan", &pipeline, &[params, decode, inputs, q, out, state, ckpt, batch]);
    // A decode row: the state read and written, the row's inputs and q read, its output written.
    let state_bytes = 4 * s.state_values() as u64;
    let traffic = Traffic {
        activations: 2 * state_bytes + 4 * (s.inputs() + s.key_dim() + s.value_dim()) as u64,
        ..Default::default()
    };
    Dispatch { label: "delta_scan", pipeline, bind_group, groups: Groups::per_token(s.v_heads as u32, 1, 1), traffic }
}

/// Each value head's output RMSNorm'd and times silu(z), in place (`shaders/delta_out.wgsl`).
#[allow(clippy::too_many_arguments)]
pub fn delta_out(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    s: &DeltaShape,
    eps: f32,
    y: &wgpu::Buffer,
    proj: &wgpu::Buffer,
    norm: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/delta_out.wgsl");
    let pipeline = cache.get(gpu, "delta_out", source, Needs::default(), &consts(s), &[("EPS", eps as f64)]);
    let bind_group = gpu.bind_group("delta_out", &pipeline, &[params, y, proj, norm]);
    let vd = s.value_dim() as u64 * 4;
    let traffic = Traffic { weights: 4 * s.head_v as u64, activations: 3 * vd, ..Default::default() };
    Dispatch { label: "delta_out", pipeline, bind_group, groups: Groups::per_token(s.v_heads as u32, 1, 1), traffic }
}

/// Each row's attention output times sigmoid of its gate, in place (`shaders/gate_mul.wgsl`).
pub fn gate_mul(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    q_dim: usize,
    attn: &wgpu::Buffer,
    gate: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/gate_mul.wgsl");
    let pipeline = cache.get(gpu, "gate_mul", source, Needs::default(), &[], &[("Q", q_dim as f64)]);
    let bind_group = gpu.bind_group("gate_mul", &pipeline, &[params, attn, gate]);
    let traffic = Traffic { activations: 3 * 4 * q_dim as u64, ..Default::default() };
    Dispatch {
        label: "gate_mul",
        pipeline,
        bind_group,
        groups: Groups::per_token((q_dim as u32).div_ceil(64), 1, 1),
        traffic,
    }
}

/// x += sigmoid(gate[row]) * y, each row (`shaders/sigmoid_add.wgsl`: a shared expert's output).
pub fn sigmoid_add(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    d: usize,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    gate: &wgpu::Buffer,
) -> Dispatch {
    let source = include_str!("../../../shaders/sigmoid_add.wgsl");
    let pipeline = cache.get(gpu, "sigmoid_add", source, Needs::default(), &[], &[("D", d as f64)]);
    let bind_group = gpu.bind_group("sigmoid_add", &pipeline, &[params, x, y, gate]);
    let traffic = Traffic { activations: 3 * 4 * d as u64 + 4, ..Default::default() };
    Dispatch {
        label: "sigmoid_add",
        pipeline,
        bind_group,
        groups: Groups::per_token((d as u32).div_ceil(64), 1, 1),
        traffic,
    }
}
