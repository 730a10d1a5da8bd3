//! The engine: load a GGUF model (on the GPU or the CPU reference), its tokenizer and chat
//! template, and the conversation's KV cache. Generation runs in the batch runtime
//! (`batcher.rs`: `Engine::generate`, `generate_batch`, `beam_search` are batches of one or
//! more requests); speculative decoding still has its own loop here (`generate_speculative`).
//! Async, so the same code serves native callers and the browser.

use crate::chat::{ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::gguf::ByteSource;
use crate::gpu::kernels::MAX_TOP_K;
use crate::gpu::{
    BatchReadback, CounterSnapshot, Gpu, GpuModel, GpuOptions, KvStore, Readback, RowReadback, Selection,
};
use crate::kv_pool::SeqId;
use crate::model::{CpuKvCache, CpuModel, Logits, ModelConfig};
use crate::sampling::{all_finite, argmax, Candidate, Sampler, SamplingParams, Tail};
use crate::speculate::{self, Drafter, Speculation, SpeculationStats};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use web_time::Instant;

pub use crate::arch::DEFAULT_CONTEXT;
pub use crate::gpu::PREFILL_CHUNK;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Gpu,
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub backend: BackendKind,
    /// Tokens the KV cache holds; None = min(model context, DEFAULT_CONTEXT).
    pub context_length: Option<usize>,
    pub gpu: GpuOptions,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { backend: BackendKind::Gpu, context_length: None, gpu: GpuOptions::from_env() }
    }
}

/// What to generate from.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text, tokenized as is (BOS added when the model asks for it).
    Text(String),
    /// Messages rendered with the model's chat template, ending with the assistant's turn.
    Chat(Vec<Message>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends when the text contains one of these; the stop string is not emitted.
    pub stop: Vec<String>,
    /// Keep going past the end-of-sequence token.
    pub ignore_eos: bool,
    /// Attach this many most likely candidates to every token event (reads the logits back
    /// every step; 0 = off, the fast path).
    pub top_candidates: usize,
    /// Speculative decoding: draft tokens cheaply, check them in one pass (greedy output and the
    /// sampling distribution unchanged).
    pub speculate: Option<Speculation>,
}

impl GenerateOptions {
    /// Checks what needs no model: callers validate before loading one.
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(Error::InvalidSamplingParameter {
                name: "max_tokens",
                value: "0".into(),
                expected: "must be at least 1",
            });
        }
        if let Some(spec) = &self.speculate {
            spec.validate()?;
            if self.top_candidates > 0 {
                return Err(Error::InvalidOption {
                    name: "speculate",
                    value: format!("{:?}", spec.drafter),
                    expected: "no candidates per token (speculation checks several tokens in one pass)".into(),
                });
            }
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::InvalidSamplingParameter {
                name: "stop",
                value: "\"\"".into(),
                expected: "a stop string must not be empty (it would match before any text)",
            });
        }
        self.sampling.validate()
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            top_candidates: 0,
            speculate: None,
        }
    }
}

/// One sampled token and the text it completed (empty while a character or a possible stop
/// string is incomplete).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenEvent {
    pub id: u32,
    pub text: String,
    /// Tokens in the KV cache once this one is fed back: what the next step attends over.
    pub position: usize,
    /// The distribution this token was drawn from (when `top_candidates` > 0).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<TokenCandidate>,
    /// The token's log-probability in that distribution (batched generation with
    /// `top_candidates` > 0: the server's `logprobs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprob: Option<TokenLogprob>,
    /// With speculative decoding: whether the token was drafted, and the drafts it replaced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculation: Option<TokenSpeculation>,
}

/// Where a token of a speculative generation came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenSpeculation {
    /// A drafted token the model accepted (false: the model's own token from a verifying pass).
    pub accepted: bool,
    /// The drafted tokens' texts this (own) token replaced: the first draft the model rejected
    /// and the ones after it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<String>,
}

/// A sampled token's log-probability and its own text (the event's `text` may hold it back).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub token: String,
}

