//! Beam search on the GPU (beams forked in the KV pool, stepping together in one batch) gives what
//! the CPU reference's beam search gives on the same tiny model: the same hypotheses in the same
//! order, each score within 1e-3 — with hypotheses finished by EOS at different lengths beside
//! ones stopped by the token limit, 2 and 4 beams, each early-stopping rule and a length penalty;
//! with the adapter's own kernels and with the GPU-style ones (a real GPU's; lavapipe's own are
//! the CPU-style ones).
//! The CPU beams are checked against transformers in tests/golden (beams.rs).

use crate::common::tiny;

use webgpu_llm::beam::{BeamOptions, EarlyStopping};
use webgpu_llm::engine::{BackendKind, Engine, LoadOptions, Prompt};
use webgpu_llm::gpu::{GpuOptions, KernelStyle};

const SCORE_TOLERANCE: f64 = 1e-3;

fn engine(bytes: &[u8], backend: BackendKind, gpu: GpuOptions) -> Engine {
    let opts = LoadOptions { backend, context_length: Some(512), gpu };
    pollster::block_on(Engine::load(bytes, opts, &mut |_, _| {})).unwrap()
}

#[test]
fn gpu_beam_search_gives_the_cpu_reference_beams() {
    let prompts = tiny::prompts();
    // EOS moved to the 4th token of prompt 7's greedy answer: some beams finish early.
    let (bytes, eos) = tiny::chat_ending_at(&prompts[7], 3);
    let mut cpu = engine(&bytes, BackendKind::Cpu, GpuOptions::default());
    let gpu_style = GpuOptions { kernels: Some(KernelStyle::Gpu), ..Default::default() };
    let mut gpus = [GpuOptions::default(), gpu_style].map(|options| engine(&bytes, BackendKind::Gpu, options));
    let cases = [
        (7, 4, 12, vec![eos], 1.0, EarlyStopping::Heuristic),
        (7, 4, 12, vec![eos], 1.0, EarlyStopping::Done),
        (7, 2, 12, vec![eos], 2.0, EarlyStopping::Never),
        (1, 2, 8, vec![], 1.0, EarlyStopping::Heuristic),
        (3, 4, 8, vec![], 1.0, EarlyStopping::Heuristic),
    ];
    let mut finished_early = 0;
    for ((i, beams, max_tokens, stop_ids, length_penalty, early_stopping), gpu) in
        cases.into_iter().flat_map(|case| [(case.clone(), 0), (case, 1)])
    {
        let gpu = &mut gpus[gpu];
        let style = gpu.gpu_model().unwrap().gpu.style;
        let name = format!("{style:?}: prompt {i}, {beams} beams, stop {stop_ids:?}, {early_stopping:?}");
        let options = BeamOptions { beams, max_tokens, stop_ids, length_penalty, early_stopping };
        let prompt = Prompt::Tokens(prompts[i].clone());
        let want = pollster::block_on(cpu.beam_search(&prompt, &options)).unwrap();
        let got = pollster::block_on(gpu.beam_search(&prompt, &options)).unwrap();
        assert_eq!(got.len(), want.len(), "{name}: hypotheses returned");
        for (rank, ((g, text), (w, want_text))) in got.iter().zip(&want).enumerate() {
            assert!((g.score - w.score).abs() < SCORE_TOLERANCE, "{name}: beam {rank} {} vs {}", g.score, w.score);
            // Ranks may swap only between scores within the tolerance.
            let apart =
                want.iter().enumerate().all(|(j, (h, _))| j == rank || (h.score - w.score).abs() > SCORE_TOLERANCE);
            if apart {
                assert_eq!(g.ids, w.ids, "{name}: beam {rank}");
                assert_eq!(text, want_text, "{name}: beam {rank}'s text");
            }
            finished_early += (g.ids.len() < max_tokens) as usize;
        }
    }
    assert!(finished_early > 0, "some hypotheses finished by EOS before the token limit");
}
