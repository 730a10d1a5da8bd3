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

/// A batched decode step reads back each row what its sampler needs, in one submission: the
/// argmax of every row (4 bytes), where the token a top-k or top-p sampler draws on the GPU is
/// (nothing more: a peaked top-p row's cut always falls within the GPU's selection, so the GPU
/// decides every draw), and the whole row (4 bytes a token) only for a sampler with penalties or
/// a request for candidates. Counted by hand from those
/// rules; each request draws what it draws alone (`Engine::generate`, its own loop). A
/// 512-token prompt joining the batch is prefilled in the same rounds, each still one
/// submission in which every running request gets its token; round times are printed.
#[test]
fn a_batched_decode_step_reads_back_each_row_what_its_sampler_needs() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
    use webgpu_llm::sampling::SamplingParams;
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(1024), gpu: GpuOptions::default() };
    let mut e = pollster::block_on(Engine::load(tiny::chat(), opts, &mut |_, _| {})).unwrap();
    let vocab = e.config.vocab_size as u64;
    assert!(vocab > 1024, "a vocabulary over MAX_TOP_K: selecting is then the point");
    let sampled = |temperature, top_k, top_p, seed| SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p: 0.0,
        seed,
        ..SamplingParams::default()
    };
    let steps = 12;
    let base = GenerateOptions { max_tokens: steps + 2, ignore_eos: true, ..GenerateOptions::default() };
    // (options, bytes its row reads back a step beside its argmax)
    let rows: Vec<(GenerateOptions, u64)> = vec![
        (GenerateOptions { sampling: SamplingParams::greedy(), ..base.clone() }, 0),
        // Top-k rows: the GPU draws their token (the id alone).
        (GenerateOptions { sampling: sampled(0.8, 40, 0.9, 1), ..base.clone() }, 0),
        (GenerateOptions { sampling: sampled(1.0, 1024, 1.0, 2), ..base.clone() }, 0),
        // A peaked distribution: its top-p cut falls within the selection at every step, so the
        // GPU draws its token too.
        (GenerateOptions { sampling: sampled(0.3, 0, 0.9, 3), ..base.clone() }, 0),
        (
            GenerateOptions {
                sampling: SamplingParams { repetition_penalty: 1.3, ..sampled(0.8, 40, 0.9, 4) },
                ..base.clone()
            },
            vocab * 4,
        ),
        (GenerateOptions { sampling: sampled(0.8, 40, 0.9, 5), top_candidates: 3, ..base.clone() }, vocab * 4),
    ];
    let prompts = tiny::prompts();
    let mut alone = Vec::new();
    for (i, (o, _)) in rows.iter().enumerate() {
        let mut ids = Vec::new();
        pollster::block_on(e.generate(&Prompt::Tokens(prompts[i].clone()), o, &mut |ev| {
            ids.push(ev.id);
            true
        }))
        .unwrap();
        alone.push(ids);
    }
    // A round is one pass of at most the engine's rows a pass (the decode rows and the prompt's
    // tokens), and as many prompt tokens a round: a 512-token prompt joining at step 4 beside
    // the 6 streams is prefilled over 512 / (rows - 6) rounds rounded up (at 512 rows a pass:
    // 506, then 5 and its last token as a decode row; at 256: 250, 250, then 11 and the last).
    let pass = e.pass_rows();
    let mut batcher = Batcher::new(&e, pass);
    let mut ids = Vec::new();
    for (i, (o, _)) in rows.iter().enumerate() {
        let p = Batcher::prepare(&e, &Prompt::Tokens(prompts[i].clone()), o).unwrap();
        ids.push(batcher.enqueue(p));
    }
    let long: Vec<u32> = (0..512).map(|i| 259 + (i * 37) % 1700).collect();
    let joining = GenerateOptions { max_tokens: 1, sampling: SamplingParams::greedy(), ..base.clone() };
    let mut got = vec![Vec::new(); rows.len()];
    let mut joined = Vec::new();
    let want_bytes = 4 * rows.len() as u64 + rows.iter().map(|r| r.1).sum::<u64>();
    let mut round_ms = Vec::new();
    for step in 0..steps {
        if step == 4 {
            ids.push(batcher.enqueue(Batcher::prepare(&e, &Prompt::Tokens(long.clone()), &joining).unwrap()));
        }
        let before = e.gpu_model().unwrap().gpu.counters();
        let counts: Vec<usize> = got.iter().map(Vec::len).collect();
        let start = std::time::Instant::now();
        let n = pollster::block_on(batcher.step(&mut e, &mut |_| true, &mut |id, ev| {
            match ev {
                BatchEvent::Token(t) => match ids.iter().position(|&r| r == id).unwrap() {
                    i if i < rows.len() => got[i].push(t.id),
                    _ => joined.push(t.id),
                },
                BatchEvent::Done(_) => {}
                other => panic!("{other:?}"),
            }
            true
        }))
        .unwrap();
        round_ms.push(start.elapsed().as_secs_f64() * 1e3);
        let d = e.gpu_model().unwrap().gpu.counters() - before;
        // Every running request gets a token every round, the joining prompt's rounds too.
        assert!(got.iter().zip(&counts).all(|(g, c)| g.len() == c + 1), "step {step}: a stream missed a round");
        // One submission a round, the first (every prompt) and the joining prompt's included;
        // the prompt's first token is the argmax of its row in the second of its rounds.
        assert_eq!(d.submissions, 1, "step {step}");
        // (The first batched step records the batched pass: its pipelines and bind groups.)
        if step > 0 {
            assert_eq!((d.buffers, d.bind_groups, d.pipelines), (0, 0, 0), "step {step}");
        }
        match step {
            0 => assert_eq!(n, rows.len()),
            // The round that ends the prompt: its last token is a row, reading its argmax.
            _ if step == 4 + 512usize.div_ceil(pass - rows.len()) - 1 => {
                assert_eq!((n, d.bytes_read_back), (rows.len() + 1, want_bytes + 4), "step {step}: the prompt's row")
            }
            _ => assert_eq!((n, d.bytes_read_back), (rows.len(), want_bytes), "step {step}"),
        }
    }
    batcher.clear(&mut e);
    for (i, (a, g)) in alone.iter().zip(&got).enumerate() {
        assert_eq!(&a[..g.len()], &g[..], "row {i} draws what it draws alone");
    }
    let (want_joined, _) = tiny::greedy(tiny::chat(), &long, 1);
    assert_eq!(joined, want_joined, "the joining prompt's first token: the CPU reference's");
    let plain: Vec<f64> =
        round_ms.iter().enumerate().filter(|(i, _)| ![0, 4, 5, 6].contains(i)).map(|r| *r.1).collect();
    println!(
        "round times (ms): {:.1} alone on average, {:.1}, {:.1} and {:.1} with the 512-token prompt joining (each one pass of up to {pass} rows)",
        plain.iter().sum::<f64>() / plain.len() as f64,
        round_ms[4],
        round_ms[5],
        round_ms[6]
    );
}