/// A candidate of the sampling distribution, with its text.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenCandidate {
    pub id: u32,
    pub text: String,
    /// Probability after penalties and temperature, before the top-k/top-p/min-p cut.
    pub prob: f32,
    /// Survived top-k, top-p and min-p.
    pub kept: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    StopString,
    MaxTokens,
    Aborted,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually run: fewer than `prompt_tokens` when the KV cache held a prefix.
    pub prefilled_tokens: usize,
    /// Tokens sampled and emitted (an end-of-sequence token that stopped generation is not counted).
    pub generated_tokens: usize,
    pub ttft_ms: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub stop_reason: StopReason,
    /// Decode steps run (each after the first sampled token).
    pub decode_steps: usize,
    /// GPU objects created, submissions and bytes read back over the decode steps (GPU only).
    pub decode_counters: Option<CounterSnapshot>,
    /// What speculative decoding drafted and kept (when asked for).
    pub speculation: Option<SpeculationStats>,
}

pub(crate) enum Backend {
    Cpu { model: Box<CpuModel>, cache: CpuKvCache },
    Gpu(Box<GpuModel>),
}

pub struct Engine {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    context_length: usize,
    pub(crate) backend: Backend,
    /// Tokens whose keys and values are in the KV cache, in order.
    pub(crate) cached: Vec<u32>,
    logits: Vec<f32>,
    /// The largest logits a top-k sampler draws from (GPU selection), reused every token.
    top: Vec<(u32, f32)>,
    /// What a top-p/min-p selection says of the logits it did not select.
    tail: Tail,
    /// A separate draft model for speculative decoding (`Drafter::Model`), with the greedy
    /// sampler it drafts with.
    draft: Option<(Box<Engine>, Sampler)>,
}

impl Engine {
    /// Loads a model from the bytes of a GGUF file. `progress(done, total)` follows the weights.
    pub async fn load(file: &[u8], options: LoadOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        Self::load_from(file, options, progress).await
    }

    /// Loads a model read in ranges from `source`: the header, then each tensor in pieces of at
    /// most 8 MiB straight into GPU buffers, so host memory holds one piece, not the file. (The CPU
    /// reference backend reads the whole file.)
    pub async fn load_from(
        source: &(impl ByteSource + ?Sized),
        options: LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        if options.context_length == Some(0) {
            return Err(Error::InvalidOption {
                name: "context length",
                value: "0".into(),
                expected: "must be at least 1 token".into(),
            });
        }
        let gguf = source.header().await?;
        let config = ModelConfig::from_gguf(&gguf)?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        tokenizer.check_vocab(config.vocab_size)?;
        let chat_template = ChatTemplate::from_gguf(&gguf)?;
        let context_length = options.context_length.unwrap_or(DEFAULT_CONTEXT).min(config.context_length);
        let backend = match options.backend {
            BackendKind::Cpu => {
                progress(0, 1);
                let file = source.read(0, source.len()).await?;
                let model = Box::new(CpuModel::load(&gguf, &file)?);
                let cache = model.new_cache();
                progress(1, 1);
                Backend::Cpu { model, cache }
            }
            BackendKind::Gpu => {
                let gpu = Gpu::new(options.gpu).await?;
                Backend::Gpu(Box::new(GpuModel::load(gpu, &gguf, source, context_length, progress).await?))
            }
        };
        Ok(Self {
            logits: vec![0.0; config.vocab_size],
            top: Vec::with_capacity(MAX_TOP_K),
            tail: Tail::default(),
            config,
            tokenizer,
            chat_template,
            context_length,
            backend,
            cached: Vec::new(),
            draft: None,
        })
    }

