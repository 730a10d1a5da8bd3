//! The engine: load a GGUF model (on the GPU or the CPU reference), its tokenizer and chat
//! template, and the conversation's KV cache. Generation runs in the batch runtime
//! (`batcher.rs`: `Engine::generate`, `generate_batch`, `beam_search` are batches of one or
//! more requests, speculation and beams included).
//! Async, so the same code serves native callers and the browser.

use crate::chat::{ChatTemplate, Message};
use crate::constraint::{Constraint, ConstraintSpec, Grammars, MaskTiming};
use crate::error::{Error, Result};
use crate::gguf::ByteSource;
use crate::gpu::{CounterSnapshot, Gpu, GpuModel, GpuOptions, KvStore};
use crate::model::{CpuModel, ModelConfig};
use crate::sampling::{Candidate, Sampler, SamplingParams};
use crate::speculate::{Speculation, SpeculationStats};
use crate::tokenizer::Tokenizer;
use crate::tools::{ToolFormat, Tools};
use std::sync::Arc;

pub use crate::arch::DEFAULT_CONTEXT;

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
    /// Structured output: only tokens this constraint allows are drawn (`crate::constraint`).
    pub constraint: Option<ConstraintSpec>,
    /// Functions the chat template shows the model (`crate::tools`); a forced call is the
    /// constraint above.
    pub tools: Option<Arc<Tools>>,
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
        if let (true, Some(c)) = (self.ignore_eos, &self.constraint) {
            return Err(Error::InvalidOption {
                name: "ignore_eos",
                value: "true".into(),
                expected: format!(
                    "no ignore_eos with {}: once its grammar is complete only the end of sequence may follow",
                    c.field()
                ),
            });
        }
        if let (Some(spec), Some(c)) = (&self.speculate, &self.constraint) {
            return Err(Error::InvalidOption {
                name: "speculate",
                value: format!("{:?}", spec.drafter),
                expected: format!(
                    "no speculation with {} (not supported yet: drafts are not checked against the grammar)",
                    c.field()
                ),
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
            constraint: None,
            tools: None,
        }
    }
}

/// One sampled token and the text it completed (empty while a character or a possible stop
/// string is incomplete).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenEvent {
    pub id: u32,
    pub text: String,
    /// Tokens in the KV cache once this one is fed back: what the next step attends over.
    pub position: usize,
    /// The distribution this token was drawn from (when `top_candidates` > 0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<TokenCandidate>,
    /// The token's log-probability in that distribution (batched generation with
    /// `top_candidates` > 0: the server's `logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprob: Option<TokenLogprob>,
    /// With speculative decoding: whether the token was drafted, and the drafts it replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<TokenSpeculation>,
    /// With a constraint: tokens its mask allowed at this step (the page's count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed: Option<u32>,
}

/// Where a token of a speculative generation came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenSpeculation {
    /// A drafted token the model accepted (false: the model's own token from a verifying pass).
    pub accepted: bool,
    /// The drafted tokens' texts this (own) token replaced: the first draft the model rejected
    /// and the ones after it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<String>,
}

/// A sampled token's log-probability and its own text (the event's `text` may hold it back).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub token: String,
}

/// A candidate of the sampling distribution, with its text.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// With a constraint: its masks and their CPU time.
    pub masks: Option<MaskTiming>,
}

pub(crate) enum Backend {
    Cpu { model: Box<CpuModel> },
    Gpu(Box<GpuModel>),
}