/// Greedy rounds of the same rows are pipelined: when a round's ids are read, the next round
/// (its tokens the argmax of this one, on the GPU) has already been submitted, so the GPU never
/// waits for the host between rounds. Counted: after each steady round, one submission more
/// than the rounds read; every request still gives the CPU reference's tokens, also the one
/// that ends first (its round submitted ahead is dropped).
#[test]
fn greedy_and_top_k_rounds_are_submitted_one_ahead_of_the_ids_read() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
    use webgpu_llm::sampling::SamplingParams;
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(1024), gpu: GpuOptions::default() };
    let mut e = pollster::block_on(Engine::load(tiny::chat(), opts, &mut |_, _| {})).unwrap();
    let prompts = tiny::prompts();
    let greedy = |n| GenerateOptions {
        max_tokens: n,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        ..Default::default()
    };
    // Rows 1 and 3 sample from their top 40 (their tokens drawn on the GPU).
    let top_k = |n, seed| GenerateOptions {
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.02,
            seed,
            ..SamplingParams::default()
        },
        ..greedy(n)
    };
    let lengths = [16, 16, 9, 16];
    let options: Vec<GenerateOptions> =
        (0..4).map(|i| if i % 2 == 1 { top_k(lengths[i], i as u64) } else { greedy(lengths[i]) }).collect();
    let mut b = Batcher::new(&e, usize::MAX);
    let ids: Vec<_> = (0..4)
        .map(|i| b.enqueue(Batcher::prepare(&e, &Prompt::Tokens(prompts[i].clone()), &options[i]).unwrap()))
        .collect();
    let mut got = vec![Vec::new(); 4];
    let mut step = |b: &mut Batcher, e: &mut Engine| {
        pollster::block_on(b.step(e, &mut |_| true, &mut |id, ev| {
            if let BatchEvent::Token(t) = ev {
                got[ids.iter().position(|&r| r == id).unwrap()].push(t.id);
            }
            true
        }))
        .unwrap()
    };
    // The first round prefills; the second is the first greedy one, submitted with the third.
    step(&mut b, &mut e);
    let base = e.gpu_model().unwrap().gpu.counters().submissions;
    for round in 1..8 {
        step(&mut b, &mut e);
        let submitted = e.gpu_model().unwrap().gpu.counters().submissions - base;
        assert_eq!(submitted, round as u64 + 1, "round {round}: the next round is in flight as this one is read");
    }
    while !b.is_empty() {
        step(&mut b, &mut e);
    }
    // The closure's borrow of `got` ends with its last use above. The greedy rows give the CPU
    // reference's tokens; the sampled ones the tokens the same request draws alone on the host
    // from all its logits (asking for candidates reads them), with the same seed.
    for (i, g) in got.iter().enumerate() {
        if i % 2 == 0 {
            let (want, _) = tiny::greedy(tiny::chat(), &prompts[i], lengths[i]);
            assert_eq!(g, &want, "prompt {i}");
            continue;
        }
        let mut want = Vec::new();
        let host = GenerateOptions { top_candidates: 3, ..options[i].clone() };
        pollster::block_on(e.generate(&Prompt::Tokens(prompts[i].clone()), &host, &mut |ev| {
            want.push(ev.id);
            true
        }))
        .unwrap();
        assert_eq!(g, &want, "prompt {i}, sampled");
    }
}