    /// Attaches `draft` as this engine's draft model (`Drafter::Model`): a smaller model with
    /// the same tokenizer, which proposes tokens for speculative decoding. Refused when its
    /// tokenizer differs (its ids would mean other tokens), naming the first difference.
    pub fn set_draft_model(&mut self, draft: Engine) -> Result<()> {
        let (ours, theirs) = (&self.tokenizer, &draft.tokenizer);
        let mismatch = |what: String| Error::InvalidOption {
            name: "draft model",
            value: draft.config.name.clone(),
            expected: format!("a model with {}'s tokenizer: {what}", self.config.name),
        };
        if ours.vocab_size() != theirs.vocab_size() {
            return Err(mismatch(format!(
                "its vocabulary has {} tokens, not {}",
                theirs.vocab_size(),
                ours.vocab_size()
            )));
        }
        if let Some(id) = (0..ours.vocab_size() as u32).find(|&id| ours.token_str(id) != theirs.token_str(id)) {
            let show = |t: Option<String>| t.map_or("none".into(), |t| format!("{t:?}"));
            return Err(mismatch(format!(
                "its token {id} is {}, not {}",
                show(theirs.token_str(id)),
                show(ours.token_str(id))
            )));
        }
        let sampler = Sampler::new(SamplingParams::greedy(), draft.config.vocab_size)?;
        self.draft = Some((Box::new(draft), sampler));
        Ok(())
    }

    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// Where the model runs: "cpu", or the GPU adapter and the kernel path in use.
    pub fn backend_description(&self) -> String {
        match &self.backend {
            Backend::Cpu { .. } => "cpu (f32 reference)".into(),
            Backend::Gpu(m) => format!(
                "gpu: {}; {} KV cache, {}",
                m.gpu.adapter_name(),
                match m.gpu.kv {
                    KvStore::F32 => "f32",
                    KvStore::F16 => "f16",
                    KvStore::PackedF16 => "packed f16",
                },
                if m.gpu.subgroups { "subgroups" } else { "no subgroups" }
            ),
        }
    }

    /// The GPU model, when running on the GPU (benchmarks and tests look at its counters).
    pub fn gpu_model(&self) -> Option<&GpuModel> {
        match &self.backend {
            Backend::Gpu(m) => Some(m),
            Backend::Cpu { .. } => None,
        }
    }

    pub fn gpu_model_mut(&mut self) -> Option<&mut GpuModel> {
        match &mut self.backend {
            Backend::Gpu(m) => Some(m),
            Backend::Cpu { .. } => None,
        }
    }

    fn gpu_counters(&self) -> Option<CounterSnapshot> {
        self.gpu_model().map(|m| m.gpu.counters())
    }

    /// Tokens of a prompt as the model will see them.
    pub fn prompt_tokens(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let text = match prompt {
            Prompt::Tokens(ids) => return Ok(ids.clone()),
            Prompt::Text(text) => text.clone(),
            Prompt::Chat(messages) => {
                self.chat_template.as_ref().ok_or(Error::NoChatTemplate)?.render(messages, true)?
            }
        };
        let mut ids = Vec::new();
        if self.tokenizer.add_bos && matches!(prompt, Prompt::Text(_)) {
            ids.extend(self.tokenizer.bos_id);
        }
        ids.extend(self.tokenizer.encode(&text)?);
        Ok(ids)
    }

