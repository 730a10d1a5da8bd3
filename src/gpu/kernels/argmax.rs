//! Wrapper of shaders/argmax.wgsl (greedy decoding on the GPU).

use super::{Dispatch, Groups, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::Gpu;

pub fn argmax(gpu: &Gpu, cache: &mut PipelineCache, n: usize, logits: &wgpu::Buffer, out: &wgpu::Buffer) -> Dispatch {
    let pipeline = cache.get(
        gpu,
        "argmax",
        include_str!("../../../shaders/argmax.wgsl"),
        Needs::default(),
        &[],
        &[("N", n as f64)],
    );
    let bind_group = gpu.bind_group("argmax", &pipeline, &[logits, out]);
    let traffic = Traffic { activations: n as u64 * 4 + 4, ..Default::default() };
    Dispatch { label: "argmax", pipeline, bind_group, groups: Groups::fixed(1, 1), traffic }
}