pub struct Engine {
    pub config: ModelConfig,
    pub tokenizer: Arc<Tokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    context_length: usize,
    pub(crate) backend: Backend,
    /// A separate draft model for speculative decoding (`Drafter::Model`): each request that
    /// drafts with it has a sequence of its own in its pool (the batcher's `ModelDraft`).
    pub(crate) draft: Option<Box<Engine>>,
    /// Structured output's compiler over this model's vocabulary, built by the first
    /// constrained request (shared with the prompt encoders, which compile off this thread).
    grammars: Arc<std::sync::OnceLock<Grammars>>,
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
        let mut tokenizer = Tokenizer::from_gguf(&gguf)?;
        tokenizer.check_vocab(config.vocab_size)?;
        let chat_template = ChatTemplate::from_gguf(&gguf)?;
        if let Some(t) = &chat_template {
            tokenizer.guard_markup(t.source());
        }
        let context_length = options.context_length.unwrap_or(DEFAULT_CONTEXT).min(config.context_length);
        let backend = match options.backend {
            BackendKind::Cpu => {
                progress(0, 1);
                let file = source.read(0, source.len()).await?;
                let model = Box::new(CpuModel::load(&gguf, &file)?);
                progress(1, 1);
                Backend::Cpu { model }
            }
            BackendKind::Gpu => {
                let gpu = Gpu::new(options.gpu).await?;
                Backend::Gpu(Box::new(GpuModel::load(gpu, &gguf, source, context_length, progress).await?))
            }
        };
        Ok(Self {
            config,
            tokenizer: Arc::new(tokenizer),
            grammars: Arc::default(),
            chat_template: chat_template.map(Arc::new),
            context_length,
            backend,
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
        self.draft = Some(Box::new(draft));
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
                "gpu: {}; {} KV cache, {}{}",
                m.gpu.adapter_name(),
                match m.gpu.kv {
                    KvStore::F32 => "f32",
                    KvStore::F16 => "f16",
                    KvStore::PackedF16 => "packed f16",
                },
                if m.gpu.subgroups { "subgroups" } else { "no subgroups" },
                match (m.gpu.coop, m.gpu.style) {
                    (Some(side), crate::gpu::KernelStyle::Gpu) => {
                        format!(", prefill gemms on {side}x{side} cooperative matrices")
                    }
                    (Some(_), crate::gpu::KernelStyle::Cpu) => {
                        ", cooperative matrices unused (the CPU-style kernels take none: WEBGPU_LLM_KERNELS=gpu does)"
                            .into()
                    }
                    (None, _) => String::new(),
                }
            ),
        }
    }

    /// The model has a multi-token-prediction head to draft with (`Drafter::Mtp`).
    pub fn has_mtp(&self) -> bool {
        match &self.backend {
            Backend::Cpu { model } => model.has_mtp(),
            Backend::Gpu(model) => model.has_mtp(),
        }
    }

    /// Tokens a step runs at most in one pass: the longest prompt chunk (`GpuModel::pass_rows`;
    /// the CPU backend takes `kernels::BASE_ROWS`).
    pub fn pass_rows(&self) -> usize {
        match &self.backend {
            Backend::Cpu { .. } => crate::gpu::kernels::BASE_ROWS,
            Backend::Gpu(model) => model.pass_rows(),
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

    /// Tokens of a prompt as the model will see them.
    pub fn prompt_tokens(&self, prompt: &Prompt, tools: Option<&Tools>) -> Result<Vec<u32>> {
        self.prompt_encoder().tokens(prompt, tools)
    }

    /// What turns prompts into tokens, to use on another thread (the server tokenizes in its
    /// HTTP handlers, off the engine's).
    pub fn prompt_encoder(&self) -> PromptEncoder {
        PromptEncoder {
            tokenizer: self.tokenizer.clone(),
            template: self.chat_template.clone(),
            context_length: self.context_length,
            vocab_size: self.config.vocab_size,
            grammars: self.grammars.clone(),
        }
    }

    /// `spec` compiled over this model's vocabulary (the vocabulary's trie built the first time).
    pub fn compile_constraint(&self, spec: &ConstraintSpec) -> Result<Constraint> {
        self.prompt_encoder().constraint(spec)
    }

    /// The prompt's tokens, refused when empty, outside the vocabulary, or when they and
    /// `max_tokens` more do not fit the context.
    pub(crate) fn checked_prompt(&self, prompt: &Prompt, tools: Option<&Tools>, max_tokens: usize) -> Result<Vec<u32>> {
        let tokens = self.prompt_tokens(prompt, tools)?;
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

    /// Forgets the prefix cache: the pool's cached blocks that no request holds become free,
    /// so the next prompt runs whole. (Only the GPU backend, with its pool, caches prefixes.)
    pub fn clear_conversation(&mut self) {
        if let Backend::Gpu(model) = &mut self.backend {
            model.forget_cached();
        }
    }
}

/// A model's tokenizer and chat template, shared (`Engine::prompt_encoder`): prompts into
/// token ids on any thread.
#[derive(Clone)]
pub struct PromptEncoder {
    tokenizer: Arc<Tokenizer>,
    template: Option<Arc<ChatTemplate>>,
    context_length: usize,
    vocab_size: usize,
    grammars: Arc<std::sync::OnceLock<Grammars>>,
}

impl PromptEncoder {
    /// `spec` compiled over the model's vocabulary (the vocabulary's trie built the first time,
    /// once for the engine and every encoder): the server compiles here, off the engine's thread.
    pub fn constraint(&self, spec: &ConstraintSpec) -> Result<Constraint> {
        if self.grammars.get().is_none() {
            let format = self.template.as_ref().map_or(ToolFormat::Hermes, |t| t.tool_format());
            let grammars = Grammars::new(&self.tokenizer, self.vocab_size, format)?;
            let _ = self.grammars.set(grammars);
        }
        self.grammars.get().expect("set above").compile(spec)
    }

    /// Tokens of a prompt as the model will see them (a chat's with `tools` shown to the model).
    pub fn tokens(&self, prompt: &Prompt, tools: Option<&Tools>) -> Result<Vec<u32>> {
        let (text, plain) = match prompt {
            Prompt::Tokens(ids) => return Ok(ids.clone()),
            Prompt::Text(text) => (text.clone(), Vec::new()),
            // The template's markup is tokenized with its special tokens; what the messages
            // hold never is (a message cannot open a turn).
            Prompt::Chat(messages) => {
                self.template
                    .as_ref()
                    .ok_or(Error::NoChatTemplate)?
                    .render_guarded(messages, true, tools, &|t| self.tokenizer.special_spans(t))?
            }
        };
        let mut ids = Vec::new();
        if self.tokenizer.add_bos && matches!(prompt, Prompt::Text(_)) {
            ids.extend(self.tokenizer.bos_id);
        }
        ids.extend(self.tokenizer.encode_guarded(&text, &plain)?);
        Ok(ids)
    }

    /// The tokens a prompt has at least, from its text's length alone (no token is longer than
    /// the vocabulary's longest): when that is past the context, the prompt is refused without
    /// tokenizing it.
    pub fn min_tokens(&self, prompt: &Prompt) -> usize {
        let bytes = match prompt {
            Prompt::Tokens(ids) => return ids.len(),
            Prompt::Text(t) => t.len(),
            Prompt::Chat(messages) => messages.iter().map(|m| m.content.len()).sum(),
        };
        bytes / self.tokenizer.max_token_bytes().max(1)
    }

    /// Tokens the context holds.
    pub fn context_length(&self) -> usize {
        self.context_length
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