    /// The prompt's tokens, refused when empty, outside the vocabulary, or when they and
    /// `max_tokens` more do not fit the context.
    pub(crate) fn checked_prompt(&self, prompt: &Prompt, max_tokens: usize) -> Result<Vec<u32>> {
        let tokens = self.prompt_tokens(prompt)?;
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= self.config.vocab_size) {
            return Err(Error::TokenOutOfRange { id, vocab_size: self.config.vocab_size });
        }
        if tokens.len().checked_add(max_tokens).is_none_or(|n| n > self.context_length) {
            return Err(Error::ContextOverflow {
                prompt_tokens: tokens.len(),
                max_tokens,
                context_length: self.context_length,
            });
        }
        Ok(tokens)
    }

    /// `generate` with speculative decoding: draft tokens cheaply, check them in one pass (greedy
    /// output and the sampling distribution unchanged), in the engine's conversation.
    pub(crate) async fn generate_speculative(
        &mut self,
        prompt: &Prompt,
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<Stats> {
        options.validate()?;
        if options.speculate.is_some_and(|s| s.drafter == Drafter::Model) && self.draft.is_none() {
            return Err(Error::InvalidOption {
                name: "speculate",
                value: "draft".into(),
                expected: "lookup or layers:L: no draft model is loaded (the CLI's --speculate draft:PATH loads one)"
                    .into(),
            });
        }
        let tokens = self.checked_prompt(prompt, options.max_tokens)?;
        let mut sampler = Sampler::new(options.sampling.clone(), self.config.vocab_size)?;
        tokens.iter().for_each(|&id| sampler.accept(id));

        let start = Instant::now();
        // At least the last prompt token is run, to get the logits that pick the first new token.
        let reuse = common_prefix(&self.cached, &tokens).min(tokens.len() - 1);
        self.truncate_cache(reuse);
        let Some(spec) = options.speculate else { unreachable!("generate runs the requests that do not speculate") };
        let mut next = self.run(&tokens[reuse..], &mut sampler).await?;
        let ttft = start.elapsed().as_secs_f64();

        let mut stream = StreamDecoder::new();
        let mut stops = StopMatcher::new(options.stop.clone());
        let (mut generated, mut decode_steps) = (0, 0);
        // Speculation: tokens already chosen (the accepted drafts, all in the cache, then the
        // model's own token after them, not yet), emitted before anything runs again.
        let mut pending = std::collections::VecDeque::new();
        let mut spec_stats = SpeculationStats::default();
        // The next token's origin with speculation: how many of the tokens to emit are accepted
        // drafts, and the drafts the model's own token after them replaced.
        let (mut accepted_ahead, mut rejected) = (0usize, Vec::new());
        let mut origin = Some(TokenSpeculation { accepted: false, rejected: Vec::new() });
        let decode_start = Instant::now();
        let counters_start = self.gpu_counters();
        let stop_reason = loop {
            if !options.ignore_eos && self.tokenizer.stop_ids.contains(&next) {
                break StopReason::Eos;
            }
            generated += 1;
            let last = generated >= options.max_tokens;
            let mut piece = stream.push(&self.tokenizer, next)?;
            if last {
                piece.push_str(&stream.finish(&self.tokenizer)?);
            }
            let (text, hit) = if last { stops.finish(&piece) } else { stops.push(&piece) };
            let event = TokenEvent {
                id: next,
                text,
                // The prompt and every token emitted so far, this one included (speculation may
                // have cached tokens that are still to be emitted).
                position: tokens.len() + generated,
                candidates: Vec::new(),
                logprob: None,
                speculation: origin.take(),
            };
            if !on_token(&event) {
                break StopReason::Aborted;
            }
            if hit {
                break StopReason::StopString;
            }
            if last {
                break StopReason::MaxTokens;
            }
            sampler.accept(next);
            next = if let Some(t) = pending.pop_front() {
                t
            } else {
                let left = options.max_tokens - generated;
                let st = &mut spec_stats;
                let (t, j) =
                    self.speculative_step(next, &spec, &mut sampler, left, &mut pending, &mut rejected, st).await?;
                accepted_ahead = j;
                t
            };
            let accepted = accepted_ahead > 0;
            accepted_ahead = accepted_ahead.saturating_sub(1);
            let rejected = if accepted { Vec::new() } else { std::mem::take(&mut rejected) };
            let rejected = rejected.iter().map(|&id| self.tokenizer.decode(&[id]).unwrap_or_default()).collect();
            origin = Some(TokenSpeculation { accepted, rejected });
            decode_steps += 1;
        };
        if stop_reason == StopReason::Eos {
            // Text held back for a possible stop string or an unfinished character ends here.
            let (tail, _) = stops.finish(&stream.finish(&self.tokenizer)?);
            if !tail.is_empty() {
                on_token(&TokenEvent {
                    id: next,
                    text: tail,
                    position: tokens.len() + generated,
                    candidates: Vec::new(),
                    logprob: None,
                    speculation: None,
                });
            }
        }
        let decode_secs = decode_start.elapsed().as_secs_f64();
        let decode_counters = self.gpu_counters().zip(counters_start).map(|(end, start)| end - start);
        let prefilled = tokens.len() - reuse;
        Ok(Stats {
            prompt_tokens: tokens.len(),
            prefilled_tokens: prefilled,
            generated_tokens: generated,
            ttft_ms: ttft * 1e3,
            prefill_tok_s: prefilled as f64 / ttft.max(1e-9),
            decode_tok_s: decode_steps as f64 / decode_secs.max(1e-9),
            stop_reason,
            decode_steps,
            decode_counters,
            speculation: Some(spec_stats),
        })
    }

    /// The token after `token` (not yet in the cache), with speculation: drafts up to K tokens
    /// after it (no more than `left` - 1, the tokens still to emit after it), runs `token` and the
    /// draft in one pass, keeps `token` and the accepted drafts in the cache, and queues the
    /// accepted tokens and the token sampled after them in `pending`; returns the first of them
    /// and how many are accepted drafts (the drafts after those are left in `rejected`).
    /// Greedy: a draft is accepted when it is the model's argmax. Sampling: the drafters are
    /// deterministic (a one-hot draft distribution), so speculative sampling's rule is: keep a
    /// draft with probability p(draft), else draw from p without it (`Sampler::check_draft`);
    /// each token comes out distributed as plain sampling's.
    async fn speculative_step(
        &mut self,
        token: u32,
        spec: &Speculation,
        sampler: &mut Sampler,
        left: usize,
        pending: &mut std::collections::VecDeque<u32>,
        rejected: &mut Vec<u32>,
        stats: &mut SpeculationStats,
    ) -> Result<(u32, usize)> {
        let start = self.cached.len();
        // The check pass is one decode step: at most a batch's rows.
        let rows = match &self.backend {
            Backend::Gpu(m) => m.max_batch(),
            Backend::Cpu { .. } => usize::MAX,
        };
        let k = spec
            .draft_tokens
            .min(left.saturating_sub(1))
            .min(self.context_length.saturating_sub(start + 1))
            .min(rows.saturating_sub(1));
        let mut tokens = Vec::with_capacity(k + 1);
        tokens.push(token);
        if k > 0 {
            match spec.drafter {
                Drafter::Lookup => {
                    let mut context = self.cached.clone();
                    context.push(token);
                    let mut draft = Vec::with_capacity(k);
                    speculate::lookup(&context, k, &mut draft);
                    tokens.extend(draft);
                }
                Drafter::Layers(layers) => {
                    let mut prev = token;
                    for i in 0..k {
                        prev = match &mut self.backend {
                            Backend::Gpu(model) => model.draft_step(layers, prev, start + i).await?,
                            Backend::Cpu { model, cache } => {
                                let n_layers = model.config.n_layers;
                                if layers == 0 || layers >= n_layers {
                                    return Err(Error::InvalidOption {
                                        name: "speculate",
                                        value: format!("layers:{layers}"),
                                        expected: format!("layers:L with L from 1 to {}", n_layers - 1),
                                    });
                                }
                                argmax(&model.forward_layers(cache, &[prev], Logits::Last, layers)?)
                            }
                        };
                        stats.draft_passes += 1;
                        tokens.push(prev);
                    }
                    // The draft's partial layers leave the CPU cache's lengths uneven.
                    if let Backend::Cpu { cache, .. } = &mut self.backend {
                        cache.truncate(start, self.config.kv_dim());
                    }
                }
                Drafter::Model => {
                    let vocab = self.config.vocab_size;
                    let (draft, greedy) =
                        self.draft.as_mut().map(|d| (&mut *d.0, &mut d.1)).ok_or(Error::InvalidOption {
                            name: "speculate",
                            value: "draft".into(),
                            expected: "a loaded draft model".into(),
                        })?;
                    // The draft's cache follows the model's: what they share is kept, the rest
                    // (the tokens accepted since, this one) runs as one prefill, then it drafts.
                    let mut context = Vec::with_capacity(start + 1);
                    context.extend_from_slice(&self.cached);
                    context.push(token);
                    let k = k.min(draft.context_length.saturating_sub(context.len()));
                    if k > 0 {
                        let reuse = common_prefix(&draft.cached, &context).min(context.len() - 1);
                        draft.truncate_cache(reuse);
                        let mut prev = draft.run(&context[reuse..], greedy).await?;
                        for i in 0..k {
                            // An id past this model's vocabulary (a draft with more rows) ends it.
                            if prev as usize >= vocab {
                                break;
                            }
                            tokens.push(prev);
                            stats.draft_passes += 1;
                            if i + 1 < k {
                                prev = draft.run(&[prev], greedy).await?;
                            }
                        }
                    }
                }
            }
        }
        stats.passes += 1;
        rejected.clear();
        if tokens.len() == 1 {
            return Ok((self.run(&[token], sampler).await?, 0));
        }
        let draft = &tokens[1..];
        let vocab = self.config.vocab_size;
        // Plain greedy needs each position's argmax alone; a sampler every position's logits.
        let want_logits = sampler.needs_logits();
        let mut verified = vec![0u32; tokens.len()];
        let mut logits = if want_logits { vec![0f32; tokens.len() * vocab] } else { Vec::new() };
        match &mut self.backend {
            Backend::Gpu(model) => {
                let seq = model.main_sequence();
                let rows: Vec<(SeqId, u32, usize)> =
                    tokens.iter().enumerate().map(|(i, &t)| (seq, t, start + i)).collect();
                let readback =
                    if want_logits { BatchReadback::Logits(&mut logits) } else { BatchReadback::Argmax(&mut verified) };
                model.decode_batch(&rows, readback).await?;
            }
            Backend::Cpu { model, cache } => {
                let all = model.forward(cache, &tokens, Logits::All)?;
                if want_logits {
                    logits = all;
                } else {
                    for (v, row) in verified.iter_mut().zip(all.chunks_exact(vocab)) {
                        *v = argmax(row);
                    }
                }
            }
        }
        let (mut j, mut chosen) = (0, 0);
        for (i, row) in logits.chunks_exact_mut(vocab).enumerate() {
            // Only the rows a choice is made from (plain sampling would never see the others).
            if !all_finite(row) {
                return Err(Error::NonFiniteLogits { position: start + i + 1 });
            }
            let Some(&d) = draft.get(i) else {
                chosen = sampler.sample(row);
                break;
            };
            let (id, kept) = sampler.check_draft(row, d);
            if !kept {
                chosen = id;
                break;
            }
            // Counted for the penalties of the positions after it; undone below.
            sampler.accept(d);
            j += 1;
        }
        draft[..j].iter().for_each(|&d| sampler.forget(d));
        if !want_logits {
            j = speculate::accepted(draft, &verified);
            chosen = verified[j];
        }
        if chosen as usize >= vocab {
            return Err(Error::TokenOutOfRange { id: chosen, vocab_size: vocab });
        }
        stats.drafted += draft.len();
        stats.accepted += j;
        // `token` and the accepted drafts stay in the cache; the rejected ones go.
        self.cached.extend_from_slice(&tokens[..1 + j]);
        let keep = self.cached.len();
        self.truncate_cache(keep);
        pending.extend(&draft[..j]);
        pending.push_back(chosen);
        rejected.extend_from_slice(&draft[j..]);
        Ok((pending.pop_front().expect("one token at least"), j))
    }

    /// Runs tokens after the cached ones and samples the next token. Reads back only what the
    /// sampler needs: the argmax for plain greedy decoding, else the logits.
    async fn run(&mut self, tokens: &[u32], sampler: &mut Sampler) -> Result<u32> {
        // What the sampler needs read back: the argmax, the GPU's selection of the largest
        // logits (top-k; top-p/min-p with the tail), or every logit (`RowReadback::for_sampler`).
        let want = RowReadback::for_sampler(sampler, matches!(self.backend, Backend::Gpu(_)));
        let argmax_id = match &mut self.backend {
            Backend::Cpu { model, cache } => {
                self.logits = model.forward(cache, tokens, Logits::Last)?;
                argmax(&self.logits)
            }
            Backend::Gpu(model) => {
                let mut start = self.cached.len();
                let chunks = tokens.chunks(PREFILL_CHUNK).count();
                let mut id = None;
                for (i, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
                    let readback = match want {
                        _ if i + 1 < chunks => Readback::None,
                        RowReadback::Argmax => Readback::Argmax,
                        RowReadback::Select { k, tail } => {
                            Readback::TopK(Selection { k, out: &mut self.top, tail: tail.map(|t| (t, &mut self.tail)) })
                        }
                        RowReadback::Logits => Readback::Logits(&mut self.logits),
                    };
                    id = model.step(chunk, start, readback).await?;
                    start += chunk.len();
                }
                id.unwrap_or(0)
            }
        };
        self.cached.extend_from_slice(tokens);
        // The logits on the host (the CPU's, or read back to sample): NaN or infinity in them is
        // an error, never a token. The GPU's argmax flags them itself.
        let host_logits = want == RowReadback::Logits || matches!(self.backend, Backend::Cpu { .. });
        if host_logits && !all_finite(&self.logits) {
            return Err(Error::NonFiniteLogits { position: self.cached.len() });
        }
        let id = match want.choose(sampler, argmax_id, &self.top, self.tail, &mut self.logits) {
            Some(id) => id,
            None => {
                let Backend::Gpu(model) = &self.backend else { unreachable!("selected on the GPU") };
                model.read_logits(0, &mut self.logits).await?;
                sampler.sample(&mut self.logits)
            }
        };
        // Never hand out an id past the vocabulary (a broken kernel or a logits buffer that does
        // not match the vocabulary).
        if id as usize >= self.config.vocab_size {
            return Err(Error::TokenOutOfRange { id, vocab_size: self.config.vocab_size });
        }
        Ok(id)
    }

    /// Forgets the conversation: its KV blocks go back to the pool (the next prompt runs whole).
    pub fn clear_conversation(&mut self) {
        self.truncate_cache(0);
    }

    pub(crate) fn truncate_cache(&mut self, len: usize) {
        self.cached.truncate(len);
        match &mut self.backend {
            Backend::Cpu { cache, .. } => cache.truncate(len, self.config.kv_dim()),
            Backend::Gpu(model) => {
                let main = model.main_sequence();
                model.truncate_sequence(main, len);
            }
        }
    }
}

