//! 1000 generate/abort cycles, aborted at random points with random prompts and sampling, leave
//! host memory and GPU memory flat: no GPU buffer, bind group or pipeline is created once the
//! first cycles have run, and the process's resident memory does not grow (measured with the
//! test alone in its process).

use crate::common;

use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, StopReason};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::{Rng, SamplingParams};

/// A small random-weight llama model (tests/data/arch), so a cycle takes milliseconds.
fn model() -> Vec<u8> {
    std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/arch/llama3/model.gguf")).unwrap()
}

/// Resident memory of this process in bytes (Linux).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Runs `n` cycles: a random prompt (often extending the last one, so the cache is reused), random
/// sampling, aborted after a random number of tokens (the first, or up to 12).
fn cycles(engine: &mut Engine, rng: &mut Rng, n: usize) -> usize {
    let vocab = engine.config.vocab_size as u64;
    let mut prompt: Vec<u32> = vec![1];
    let mut aborted = 0;
    for _ in 0..n {
        if rng.next_u64() % 3 == 0 || prompt.len() > 40 {
            prompt.truncate(1 + (rng.next_u64() % 4) as usize);
        }
        prompt.extend((0..1 + rng.next_u64() % 6).map(|_| (rng.next_u64() % vocab) as u32));
        let sampling = if rng.next_u64() % 2 == 0 {
            SamplingParams::greedy()
        } else {
            SamplingParams { seed: rng.next_u64(), repetition_penalty: 1.1, ..SamplingParams::default() }
        };
        let options = GenerateOptions { max_tokens: 16, sampling, ignore_eos: true, ..GenerateOptions::default() };
        let stop_after = 1 + rng.next_u64() % 12;
        let mut seen = 0;
        let stats = pollster::block_on(engine.generate(&Prompt::Tokens(prompt.clone()), &options, &mut |_| {
            seen += 1;
            seen < stop_after
        }))
        .unwrap();
        aborted += (stats.stop_reason == StopReason::Aborted) as usize;
    }
    aborted
}

#[test]
fn a_thousand_generate_abort_cycles_leave_gpu_and_host_memory_flat() {
    if !common::alone_in_process("abort_cycles::a_thousand_generate_abort_cycles_leave_gpu_and_host_memory_flat") {
        return;
    }
    let bytes = model();
    for backend in [BackendKind::Gpu, BackendKind::Cpu] {
        let options = LoadOptions { backend, context_length: Some(128), gpu: GpuOptions::from_env() };
        let mut engine = pollster::block_on(Engine::load(&bytes, options, &mut |_, _| {})).unwrap();
        let mut rng = Rng::new(42);
        // Warm-up: pipelines, allocator pools and caches reach their working size.
        cycles(&mut engine, &mut rng, 100);
        let (rss, gpu) = (resident_bytes(), engine.gpu_model().map(|m| m.gpu.counters()));
        let aborted = cycles(&mut engine, &mut rng, 1000);
        let grew = resident_bytes() as i64 - rss as i64;
        eprintln!("{backend:?}: 1000 cycles, {aborted} aborted, resident memory {:+.2} MiB", grew as f64 / 1048576.0);
        assert!(aborted > 800, "most cycles end by abort: {aborted}");
        assert!(grew < 4 << 20, "{backend:?}: resident memory grew by {grew} bytes over 1000 cycles");
        if let (Some(before), Some(model)) = (gpu, engine.gpu_model()) {
            let used = model.gpu.counters() - before;
            assert_eq!(
                (used.buffers, used.bind_groups, used.pipelines),
                (0, 0, 0),
                "GPU objects created by the cycles"
            );
            assert!(used.submissions > 1000);
        }
    }
}