/// Rows under a constraint read back their selection alone, as free rows do: the GPU applies
/// each row's mask (a bit a token, uploaded while the forward pass runs) to its argmax and its
/// top-k/top-p selection. Counted by hand: 4 bytes a greedy row, 8 bytes a pair of the k
/// largest allowed tokens (k at most the count the mask allows, which each token event
/// reports), the tail's 8 bytes for top-p, and the whole row only for a row that asks for
/// candidates. Each round is two submissions (the forward pass, then the masked selection and
/// its readback). The truth for the tokens: the same requests asking for candidates, which read
/// their whole row and mask it on the host, draw the same tokens, and every text follows the
/// constraint.
#[test]
fn constrained_rows_read_back_their_selection_alone() {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    use webgpu_llm::constraint::ConstraintSpec;
    use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt};
    use webgpu_llm::sampling::SamplingParams;
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(512), gpu: GpuOptions::default() };
    let mut e = pollster::block_on(Engine::load(tiny::chat(), opts, &mut |_, _| {})).unwrap();
    let vocab = e.config.vocab_size as u64;
    let sampled = |top_k, top_p, seed| SamplingParams {
        temperature: 0.8,
        top_k,
        top_p,
        min_p: 0.0,
        seed,
        ..SamplingParams::default()
    };
    // Longer than the steps run: no row ends within them.
    let steps = 10;
    // Few tokens spell only a's and b's: the masks allow fewer than a top-k's 40, so a row's k
    // is clamped to them.
    let regex = ConstraintSpec::Regex("[ab]{60,80}".into());
    let base = GenerateOptions { max_tokens: steps, constraint: Some(regex), ..GenerateOptions::default() };
    // (options, selection pairs read (None: the argmax alone), a tail, the whole row)
    let rows: Vec<(GenerateOptions, Option<u64>, bool, bool)> = vec![
        (GenerateOptions { sampling: SamplingParams::greedy(), ..base.clone() }, None, false, false),
        (GenerateOptions { sampling: sampled(40, 1.0, 1), ..base.clone() }, Some(40), false, false),
        (GenerateOptions { sampling: sampled(0, 0.9, 2), ..base.clone() }, Some(NUCLEUS_K as u64), true, false),
        (GenerateOptions { sampling: sampled(40, 1.0, 1), top_candidates: 1, ..base.clone() }, None, false, true),
        (GenerateOptions { sampling: sampled(0, 0.9, 2), top_candidates: 1, ..base.clone() }, None, false, true),
        // A free row beside them reads its argmax alone.
        (GenerateOptions { sampling: SamplingParams::greedy(), constraint: None, ..base.clone() }, None, false, false),
    ];
    use webgpu_llm::gpu::kernels::NUCLEUS_K;
    let prompt = Prompt::Tokens(tiny::chat_prompt(&[("user", "Write words.")]));
    let mut b = Batcher::new(&e, 256);
    let ids: Vec<_> = rows.iter().map(|(o, ..)| b.enqueue(Batcher::prepare(&e, &prompt, o).unwrap())).collect();
    let mut texts = vec![String::new(); rows.len()];
    let mut tokens = vec![Vec::new(); rows.len()];
    for step in 0..steps {
        let before = e.gpu_model().unwrap().gpu.counters();
        let mut allowed = vec![0u64; rows.len()];
        pollster::block_on(b.step(&mut e, &mut |_| true, &mut |id, ev| {
            let i = ids.iter().position(|&r| r == id).unwrap();
            match ev {
                BatchEvent::Token(t) => {
                    texts[i].push_str(&t.text);
                    tokens[i].push(t.id);
                    allowed[i] = t.allowed.map_or(0, u64::from);
                }
                BatchEvent::Done(_) => {}
                other => panic!("row {i}: {other:?}"),
            }
            true
        }))
        .unwrap();
        let d = e.gpu_model().unwrap().gpu.counters() - before;
        let want: u64 = rows
            .iter()
            .zip(&allowed)
            .map(|((_, pairs, tail, whole), &allowed)| {
                4 + pairs.map_or(0, |k| 8 * k.min(allowed)) + 8 * *tail as u64 + 4 * vocab * *whole as u64
            })
            .sum();
        assert!(allowed[..5].iter().all(|&a| a > 1 && a < 40), "step {step}: {allowed:?}");
        assert_eq!(d.bytes_read_back, want, "step {step}: allowed {allowed:?}");
        assert_eq!((d.submissions, d.mask_rounds), (2, 1), "step {step}");
    }
    b.clear(&mut e);
    assert_eq!(tokens[1], tokens[3], "top-k: masked on the GPU as on the host");
    assert_eq!(tokens[2], tokens[4], "top-p: masked on the GPU as on the host");
    for (i, text) in texts.iter().enumerate().take(5) {
        assert!(text.len() >= steps && text.bytes().all(|c| c == b'a' || c == b'b'), "row {i}: {text:?}");
    }
}