/// The `n` most likely tokens of the distribution `sampler` draws from, with their texts.
pub(crate) fn token_candidates(
    tok: &Tokenizer,
    sampler: &mut Sampler,
    logits: &[f32],
    n: usize,
) -> Vec<TokenCandidate> {
    sampler
        .top_candidates(logits, n)
        .into_iter()
        .map(|Candidate { id, prob, kept }| TokenCandidate {
            id,
            text: tok.decode(&[id]).unwrap_or_default(),
            prob,
            kept,
        })
        .collect()
}

/// How many tokens `a` and `b` start with in common.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Finds stop strings in streamed text, holding back any tail that could start one.
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub(crate) fn new(stops: Vec<String>) -> Self {
        Self { stops, held: String::new() }
    }

    /// Adds a piece; returns the text safe to emit and whether a stop string was reached.
    pub(crate) fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        if let Some(at) = self.stops.iter().filter(|s| !s.is_empty()).filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = (1..=self.held.len())
            .rev()
            .filter(|&n| self.held.is_char_boundary(self.held.len() - n))
            .find(|&n| self.stops.iter().any(|s| s.starts_with(&self.held[self.held.len() - n..])))
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// Adds the final piece; returns all remaining text and whether a stop string was reached.
    pub(crate) fn finish(&mut self, piece: &str) -> (String, bool) {
        let (mut out, hit) = self.push(piece);
        out.push_str(&std::mem::take(&mut self.held));
        (out, hit)
    }
}
