//! A GPU decode step creates no buffer, bind group or pipeline, submits once and reads back the
//! 4 bytes of its token id, also where a sequence's block table grows (every 16 positions): on
//! the tiny Q8_0 chat model, with the adapter's own kernels and with the GPU-style ones (norms
//! fused into the matrix products; lavapipe's own are the CPU-style ones).

use crate::common::tiny;

use webgpu_llm::gguf::Gguf;
use webgpu_llm::gpu::kernels::KV_BLOCK;
use webgpu_llm::gpu::{Gpu, GpuModel, GpuOptions, KernelStyle, Readback};

#[test]
fn a_decode_step_creates_nothing_submits_once_and_reads_back_four_bytes() {
    let bytes = tiny::chat();
    let gguf = Gguf::parse(bytes).unwrap();
    let prompt = [tiny::IM_START, 300, 301, 302, 303];
    // 50 steps: past three 16-token KV blocks, where a sequence's table grows.
    let steps = 50;
    assert!(prompt.len() + steps > 3 * KV_BLOCK);
    for style in [None, Some(KernelStyle::Gpu)] {
        let mut gpu = pollster::block_on(Gpu::new(GpuOptions::default())).expect("a GPU adapter (lavapipe in CI)");
        if let Some(style) = style {
            gpu.style = style;
        }
        let mut model = pollster::block_on(GpuModel::load(gpu, &gguf, bytes, 2048, &mut |_, _| {})).unwrap();
        let mut next = pollster::block_on(model.step(&prompt, 0, Readback::Argmax)).unwrap().unwrap();
        let before = model.gpu.counters();
        for pos in prompt.len()..prompt.len() + steps {
            next = pollster::block_on(model.step(&[next], pos, Readback::Argmax)).unwrap().unwrap();
        }
        let d = model.gpu.counters() - before;
        let style = model.gpu.style;
        assert_eq!(
            (d.buffers, d.bind_groups, d.pipelines),
            (0, 0, 0),
            "{style:?}: objects created in the decode loop: {d:?}"
        );
        assert_eq!(d.submissions, steps as u64, "{style:?}");
        assert_eq!(d.bytes_read_back, steps as u64 * 4, "{style:?}");
    }
}
