//! Continuous batching: requests join and leave a running batch between decode steps.
//!
//! A `Batcher` holds the requests being generated, each in its own KV-pool sequence (its own
//! cache on the CPU backend), and the queue of those waiting to start. `step` runs one round:
//! the waiting requests are admitted in order while the batch has a row and the pool has the
//! blocks their prompt needs; then up to `prefill_budget` prompt tokens of requests still being
//! prefilled (in pieces of at most the engine's `pass_rows`, oldest request first), then one decode step
//! of every prefilled request the caller says is ready, as one batch (each weight read once for
//! all rows); finished ones leave at the end of the round and give their blocks back. Greedy
//! output of a request is what it gives alone; a sampled request draws with its own seed what it
//! draws alone.
//!
//! Blocks on demand (vLLM's rule): a request holds the blocks of the positions it has written,
//! and takes one more as it crosses a block boundary; `max_tokens` bounds it but reserves
//! nothing. When a step's rows need more blocks than are free (the prefix cache's idle blocks
//! count as free: the pool evicts them as it needs them), the most recently admitted request is
//! preempted: its blocks are freed (its written blocks stay in the prefix cache) and it waits at
//! the head of the queue with everything it has (sampler, text, the token to feed next), to be
//! recomputed from its tokens when there is room (from the prefix cache, so mostly not
//! recomputed at all), and to go on as if nothing happened: the same tokens as never preempted.
//!
//! Between two decode steps of a running request there is at most one step of every row plus
//! `prefill_budget` prompt tokens: that is the bound a newcomer's prefill puts on the others'
//! inter-token latency.
//!
//! Prefix cache (GPU; `KvPool`'s): every full block a request has written is registered under a
//! chained hash of its tokens as soon as it is full, and stays cached after the request ends
//! until the pool needs the block (least recently used first), so it never refuses a request.
//! A request of any kind (sampled, speculative, beam search, a preempted one coming back) starts
//! from the longest cached prefix of its prompt — a chat's next turn, a shared system prompt, a
//! repeated prompt, or a prompt running at the same time — and prefills only the rest.

use crate::beam::{BeamOptions, BeamSearch, BeamStep, Hypothesis};
use crate::constraint::Constraint;
use crate::engine::{
    common_prefix, token_candidates, Backend, Engine, GenerateOptions, Prompt, Stats, StopMatcher, StopReason,
    TokenCandidate, TokenEvent, TokenLogprob, TokenSpeculation,
};
use crate::error::{Error, Result};
use crate::gpu::{Readback, RoundFlight, RowReadback, RowsReadback, ROUND_PASSES};
use crate::kv_pool::SeqId;
use crate::model::{CpuKvCache, Logits};
use crate::sampling::{all_finite, argmax, Sampler, Tail};
use crate::speculate::{self, Drafter, SpeculationStats};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::collections::VecDeque;
use web_time::Instant;

/// A request's handle, unique for the batcher's life.
pub type RequestId = u64;

/// What `Batcher::step` reports of a request.
#[derive(Debug)]
pub enum BatchEvent<'a> {
    /// A token (the callback returns false to end the request: its client went away).
    Token(&'a TokenEvent),
    /// The request ended; it has left the batch and its blocks are free.
    Done(Stats),
    /// The request failed on its own (non-finite logits in its row); the others go on.
    Failed(Error),
    /// A beam search request's N best hypotheses, best first, each with its text (then `Done`).
    Beams(Vec<(Hypothesis, String)>),
}

/// A request checked against the model (tokenized, options valid, fits the context), not yet
/// admitted: `Batcher::enqueue` queues it (or `admit` starts it now).
pub struct Prepared {
    tokens: Vec<u32>,
    sampler: Sampler,
    options: GenerateOptions,
    vocab_size: usize,
    /// A beam search instead of sampling.
    beams: Option<BeamOptions>,
}

impl Prepared {
    /// The same request with another seed (one more choice of it), without tokenizing again.
    pub fn with_seed(&self, seed: u64) -> Result<Prepared> {
        let mut options = self.options.clone();
        options.sampling.seed = seed;
        let mut sampler = Sampler::new(options.sampling.clone(), self.vocab_size)?;
        self.tokens.iter().for_each(|&id| sampler.accept(id));
        if let Some(c) = self.sampler.constraint() {
            sampler.constrain(c.clone());
        }
        Ok(Prepared { tokens: self.tokens.clone(), sampler, options, vocab_size: self.vocab_size, beams: None })
    }

    pub fn prompt_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn options(&self) -> &GenerateOptions {
        &self.options
    }
}

/// A beam search running in the batch: its beams fork the prompt's sequence (then each other's)
/// and run as rows of the decode steps.
struct Beams {
    search: BeamSearch,
    /// Beam i's sequence (none before the prompt's logits are in).
    seqs: Vec<SeqState>,
    /// The tokens the beams run next, at `pos`.
    tokens: Vec<u32>,
    pos: usize,
}

/// A row of a round's decode step: request `request`'s `token` at `pos`; `first`: its prompt's
/// last token, whose logits choose its first token.
#[derive(Debug, Clone, Copy)]
struct Row {
    request: usize,
    token: u32,
    pos: usize,
    first: bool,
    /// The beam of a beam search request whose sequence the row runs in.
    beam: Option<usize>,
    /// A speculating request's draft this row checks (1 = the first; 0: its own token).
    draft: usize,
}

/// A sequence's state: what a request (or a beam, or a draft model's copy of a request) keeps
/// of the positions it has run — its keys and values, in a KV-pool sequence on the GPU or a
/// cache of its own on the CPU reference. Every change of a sequence's state is a method here:
/// made (from the prefix cache), forked (beams), cut back (rejected drafts), released (its full
/// blocks committed to the prefix cache). A model whose layers carry a recurrent state (Gated
/// DeltaNet, short convolutions) adds it beside the blocks: copied in `fork`, restored from a
/// per-position snapshot in `truncate`, snapshotted at block ends for `commit`/`create`.
enum SeqState {
    Cpu(Box<CpuKvCache>),
    Gpu(SeqId),
}

impl SeqState {
    /// A new sequence for `tokens` (to run from position 0), holding the longest prefix of them
    /// the prefix cache has (GPU), and that prefix's length.
    fn create(engine: &mut Engine, tokens: &[u32]) -> Result<(Self, usize)> {
        match &mut engine.backend {
            Backend::Cpu { model } => Ok((SeqState::Cpu(Box::new(model.new_cache())), 0)),
            Backend::Gpu(model) => {
                let (seq, reused) = model.new_sequence_cached(tokens)?;
                Ok((SeqState::Gpu(seq), reused))
            }
        }
    }

    /// A new sequence holding the first `len` positions of this one (on the GPU sharing its
    /// blocks).
    fn fork(&self, engine: &mut Engine, len: usize) -> Result<Self> {
        let kv_dim = engine.config.kv_dim();
        match (self, &mut engine.backend) {
            (&SeqState::Gpu(seq), Backend::Gpu(model)) => Ok(SeqState::Gpu(model.fork_sequence(seq, len)?)),
            (SeqState::Cpu(cache), Backend::Cpu { .. }) => {
                let mut copy = cache.clone();
                copy.truncate(len, kv_dim);
                Ok(SeqState::Cpu(copy))
            }
            _ => unreachable!("a sequence is on its engine's backend"),
        }
    }

    /// Keeps the first `len` positions (rejected drafts, a draft model's catch-up).
    fn truncate(&mut self, backend: &mut Backend, kv_dim: usize, len: usize) {
        match (self, backend) {
            (&mut SeqState::Gpu(seq), Backend::Gpu(model)) => model.truncate_sequence(seq, len),
            (SeqState::Cpu(cache), Backend::Cpu { .. }) => cache.truncate(len, kv_dim),
            _ => unreachable!("a sequence is on its engine's backend"),
        }
    }

    /// Registers its full blocks among the positions of `written` (the tokens whose keys and
    /// values it holds, from position 0) in the prefix cache.
    fn commit(&self, engine: &mut Engine, written: &[u32]) {
        if let (&SeqState::Gpu(seq), Some(m)) = (self, engine.gpu_model_mut()) {
            m.commit_sequence(seq, written);
        }
    }

    /// Frees it, its full blocks among the positions of `written` committed first (`&[]`:
    /// nothing it wrote is kept).
    fn release(&self, engine: &mut Engine, written: &[u32]) {
        self.commit(engine, written);
        if let (&SeqState::Gpu(seq), Some(m)) = (self, engine.gpu_model_mut()) {
            m.free_sequence(seq);
        }
    }
}

struct Request {
    id: RequestId,
    seq: BatchSeq,
    /// The prompt's sequence (and, sampling, the generated tokens').
    kv: SeqState,
    /// A beam search's state and its beams' sequences.
    beam: Option<Box<Beams>>,
    /// Positions of `seq.tokens` whose keys and values are in `kv` (from the prefix cache, then
    /// prefilled or recomputed, then decoded): the rest are to run before it decodes.
    computed: usize,
}

pub struct Batcher {
    requests: Vec<Request>,
    /// Requests enqueued and not yet admitted, in order (admitted at the start of a round).
    waiting: VecDeque<(RequestId, Prepared)>,
    /// Requests preempted for their blocks, admitted again before any waiting one, in the order
    /// they were first admitted.
    preempted: VecDeque<(RequestId, BatchSeq)>,
    preemptions: u64,
    next_id: RequestId,
    /// The sequence `admit_as` made (and the positions it forked), for `push_admitted`.
    admitted: Option<(SeqState, usize)>,
    prefill_budget: usize,
    max_rows: usize,
    /// A round's decode rows and prompt chunks (request index, first position, tokens), reused.
    rows: Vec<Row>,
    /// Whether greedy rounds are pipelined (`set_pipelining`).
    pipeline: bool,
    /// A greedy round submitted ahead (`step`'s pipelining) and its rows' (request, position).
    ahead: Option<RoundFlight>,
    ahead_rows: Vec<(RequestId, usize)>,
    chunks: Vec<(usize, usize, usize)>,
    gpu_rows: Vec<(SeqId, u32, usize)>,
    /// What each row reads back (its sampler's needs), and where: every row's argmax, the
    /// selections of top-k/top-p/min-p rows, the logits of rows that need them all (row after
    /// row, a vocabulary each; grown on first use).
    want: Vec<RowReadback>,
    /// `want` of the round submitted ahead (its drawing rows' next uniforms).
    want_ahead: Vec<RowReadback>,
    ids: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
    tails: Vec<Tail>,
    logits: Vec<f32>,
}

impl Batcher {
    /// A batcher over `engine`'s KV pool (and its prefix cache). `prefill_budget`: prompt
    /// tokens run per round (at least 1).
    pub fn new(engine: &Engine, prefill_budget: usize) -> Self {
        let max_rows = match engine.gpu_model() {
            Some(m) => m.max_batch(),
            None => crate::gpu::kernels::MAX_BATCH,
        };
        Self {
            requests: Vec::new(),
            waiting: VecDeque::new(),
            preempted: VecDeque::new(),
            preemptions: 0,
            next_id: 0,
            admitted: None,
            prefill_budget: prefill_budget.max(1),
            max_rows,
            rows: Vec::with_capacity(max_rows),
            chunks: Vec::with_capacity(ROUND_PASSES),
            pipeline: true,
            ahead: None,
            ahead_rows: Vec::with_capacity(max_rows),
            gpu_rows: Vec::with_capacity(max_rows),
            want: Vec::with_capacity(max_rows),
            want_ahead: Vec::with_capacity(max_rows),
            ids: vec![0; max_rows],
            // A row's selection grows to its k the first time it selects, then is reused.
            top: vec![Vec::new(); max_rows],
            tails: vec![Tail::default(); max_rows],
            logits: Vec::new(),
        }
    }

    /// Requests one decode step takes at most (and so the most the batch admits).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Runs at most `rows` requests at once (at least 1; no more than a decode step takes).
    pub fn limit_rows(&mut self, rows: usize) {
        self.max_rows = rows.clamp(1, self.max_rows);
    }

    /// Pipelines greedy rounds (submits round n + 1 before reading round n's ids) or not; on by
    /// default: the GPU does not wait for the host between rounds. (Even on lavapipe, whose
    /// "GPU" shares the host's two cores here: `bench --batch 8 --pipeline true|false`, five
    /// runs of each in turn, 41.0 against 37.7 tok/s.)
    pub fn set_pipelining(&mut self, on: bool) {
        self.pipeline = on;
        if !on {
            self.ahead = None;
        }
    }

    /// The waiting requests' ids, oldest first (preempted ones, which ran before, are not
    /// among them).
    pub fn waiting_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter().map(|w| w.0)
    }

    /// Requests running (admitted, not ended).
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Requests enqueued and not yet admitted (preempted ones included).
    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.preempted.len()
    }

    /// Nothing running and nothing waiting.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty() && self.waiting.is_empty() && self.preempted.is_empty()
    }

    /// Requests whose prompt (or, preempted, whose tokens so far) is not yet all run.
    pub fn prefilling(&self) -> usize {
        self.requests.iter().filter(|r| r.computed < r.seq.tokens.len()).count()
    }

    /// Requests preempted so far (their blocks taken for others', to be recomputed).
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Checks a request against the model: options, prompt tokens, context. Errors here are the
    /// request's own (it can never run); `admit` then only says whether there is room now.
    pub fn prepare(engine: &Engine, prompt: &Prompt, options: &GenerateOptions) -> Result<Prepared> {
        Self::prepare_with(engine, prompt, options, None)
    }

    /// `prepare` with `options.constraint` already compiled (`PromptEncoder::constraint`, off
    /// the thread that runs the batch); None: compiled here.
    pub fn prepare_with(
        engine: &Engine,
        prompt: &Prompt,
        options: &GenerateOptions,
        compiled: Option<Constraint>,
    ) -> Result<Prepared> {
        options.validate()?;
        // Prompt lookup drafts on the host, from the request's own tokens; self-speculation with
        // passes of the model's first layers in the request's own sequence; a draft model in a
        // sequence of the request's own in its pool: their drafts are rows of the batch's steps.
        match options.speculate.map(|s| s.drafter) {
            Some(Drafter::Model) if engine.draft.is_none() => {
                return Err(Error::InvalidOption {
                    name: "speculate",
                    value: "draft".into(),
                    expected:
                        "lookup or layers:L: no draft model is loaded (the CLI's --speculate draft:PATH loads one)"
                            .into(),
                })
            }
            Some(Drafter::Mtp) if !engine.has_mtp() => {
                return Err(Error::InvalidOption {
                    name: "speculate",
                    value: "mtp".into(),
                    expected:
                        "lookup or layers:L: this model has no multi-token-prediction head (Qwen3.5's nextn layer)"
                            .into(),
                })
            }
            Some(Drafter::Layers(layers)) if layers == 0 || layers >= engine.config.n_layers => {
                return Err(Error::InvalidOption {
                    name: "speculate",
                    value: format!("layers:{layers}"),
                    expected: format!(
                        "layers:L with L from 1 to {} (the model has {} layers)",
                        engine.config.n_layers - 1,
                        engine.config.n_layers
                    ),
                })
            }
            _ => {}
        }
        let tokens = engine.checked_prompt(prompt, options.tools.as_deref(), options.max_tokens)?;
        let mut sampler = Sampler::new(options.sampling.clone(), engine.config.vocab_size)?;
        tokens.iter().for_each(|&id| sampler.accept(id));
        match (compiled, &options.constraint) {
            (Some(c), Some(_)) => sampler.constrain(c),
            (None, Some(spec)) => sampler.constrain(engine.compile_constraint(spec)?),
            _ => {}
        }
        Ok(Prepared { tokens, sampler, options: options.clone(), vocab_size: engine.config.vocab_size, beams: None })
    }

    /// Checks a beam search request (transformers' semantics, `beam::BeamSearch`): its beams
    /// are sequences forked in the pool that run as rows of the batch's steps, beside the other
    /// requests; it answers with `BatchEvent::Beams` when the search ends.
    pub fn prepare_beams(engine: &Engine, prompt: &Prompt, options: &BeamOptions) -> Result<Prepared> {
        options.validate()?;
        let rows = engine.gpu_model().map_or(crate::gpu::kernels::MAX_BATCH, |m| m.max_batch());
        if options.beams > rows {
            return Err(Error::InvalidOption {
                name: "beams",
                value: options.beams.to_string(),
                expected: format!("at most {rows} at this context on this GPU (a decode step's rows)"),
            });
        }
        let tokens = engine.checked_prompt(prompt, None, options.max_tokens)?;
        let greedy = GenerateOptions {
            max_tokens: options.max_tokens,
            sampling: crate::sampling::SamplingParams::greedy(),
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let sampler = Sampler::new(greedy.sampling.clone(), engine.config.vocab_size)?;
        Ok(Prepared {
            tokens,
            sampler,
            options: greedy,
            vocab_size: engine.config.vocab_size,
            beams: Some(options.clone()),
        })
    }

    /// The pool's free blocks (unbounded on the CPU backend, which has no pool).
    fn free_blocks(engine: &Engine) -> usize {
        engine.gpu_model().map_or(usize::MAX, |m| m.pool().free_blocks())
    }

    /// The blocks of the free count a request with `tokens` to run (then one position to
    /// decode) takes when admitted, and the positions it starts with from the prefix cache
    /// (whole blocks, short of the last token, whose logits it needs from its own pass; 0 on the
    /// CPU backend, which has no pool): its blocks past the cached ones, and the cached ones no
    /// sequence holds (idle in the cache, so counted as free until taken).
    fn blocks_to_admit(engine: &Engine, tokens: &[u32]) -> (usize, usize) {
        engine.gpu_model().map_or((0, 0), |m| {
            let pool = m.pool();
            let bt = pool.block_tokens();
            let (reused, idle) = pool.cached_prefix(&tokens[..tokens.len() - 1]);
            ((tokens.len() + 1).div_ceil(bt) - reused / bt + idle, reused)
        })
    }

    /// Whether a request with `tokens` to run fits now: a row, a sequence slot and the blocks of
    /// its tokens and its first decoded position, with `margin` blocks to spare (for the running
    /// requests to grow by).
    fn make_room(&self, engine: &Engine, tokens: &[u32], rows: usize, margin: usize) -> bool {
        if self.rows_taken() + rows > self.max_rows {
            return false;
        }
        let slot = engine.gpu_model().is_none_or(|m| m.pool().free_slots() > 0);
        slot && Self::blocks_to_admit(engine, tokens).0.saturating_add(margin) <= Self::free_blocks(engine)
    }

    /// Blocks request `i` takes to hold `len` positions (0 on the CPU backend).
    fn blocks_to_grow(&self, engine: &Engine, i: usize, len: usize) -> usize {
        Self::seq_blocks(engine, &self.requests[i].kv, len)
    }

    /// Blocks a row takes (in its request's sequence or its beam's).
    fn row_blocks(&self, engine: &Engine, row: &Row) -> usize {
        let r = &self.requests[row.request];
        let kv = match (row.beam, &r.beam) {
            (Some(b), Some(beams)) => &beams.seqs[b],
            _ => &r.kv,
        };
        Self::seq_blocks(engine, kv, row.pos + 1)
    }

    fn seq_blocks(engine: &Engine, kv: &SeqState, len: usize) -> usize {
        match (kv, engine.gpu_model()) {
            (&SeqState::Gpu(seq), Some(m)) => m.pool().blocks_to_reserve(seq, len),
            _ => 0,
        }
    }

    /// Rows of a decode step the running requests take (a beam search one a beam).
    fn rows_taken(&self) -> usize {
        self.requests.iter().map(|r| rows_of(&r.seq.beams, &r.seq.options).0).sum()
    }

    /// Running requests that will decode (each may take a block at its next step): the room
    /// an admission leaves them.
    fn decoding(&self) -> usize {
        self.requests.iter().filter(|r| r.computed == r.seq.tokens.len()).count()
    }

    /// Takes the most recently admitted request out of the batch for its blocks: it waits at
    /// the head of the queue with its state, and is recomputed from its tokens when admitted
    /// again.
    /// (A beam search is not preempted: its beams' sequences would all have to be recomputed.)
    /// Returns the index it had, or None when only beam searches run at or past `floor`.
    fn preempt_last(&mut self, engine: &mut Engine, floor: usize) -> Option<usize> {
        let i = (floor..self.requests.len()).rev().find(|&i| self.requests[i].beam.is_none())?;
        let mut r = self.requests.remove(i);
        r.kv.release(engine, &r.seq.tokens[..r.computed]);
        r.seq.free_draft(engine);
        self.preemptions += 1;
        self.preempted.push_front((r.id, r.seq));
        Some(i)
    }

    /// Frees blocks until `needed` are free: preempts running requests, most recently admitted
    /// first, from `floor` on. Whether they now are.
    fn free_up(&mut self, engine: &mut Engine, needed: usize, floor: usize) -> bool {
        while needed > Self::free_blocks(engine) {
            if self.preempt_last(engine, floor).is_none() {
                return false;
            }
        }
        true
    }

    /// Queues a prepared request: each round first admits the waiting requests, in order,
    /// while the batch has a row and the pool the room for them. One
    /// that cannot run even in an empty batch fails (`BatchEvent::Failed`, with `admit`'s error).
    pub fn enqueue(&mut self, p: Prepared) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, p));
        id
    }

    /// Admits a prepared request: it is prefilled from the next `step` on (past the prefix the
    /// prefix cache holds). Refused, the request comes back with the error
    /// (`TooManySequences` or `KvPoolFull`), to wait or be dropped.
    pub fn admit(
        &mut self,
        engine: &mut Engine,
        p: Prepared,
    ) -> std::result::Result<RequestId, (Error, Box<Prepared>)> {
        let id = self.next_id;
        if let Err(e) = self.admit_as(engine, &p.tokens, rows_of(&p.beams, &p.options)) {
            return Err((e, Box::new(p)));
        }
        self.next_id += 1;
        let seq = BatchSeq::new(p);
        self.push_admitted(id, seq);
        Ok(id)
    }

    /// Checks that a request with `tokens` can start now and makes its sequence; it is pushed
    /// by `push_admitted`.
    fn admit_as(&mut self, engine: &mut Engine, tokens: &[u32], (rows, beams): (usize, bool)) -> Result<()> {
        if rows > self.max_rows {
            return Err(Error::InvalidOption {
                // (Only a beam search or a speculating request takes more than one row.)
                name: if beams { "beams" } else { "draft tokens" },
                value: rows.to_string(),
                expected: format!("at most {} (the rows of this batch's decode step)", self.max_rows),
            });
        }
        if self.rows_taken() + rows > self.max_rows {
            return Err(Error::TooManySequences { max: self.max_rows });
        }
        let fits = self.make_room(engine, tokens, rows, 0);
        let (needed, _) = Self::blocks_to_admit(engine, tokens);
        let free_blocks = Self::free_blocks(engine);
        if let Some(pool) = engine.gpu_model().map(|m| m.pool()).filter(|_| !fits && needed > free_blocks) {
            let bt = pool.block_tokens();
            return Err(Error::KvPoolFull {
                needed_tokens: needed * bt,
                free_tokens: free_blocks * bt,
                capacity_tokens: pool.blocks() * bt,
            });
        }
        // The last token runs whatever the cache holds: its logits choose the first token.
        let (kv, reused) = SeqState::create(engine, &tokens[..tokens.len() - 1])?;
        self.admitted = Some((kv, reused));
        Ok(())
    }

    /// Pushes the request `admit_as` made room for.
    fn push_admitted(&mut self, id: RequestId, mut seq: BatchSeq) {
        let (kv, reused) = self.admitted.take().expect("admit_as made its sequence");
        if seq.next.is_none() {
            seq.reused = reused;
        }
        let beam = seq.beams.clone().map(|options| {
            let search = BeamSearch::new(options, seq.prompt_len).expect("validated by prepare_beams");
            Box::new(Beams { search, seqs: Vec::new(), tokens: Vec::new(), pos: 0 })
        });
        self.requests.push(Request { id, seq, kv, beam, computed: reused });
    }

    /// Ends a request now (its client went away): it leaves the batch (or the queue) and its
    /// blocks are free. Returns its stats, or None when no such request is running or waiting.
    pub fn cancel(&mut self, engine: &mut Engine, id: RequestId) -> Option<Stats> {
        if let Some(i) = self.waiting.iter().position(|w| w.0 == id) {
            let (_, p) = self.waiting.remove(i).expect("found");
            let mut seq = BatchSeq::new(p);
            seq.stop = Some(StopReason::Aborted);
            return Some(seq.stats());
        }
        if let Some(i) = self.preempted.iter().position(|w| w.0 == id) {
            let (_, mut seq) = self.preempted.remove(i).expect("found");
            seq.stop.get_or_insert(StopReason::Aborted);
            return Some(seq.stats());
        }
        let i = self.requests.iter().position(|r| r.id == id)?;
        let mut r = self.requests.remove(i);
        r.seq.stop.get_or_insert(StopReason::Aborted);
        let stats = r.seq.stats();
        self.retire(engine, r, true);
        Some(stats)
    }

    /// Ends every request (after an error that is not one request's: a lost device): every
    /// block the batcher held is back in the pool (what they wrote stays in the prefix cache).
    pub fn clear(&mut self, engine: &mut Engine) -> Vec<RequestId> {
        let ids = self
            .requests
            .iter()
            .map(|r| r.id)
            .chain(self.preempted.drain(..).map(|w| w.0))
            .chain(self.waiting.drain(..).map(|w| w.0))
            .collect();
        for r in std::mem::take(&mut self.requests) {
            self.retire(engine, r, false);
        }
        ids
    }

    /// A request leaves: its blocks go back to the pool, those it wrote in full staying in the
    /// prefix cache (unless it failed: `keep` false, nothing it wrote is kept).
    fn retire(&mut self, engine: &mut Engine, mut r: Request, keep: bool) {
        free_beams(engine, &mut r);
        r.seq.free_draft(engine);
        let written = if keep { r.computed } else { 0 };
        r.kv.release(engine, &r.seq.tokens[..written]);
    }

    /// One round: admit waiting requests, then one pass of the model over rows of every kind:
    /// a decode row of every running request for which `ready(id)` (a request whose reader is
    /// behind waits; its state is kept), and up to `prefill_budget` prompt tokens of requests
    /// still being prefilled (in chunks of at most `Engine::pass_rows`, oldest request first),
    /// whose prompt's last token is a row of the decode step, which chooses its first token.
    /// On the GPU the round is one submission (`GpuModel::submit_round`). Then the finished
    /// requests leave. Events go to `on_event`. Returns the decode step's rows. An error here
    /// is not one request's (the batch should be cleared).
    pub async fn step(
        &mut self,
        engine: &mut Engine,
        ready: &mut dyn FnMut(RequestId) -> bool,
        on_event: &mut dyn FnMut(RequestId, BatchEvent) -> bool,
    ) -> Result<usize> {
        self.admit_waiting(engine, on_event);
        let vocab = engine.config.vocab_size;
        let on_gpu = engine.gpu_model().is_some();

        let context = engine.context_length();
        // Decode rows first (a running request keeps its pace), with the blocks they grow into:
        // the requests admitted last give theirs up first (their rows with them).
        self.rows.clear();
        for (i, r) in self.requests.iter_mut().enumerate() {
            if r.seq.stop.is_some() || r.seq.failed.is_some() {
                continue;
            }
            if let Some(beams) = &r.beam {
                // Every beam a row (none before the prompt's logits are in); a search emits
                // nothing until it ends, so it never waits for its reader.
                for (b, &token) in beams.tokens.iter().enumerate() {
                    self.rows.push(Row { request: i, token, pos: beams.pos, first: false, beam: Some(b), draft: 0 });
                }
            } else if let Some(next) = r.seq.next {
                if r.computed == r.seq.tokens.len() && ready(r.id) {
                    let pos = r.seq.tokens.len();
                    self.rows.push(Row { request: i, token: next, pos, first: false, beam: None, draft: 0 });
                    // Speculation: the drafts after `next` are rows of the same step, at the
                    // positions after it (no more than the tokens still to emit after it).
                    if let Some(spec) = &mut r.seq.spec {
                        let left = r.seq.options.max_tokens.saturating_sub(r.seq.generated + 1);
                        let k = spec.speculation.draft_tokens.min(left).min(context.saturating_sub(pos + 1));
                        match spec.speculation.drafter {
                            Drafter::Layers(layers) => {
                                // The first layers' decode steps, one a draft token, in the
                                // request's sequence (their keys and values the whole model's).
                                spec.draft.clear();
                                let mut prev = next;
                                for d in 0..k {
                                    let drafted = match (&mut engine.backend, &mut r.kv) {
                                        (Backend::Gpu(model), &mut SeqState::Gpu(seq)) => {
                                            model.draft_step_in(seq, layers, prev, pos + d).await
                                        }
                                        (Backend::Cpu { model, .. }, SeqState::Cpu(cache)) => {
                                            model.forward_layers(cache, &[prev], Logits::Last, layers).and_then(|l| {
                                                if all_finite(&l) {
                                                    Ok(argmax(&l))
                                                } else {
                                                    Err(Error::NonFiniteLogits { position: pos + d + 1 })
                                                }
                                            })
                                        }
                                        _ => unreachable!("a request's cache is on its engine's backend"),
                                    };
                                    prev = match drafted {
                                        Ok(id) => id,
                                        // No block for another draft: check those so far.
                                        Err(Error::KvPoolFull { .. }) => break,
                                        // The request fails, not the batch (its row goes).
                                        Err(e @ Error::NonFiniteLogits { .. }) => {
                                            r.seq.failed = Some(e);
                                            self.rows.pop();
                                            break;
                                        }
                                        Err(e) => return Err(e),
                                    };
                                    spec.stats.draft_passes += 1;
                                    spec.draft.push(prev);
                                }
                                // The partial layers leave the CPU cache's lengths uneven.
                                if let SeqState::Cpu(_) = r.kv {
                                    r.kv.truncate(&mut engine.backend, engine.config.kv_dim(), pos);
                                }
                                if r.seq.failed.is_some() {
                                    continue;
                                }
                            }
                            Drafter::Model => {
                                spec.context.clear();
                                spec.context.extend_from_slice(&r.seq.tokens);
                                spec.context.push(next);
                                let draft = engine.draft.as_deref_mut().expect("refused at prepare without one");
                                spec.model.draft(draft, &spec.context, k, vocab, &mut spec.draft).await?;
                                spec.stats.draft_passes += spec.draft.len();
                            }
                            Drafter::Mtp => {
                                spec.context.clear();
                                spec.context.extend_from_slice(&r.seq.tokens);
                                spec.context.push(next);
                                match (&mut engine.backend, &mut r.kv) {
                                    (Backend::Cpu { model, .. }, SeqState::Cpu(cache)) => {
                                        model.mtp_draft(cache, &spec.context, k, &mut spec.draft)?
                                    }
                                    (Backend::Gpu(model), &mut SeqState::Gpu(seq)) => {
                                        model.mtp_draft_in(seq, &spec.context, k, &mut spec.draft).await?
                                    }
                                    _ => unreachable!("a request's cache is on its engine's backend"),
                                }
                                spec.stats.draft_passes += spec.draft.len();
                            }
                            Drafter::Lookup => {
                                spec.context.clear();
                                spec.context.extend_from_slice(&r.seq.tokens);
                                spec.context.push(next);
                                speculate::lookup(&spec.context, k, &mut spec.draft);
                            }
                        }
                        for (d, &token) in spec.draft.iter().enumerate() {
                            self.rows.push(Row {
                                request: i,
                                token,
                                pos: pos + 1 + d,
                                first: false,
                                beam: None,
                                draft: d + 1,
                            });
                        }
                    }
                }
            }
        }
        let mut committed;
        loop {
            // A speculating request's rows are one sequence's consecutive positions: its last
            // row's blocks are all of them.
            let rows = &self.rows;
            committed = (0..rows.len())
                .filter(|&k| rows.get(k + 1).is_none_or(|n| n.request != rows[k].request || n.draft == 0))
                .map(|k| self.row_blocks(engine, &rows[k]))
                .sum();
            let free = Self::free_blocks(engine);
            if committed <= free {
                break;
            }
            let i = match self.preempt_last(engine, 0) {
                Some(i) => i,
                None => {
                    // Only beam searches hold rows: the last one fails for want of blocks.
                    let i = (0..self.requests.len()).rev().find(|&i| self.rows.iter().any(|r| r.request == i));
                    let i = i.expect("rows that need blocks belong to requests");
                    let r = &mut self.requests[i];
                    free_beams(engine, r);
                    let bt = engine.gpu_model().map_or(1, |m| m.pool().block_tokens());
                    let capacity_tokens = engine.gpu_model().map_or(0, |m| m.pool().blocks()) * bt;
                    r.seq.failed = Some(Error::KvPoolFull {
                        needed_tokens: committed * bt,
                        free_tokens: free * bt,
                        capacity_tokens,
                    });
                    self.rows.retain(|r| r.request != i);
                    continue;
                }
            };
            self.rows.retain(|r| r.request != i);
            self.rows.iter_mut().filter(|r| r.request > i).for_each(|r| r.request -= 1);
        }

        // Then prompt chunks within the budget, each with its blocks (from the requests admitted
        // after it only when nothing else would run this round).
        self.chunks.clear();
        let mut budget = self.prefill_budget;
        // A round is one pass of at most `pass_rows` rows: its decode rows and its chunks' tokens.
        let rows = engine.pass_rows();
        let mut room = rows.saturating_sub(self.rows.len());
        let mut i = 0;
        while i < self.requests.len() && budget > 0 && room > 0 && self.chunks.len() + 1 < ROUND_PASSES {
            i += 1;
            let (computed, len) = (self.requests[i - 1].computed, self.requests[i - 1].seq.tokens.len());
            if computed == len || self.requests[i - 1].seq.failed.is_some() {
                continue;
            }
            let n = budget.min(rows).min(len - computed).min(room);
            // Blocks are taken when the round runs: this chunk's come after those already
            // counted for it.
            let needed = committed + self.blocks_to_grow(engine, i - 1, computed + n);
            let fits = if self.rows.is_empty() && self.chunks.is_empty() {
                self.free_up(engine, needed, i)
            } else {
                needed <= Self::free_blocks(engine)
            };
            if !fits {
                continue;
            }
            committed = needed;
            let r = &mut self.requests[i - 1];
            if r.seq.next.is_none() && computed == r.seq.reused {
                r.seq.start = Instant::now();
            }
            budget -= n;
            room -= n;
            // A prompt's last token is a decode row: its logits choose the first token. (A
            // preempted request's tokens are recomputed: its next token is already chosen.)
            let first = computed + n == len && r.seq.next.is_none();
            let run = n - first as usize;
            if run > 0 {
                self.chunks.push((i - 1, computed, run));
            }
            if first {
                let token = r.seq.tokens[len - 1];
                self.rows.push(Row { request: i - 1, token, pos: len - 1, first: true, beam: None, draft: 0 });
            }
        }

        let n = self.rows.len();
        self.want.clear();
        self.want.extend(self.rows.iter().map(|r| self.requests[r.request].seq.row_readback(on_gpu)));
        // A row the GPU draws for takes its sampler's next uniform (or the one drawn for it
        // when a round was submitted ahead).
        for (w, row) in self.want.iter_mut().zip(&self.rows) {
            if let RowReadback::Draw { draw, .. } = w {
                draw.u = self.requests[row.request].seq.sampler.gpu_uniform(false);
            }
        }
        if self.want.contains(&RowReadback::Logits) || (!on_gpu && n > 0) {
            self.logits.resize(self.logits.len().max(n.max(1) * vocab), 0.0);
        }
        match &mut engine.backend {
            Backend::Cpu { model, .. } => {
                for &(i, start, len) in &self.chunks {
                    let r = &mut self.requests[i];
                    let SeqState::Cpu(cache) = &mut r.kv else { unreachable!() };
                    model.forward(cache, &r.seq.tokens[start..start + len], Logits::Last)?;
                }
                for (k, row) in self.rows.iter().enumerate() {
                    let r = &mut self.requests[row.request];
                    let kv = match (row.beam, &mut r.beam) {
                        (Some(b), Some(beams)) => &mut beams.seqs[b],
                        _ => &mut r.kv,
                    };
                    let SeqState::Cpu(cache) = kv else { unreachable!() };
                    let out = model.forward(cache, &[row.token], Logits::Last)?;
                    // As the GPU's argmax does: non-finite logits flag the row.
                    self.ids[k] = if all_finite(&out) { argmax(&out) } else { u32::MAX };
                    self.logits[k * vocab..][..vocab].copy_from_slice(&out);
                }
            }
            Backend::Gpu(model) => {
                self.gpu_rows.clear();
                for row in &self.rows {
                    let r = &self.requests[row.request];
                    let kv = match (row.beam, &r.beam) {
                        (Some(b), Some(beams)) => &beams.seqs[b],
                        _ => &r.kv,
                    };
                    let &SeqState::Gpu(seq) = kv else { unreachable!() };
                    self.gpu_rows.push((seq, row.token, row.pos));
                }
                let prefills: Vec<(SeqId, &[u32], usize)> = self
                    .chunks
                    .iter()
                    .map(|&(i, start, len)| {
                        let r = &self.requests[i];
                        let SeqState::Gpu(seq) = r.kv else { unreachable!() };
                        (seq, &r.seq.tokens[start..start + len], start)
                    })
                    .collect();
                // Rows under a constraint choose among the tokens its mask allows: the GPU
                // applies the mask to their argmax or selection (a row that reads its logits
                // is masked on the host).
                let requests = &self.requests;
                let masked = self.rows.iter().zip(&self.want).any(|(row, w)| {
                    *w != RowReadback::Logits && requests[row.request].seq.sampler.constraint().is_some()
                });
                // Greedy rounds of the same rows, nothing else to run or admit, no masks: round
                // n + 1 is submitted before round n's ids are read (its tokens are round n's
                // argmax, on the GPU), so the GPU does not wait for the host between rounds.
                let greedy = self.pipeline
                    && !masked
                    && n > 0
                    && prefills.is_empty()
                    && self.waiting.is_empty()
                    && self.preempted.is_empty()
                    && self.want.iter().all(|w| matches!(w, RowReadback::Argmax | RowReadback::Draw { .. }))
                    && self
                        .rows
                        .iter()
                        .all(|r| !r.first && r.beam.is_none() && self.requests[r.request].seq.spec.is_none());
                let ahead = self.ahead.take().filter(|_| {
                    greedy
                        && self.ahead_rows.len() == n
                        && self
                            .ahead_rows
                            .iter()
                            .zip(&self.rows)
                            .all(|(&(id, pos), row)| id == self.requests[row.request].id && pos == row.pos)
                });
                let mut flight = match ahead {
                    Some(flight) => Some(flight),
                    None if n > 0 || !prefills.is_empty() => {
                        Some(model.submit_round(&prefills, &self.gpu_rows, &self.want, false, masked)?)
                    }
                    None => None,
                };
                drop(prefills);
                if let (true, Some(flight)) = (masked, &mut flight) {
                    // The masks for the tokens so far, computed while the GPU runs the pass;
                    // a row selects at most the tokens its mask allows.
                    for (k, row) in self.rows.iter().enumerate() {
                        let sampler = &mut self.requests[row.request].seq.sampler;
                        let Some(mask) = sampler.prepare_mask() else { continue };
                        match self.want[k] {
                            // A row drawing on the GPU has no constraint (`RowReadback::for_sampler`).
                            RowReadback::Logits | RowReadback::Draw { .. } => continue,
                            RowReadback::Argmax => model.set_mask(k, mask),
                            RowReadback::Select { k: top, tail } => {
                                model.set_mask(k, mask);
                                let top = top.min(sampler.allowed_tokens());
                                self.want[k] = RowReadback::Select { k: top, tail };
                            }
                        }
                    }
                    model.finish_round(flight, &self.want)?;
                }
                let look_ahead = greedy
                    && self.rows.iter().all(|row| {
                        let r = &self.requests[row.request];
                        r.seq.generated + 1 < r.seq.options.max_tokens && row.pos + 2 <= model.context
                    })
                    && self
                        .gpu_rows
                        .iter()
                        .map(|&(seq, _, pos)| model.pool().blocks_to_reserve(seq, pos + 2))
                        .sum::<usize>()
                        <= model.pool().free_blocks();
                if look_ahead {
                    self.gpu_rows.iter_mut().for_each(|r| r.2 += 1);
                    // Its drawing rows' uniforms: the next of each sampler, kept for the round
                    // that chooses that token (this one, or one submitted in its place).
                    self.want_ahead.clear();
                    for (w, row) in self.want.iter().zip(&self.rows) {
                        self.want_ahead.push(match *w {
                            RowReadback::Draw { k, mut draw } => {
                                draw.u = self.requests[row.request].seq.sampler.gpu_uniform(true);
                                RowReadback::Draw { k, draw }
                            }
                            w => w,
                        });
                    }
                    self.ahead = Some(model.submit_round(&[], &self.gpu_rows, &self.want_ahead, true, false)?);
                    self.ahead_rows.clear();
                    let requests = &self.requests;
                    self.ahead_rows.extend(self.rows.iter().map(|row| (requests[row.request].id, row.pos + 1)));
                }
                let readback = RowsReadback {
                    want: &self.want,
                    ids: &mut self.ids,
                    top: &mut self.top,
                    tails: &mut self.tails,
                    logits: &mut self.logits,
                };
                if let Some(flight) = flight {
                    model.read_round(flight, readback).await?;
                }
            }
        }
        for &(i, _, len) in &self.chunks {
            self.requests[i].computed += len;
        }
        // Beam searches and speculation first (a fallback read below reuses the first row's
        // logits).
        self.advance_beams(engine, on_event);
        self.advance_speculation(engine, on_event)?;
        for (k, row) in self.rows.iter().enumerate() {
            let r = &mut self.requests[row.request];
            if r.beam.is_some() || (r.seq.spec.is_some() && !row.first) {
                continue;
            }
            if !row.first {
                r.seq.tokens.push(row.token);
            }
            r.computed += 1;
            // The argmax flags a row with non-finite logits (u32::MAX): that request fails;
            // the others go on.
            let want = self.want[k];
            let logits_row = !on_gpu || want == RowReadback::Logits;
            let logits = if logits_row { &mut self.logits[k * vocab..][..vocab] } else { &mut [][..] };
            if self.ids[k] == u32::MAX || (logits_row && !all_finite(logits)) {
                r.seq.failed = Some(Error::NonFiniteLogits { position: row.pos + 1 });
                continue;
            }
            let next =
                match r.seq.choose_from(&engine.tokenizer, want, self.ids[k], &self.top[k], self.tails[k], logits) {
                    Some(next) => next,
                    None => {
                        let Some(model) = engine.gpu_model() else { unreachable!("selected on the GPU") };
                        if let RowReadback::Draw { .. } = want {
                            // The GPU drew no token: the host draws from the row's logits with
                            // the uniform the GPU took.
                            r.seq.sampler.redraw();
                            let counters = &model.gpu.counters;
                            counters.redraws.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if self.ahead.is_some() {
                                // A round chained to this one has run over those logits (with
                                // no token for this row): this position runs again, reading them.
                                counters.reruns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                self.ahead = None;
                                r.computed -= 1;
                                if !row.first {
                                    r.seq.tokens.pop();
                                }
                                continue;
                            }
                        }
                        // A top-p/min-p cut the selection cannot place: this row's logits, still on
                        // the GPU until the next step.
                        self.logits.resize(self.logits.len().max(vocab), 0.0);
                        let logits = &mut self.logits[..vocab];
                        model.read_logits(k, logits).await?;
                        r.seq.choose(&engine.tokenizer, logits)
                    }
                };
            if next as usize >= vocab {
                return Err(Error::TokenOutOfRange { id: next, vocab_size: vocab });
            }
            if let Some(e) = r.seq.sampler.take_error() {
                r.seq.failed = Some(e);
                continue;
            }
            r.seq.next = Some(next);
            if row.first {
                if r.seq.spec.is_some() {
                    r.seq.origin = Some(TokenSpeculation { accepted: false, rejected: Vec::new() });
                }
                r.seq.ttft = r.seq.start.elapsed().as_secs_f64();
                r.seq.decode_start = Instant::now();
            } else {
                r.seq.decode_steps += 1;
            }
            let id = r.id;
            r.seq.emit(&engine.tokenizer, &mut |ev| on_event(id, BatchEvent::Token(ev)));
        }

        // The blocks each request filled this round join the prefix cache (for requests that
        // start with the same tokens, running or to come).
        for r in self.requests.iter().filter(|r| r.seq.failed.is_none()) {
            r.kv.commit(engine, &r.seq.tokens[..r.computed]);
        }

        let mut i = 0;
        while i < self.requests.len() {
            let r = &self.requests[i];
            if r.seq.stop.is_none() && r.seq.failed.is_none() {
                i += 1;
                continue;
            }
            let mut r = self.requests.remove(i);
            let id = r.id;
            match r.seq.failed.take() {
                Some(e) => {
                    self.retire(engine, r, false);
                    on_event(id, BatchEvent::Failed(e))
                }
                None => {
                    let stats = r.seq.stats();
                    self.retire(engine, r, true);
                    on_event(id, BatchEvent::Done(stats))
                }
            };
        }
        Ok(n)
    }

    /// Each beam search with rows this round takes its beams' logits one step further: its
    /// beams fork for the next step's rows, or it ends with its hypotheses.
    fn advance_beams(&mut self, engine: &mut Engine, on_event: &mut dyn FnMut(RequestId, BatchEvent) -> bool) {
        let vocab = engine.config.vocab_size;
        for i in 0..self.requests.len() {
            if self.requests[i].beam.is_none() {
                continue;
            }
            let rows: Vec<usize> = (0..self.rows.len()).filter(|&k| self.rows[k].request == i).collect();
            let Some(&k0) = rows.first() else { continue };
            let r = &mut self.requests[i];
            if self.rows[k0].first {
                r.computed += 1;
            }
            let beams = r.beam.as_mut().expect("a beam search");
            let logits: Vec<&[f32]> = rows.iter().map(|&k| &self.logits[k * vocab..][..vocab]).collect();
            match beams.search.advance(&logits) {
                Err(e) => r.seq.failed = Some(e),
                Ok(BeamStep::Run { from, tokens, pos }) => {
                    // The forks are made before the beams they replace are freed.
                    let beams = r.beam.as_mut().expect("a beam search");
                    let mut seqs = Vec::with_capacity(from.len());
                    for &f in &from {
                        let source = if beams.seqs.is_empty() { &r.kv } else { &beams.seqs[f] };
                        match source.fork(engine, pos) {
                            Ok(kv) => seqs.push(kv),
                            Err(e) => {
                                r.seq.failed = Some(e);
                                break;
                            }
                        }
                    }
                    for kv in std::mem::replace(&mut beams.seqs, seqs) {
                        kv.release(engine, &[]);
                    }
                    (beams.tokens, beams.pos) = (tokens, pos);
                }
                Ok(BeamStep::Done(found)) => {
                    let stop_ids = &r.seq.beams.as_ref().expect("a beam search").stop_ids;
                    let ended = found.first().is_some_and(|h| h.ids.last().is_some_and(|id| stop_ids.contains(id)));
                    r.seq.stop = Some(if ended { StopReason::Eos } else { StopReason::MaxTokens });
                    r.seq.generated = found.first().map_or(0, |h| h.ids.len());
                    beams.tokens.clear();
                    let texts = found
                        .into_iter()
                        .map(|h| {
                            let text = engine.tokenizer.decode(&h.ids).unwrap_or_default();
                            (h, text)
                        })
                        .collect();
                    on_event(r.id, BatchEvent::Beams(texts));
                }
            }
        }
    }

    /// Each speculating request with rows this round checks its drafts against its rows'
    /// logits (greedy keeps a draft while it is the model's argmax; sampling keeps it with
    /// probability p(draft), else draws from p without it: speculative sampling's rule for a
    /// deterministic drafter, so each token is distributed as plain sampling's), keeps
    /// its token and the accepted drafts in the cache, and emits them and the token chosen
    /// after them.
    fn advance_speculation(
        &mut self,
        engine: &mut Engine,
        on_event: &mut dyn FnMut(RequestId, BatchEvent) -> bool,
    ) -> Result<()> {
        let vocab = engine.config.vocab_size;
        let kv_dim = engine.config.kv_dim();
        let mut k = 0;
        while k < self.rows.len() {
            let row = self.rows[k];
            let n = 1 + self.rows[k + 1..].iter().take_while(|r| r.request == row.request && r.draft > 0).count();
            let (first, next) = (k, k + n);
            k = next;
            let r = &mut self.requests[row.request];
            if r.seq.spec.is_none() || row.first {
                continue;
            }
            let greedy = self.want[first] != RowReadback::Logits;
            let spec = r.seq.spec.as_mut().expect("a speculating request");
            let draft = std::mem::take(&mut spec.draft);
            let (mut j, mut chosen) = (0, 0);
            if greedy {
                if self.ids[first..next].contains(&u32::MAX) {
                    r.seq.failed = Some(Error::NonFiniteLogits { position: row.pos + 1 });
                    continue;
                }
                j = speculate::accepted(&draft, &self.ids[first..next]);
                // The model's own token after the accepted drafts.
                chosen = self.ids[first + j];
            } else {
                for (i, kk) in (first..next).enumerate() {
                    let logits = &mut self.logits[kk * vocab..][..vocab];
                    if !all_finite(logits) {
                        r.seq.failed = Some(Error::NonFiniteLogits { position: row.pos + i + 1 });
                        break;
                    }
                    let Some(&d) = draft.get(i) else {
                        chosen = r.seq.sampler.sample(logits);
                        break;
                    };
                    let (id, kept) = r.seq.sampler.check_draft(logits, d);
                    if !kept {
                        chosen = id;
                        break;
                    }
                    // Counted for the penalties of the positions after it; undone below.
                    r.seq.sampler.accept(d);
                    j += 1;
                }
                draft[..j].iter().for_each(|&d| r.seq.sampler.forget(d));
                if r.seq.failed.is_some() {
                    continue;
                }
            }
            if chosen as usize >= vocab {
                return Err(Error::TokenOutOfRange { id: chosen, vocab_size: vocab });
            }
            let spec = r.seq.spec.as_mut().expect("a speculating request");
            spec.stats.passes += 1;
            spec.stats.drafted += draft.len();
            spec.stats.accepted += j;
            // The token and the accepted drafts stay in the cache; the rejected ones go.
            r.kv.truncate(&mut engine.backend, kv_dim, row.pos + 1 + j);
            r.seq.tokens.push(row.token);
            let rejected: Vec<String> =
                draft[j..].iter().map(|&id| engine.tokenizer.decode(&[id]).unwrap_or_default()).collect();
            let id = r.id;
            for (i, &t) in draft[..j].iter().chain(std::iter::once(&chosen)).enumerate() {
                let accepted = i < j;
                let rejected = if accepted { Vec::new() } else { rejected.clone() };
                r.seq.origin = Some(TokenSpeculation { accepted, rejected });
                r.seq.next = Some(t);
                r.seq.decode_steps += 1;
                r.seq.emit(&engine.tokenizer, &mut |ev| on_event(id, BatchEvent::Token(ev)));
                if r.seq.stop.is_some() || r.seq.failed.is_some() {
                    break;
                }
                if accepted {
                    r.seq.tokens.push(t);
                }
            }
            r.computed = r.seq.tokens.len();
            r.seq.spec.as_mut().expect("a speculating request").draft = draft;
        }
        Ok(())
    }

    /// The round's admissions: preempted requests first (their blocks were taken, not
    /// refused), then the queue, in order; each leaves the running ones a block each to grow by.
    fn admit_waiting(&mut self, engine: &mut Engine, on_event: &mut dyn FnMut(RequestId, BatchEvent) -> bool) {
        while let Some((id, seq)) = self.preempted.pop_front() {
            let margin = self.decoding();
            let rows = rows_of(&seq.beams, &seq.options);
            if !self.requests.is_empty() && !self.make_room(engine, &seq.tokens, rows.0, margin) {
                self.preempted.push_front((id, seq));
                return;
            }
            match self.admit_as(engine, &seq.tokens, rows) {
                Ok(()) => self.push_admitted(id, seq),
                Err(e) => {
                    on_event(id, BatchEvent::Failed(e));
                }
            }
        }
        while let Some((id, p)) = self.waiting.pop_front() {
            let margin = self.decoding();
            if !self.requests.is_empty() && !self.make_room(engine, &p.tokens, rows_of(&p.beams, &p.options).0, margin)
            {
                self.waiting.push_front((id, p));
                return;
            }
            match self.admit_as(engine, &p.tokens, rows_of(&p.beams, &p.options)) {
                Ok(()) => self.push_admitted(id, BatchSeq::new(p)),
                Err(e) => {
                    on_event(id, BatchEvent::Failed(e));
                }
            }
        }
    }
}

/// Batched generation as a method of the engine (here, so that the engine does not depend on
/// the batcher).
impl Engine {
    /// Generates continuations of several prompts at once, each with its own options (sampling,
    /// seed, stops, penalties); `on_token(i, event)` gets sequence i's tokens and returns false to
    /// end that sequence. On the GPU every decode step runs all unfinished sequences as one batch
    /// (each weight read once for all of them), each in its own KV-pool sequence; greedy output
    /// is what each prompt alone gives. Returns each sequence's stats, in the order of the
    /// prompts.
    pub async fn generate_batch(
        &mut self,
        requests: &[(Prompt, GenerateOptions)],
        on_token: &mut dyn FnMut(usize, &TokenEvent) -> bool,
    ) -> Result<Vec<Stats>> {
        let max = match &self.backend {
            Backend::Gpu(m) => m.max_batch(),
            Backend::Cpu { .. } => crate::gpu::kernels::MAX_BATCH,
        };
        if requests.is_empty() || requests.len() > max {
            return Err(Error::InvalidOption {
                name: "batch",
                value: requests.len().to_string(),
                expected: format!("from 1 to {max} prompts at once"),
            });
        }
        let prepared = requests
            .iter()
            .map(|(prompt, options)| Batcher::prepare(self, prompt, options))
            .collect::<Result<Vec<_>>>()?;
        // The pool must hold every sequence at its longest: refused before any work.
        if let Backend::Gpu(m) = &self.backend {
            let pool = m.pool();
            let bt = pool.block_tokens();
            let needed: usize =
                prepared.iter().map(|p| (p.prompt_tokens() + p.options().max_tokens).div_ceil(bt)).sum();
            let free = pool.free_blocks();
            if needed > free {
                return Err(Error::KvPoolFull {
                    needed_tokens: needed * bt,
                    free_tokens: free * bt,
                    capacity_tokens: pool.blocks() * bt,
                });
            }
        }
        // Every prompt is prefilled in the first round (prompts over `pass_rows` tokens take a
        // pass per chunk per round).
        let budget = prepared.iter().map(Prepared::prompt_tokens).sum();
        let mut batcher = Batcher::new(self, budget);
        let mut index = std::collections::HashMap::new();
        for (i, p) in prepared.into_iter().enumerate() {
            match batcher.admit(self, p) {
                Ok(id) => index.insert(id, i),
                Err((e, _)) => {
                    batcher.clear(self);
                    return Err(e);
                }
            };
        }
        let mut stats = vec![None; requests.len()];
        let mut failed = None;
        while !batcher.is_empty() {
            let round = batcher
                .step(self, &mut |_| true, &mut |id, event| {
                    let i = index[&id];
                    match event {
                        BatchEvent::Token(ev) => return on_token(i, ev),
                        BatchEvent::Done(s) => stats[i] = Some(s),
                        BatchEvent::Failed(e) => {
                            failed.get_or_insert(e);
                        }
                        BatchEvent::Beams(_) => unreachable!("no beam search among sampled prompts"),
                    }
                    true
                })
                .await;
            if let Err(e) = round {
                batcher.clear(self);
                return Err(e);
            }
            if let Some(e) = failed.take() {
                batcher.clear(self);
                return Err(e);
            }
        }
        batcher.clear(self);
        Ok(stats.into_iter().map(|s| s.expect("every request ends with its stats")).collect())
    }

    /// Generates a continuation of `prompt`, calling `on_token` for every sampled token; the
    /// callback returns false to abort. A one-request batch (the runtime every request goes
    /// through): a prompt that extends an earlier one (a chat's next turn) starts from the
    /// blocks the prefix cache kept of it and runs only its new tokens. Speculation by prompt lookup or
    /// the model's first layers runs in the batch too (its drafts are rows of the request's
    /// steps), and so does a separate draft model (in a sequence of its own in its pool).
    pub async fn generate(
        &mut self,
        prompt: &Prompt,
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<Stats> {
        let p = Batcher::prepare(self, prompt, options)?;
        let mut batcher = Batcher::new(self, usize::MAX);
        batcher.admit(self, p).map_err(|(e, _)| e)?;
        let (mut stats, mut failed, mut first) = (None, None, false);
        let mut counters_start = None;
        while !batcher.is_empty() {
            let round = batcher
                .step(self, &mut |_| true, &mut |_, event| match event {
                    BatchEvent::Token(ev) => {
                        first = true;
                        on_token(ev)
                    }
                    BatchEvent::Done(s) => {
                        stats = Some(s);
                        true
                    }
                    BatchEvent::Failed(e) => {
                        failed = Some(e);
                        true
                    }
                    BatchEvent::Beams(_) => unreachable!("no beam search in a generation"),
                })
                .await;
            if let Err(e) = round {
                batcher.clear(self);
                return Err(e);
            }
            // The decode steps' counters start once the first token is out.
            if first && counters_start.is_none() {
                counters_start = self.gpu_model().map(|m| m.gpu.counters());
            }
        }
        batcher.clear(self);
        if let Some(e) = failed {
            return Err(e);
        }
        let mut stats = stats.expect("a generation ends with its stats or its error");
        stats.decode_counters = self.gpu_model().zip(counters_start).map(|(m, start)| m.gpu.counters() - start);
        Ok(stats)
    }

    /// Beam search from `prompt` (transformers' semantics: `beam::BeamSearch`): the N best
    /// hypotheses, best first, each with its text. Its beams run as rows of a batch (the
    /// batcher's beam search requests).
    pub async fn beam_search(&mut self, prompt: &Prompt, options: &BeamOptions) -> Result<Vec<(Hypothesis, String)>> {
        let p = Batcher::prepare_beams(self, prompt, options)?;
        let mut batcher = Batcher::new(self, usize::MAX);
        batcher.enqueue(p);
        let (mut found, mut failed) = (None, None);
        while !batcher.is_empty() {
            let round = batcher
                .step(self, &mut |_| true, &mut |_, event| {
                    match event {
                        BatchEvent::Beams(beams) => found = Some(beams),
                        BatchEvent::Failed(e) => failed = Some(e),
                        BatchEvent::Token(_) | BatchEvent::Done(_) => {}
                    }
                    true
                })
                .await;
            if let Err(e) = round {
                batcher.clear(self);
                return Err(e);
            }
        }
        batcher.clear(self);
        match (found, failed) {
            (_, Some(e)) => Err(e),
            (Some(beams), None) => Ok(beams),
            (None, None) => unreachable!("a beam search ends with its hypotheses or its error"),
        }
    }
}

/// Rows of a decode step a request takes: its beams, or its token and its drafts; and whether
/// it is a beam search.
fn rows_of(beams: &Option<BeamOptions>, options: &GenerateOptions) -> (usize, bool) {
    match beams {
        Some(b) => (b.beams, true),
        None => (1 + options.speculate.map_or(0, |s| s.draft_tokens), false),
    }
}

/// Frees a beam search's beams' sequences.
fn free_beams(engine: &mut Engine, r: &mut Request) {
    if let Some(beams) = &mut r.beam {
        for kv in beams.seqs.drain(..) {
            kv.release(engine, &[]);
        }
    }
}

/// A speculating request's drafts and figures.
struct SpecState {
    speculation: crate::speculate::Speculation,
    stats: SpeculationStats,
    /// This round's drafts, checked by the rows after the request's own.
    draft: Vec<u32>,
    /// The tokens the drafts follow (reused).
    context: Vec<u32>,
    /// With a draft model: the request's sequence in its pool.
    model: ModelDraft,
}

/// One pass of a draft model over `tokens` at `start` in sequence `kv` (cut to `start` first):
/// the last position's argmax.
async fn draft_pass(
    backend: &mut Backend,
    kv: &mut SeqState,
    tokens: &[u32],
    start: usize,
    kv_dim: usize,
) -> Result<u32> {
    kv.truncate(backend, kv_dim, start);
    match (backend, kv) {
        (Backend::Gpu(model), &mut SeqState::Gpu(seq)) => {
            let mut id = 0;
            let rows = model.pass_rows();
            let chunks = tokens.chunks(rows).count();
            for (i, chunk) in tokens.chunks(rows).enumerate() {
                let readback = if i + 1 == chunks { Readback::Argmax } else { Readback::None };
                id = model.step_in(seq, chunk, start + i * rows, readback).await?.unwrap_or(0);
            }
            Ok(id)
        }
        (Backend::Cpu { model, .. }, SeqState::Cpu(cache)) => {
            let logits = model.forward(cache, tokens, Logits::Last)?;
            if !all_finite(&logits) {
                return Err(Error::NonFiniteLogits { position: start + tokens.len() });
            }
            Ok(argmax(&logits))
        }
        _ => unreachable!("a draft sequence is on its draft model's backend"),
    }
}

/// A request's sequence in the draft model's pool (`Drafter::Model`), made at its first draft
/// and freed when the request leaves the batch (or is preempted).
#[derive(Default)]
struct ModelDraft {
    kv: Option<SeqState>,
    /// The tokens whose keys and values `kv` holds.
    tokens: Vec<u32>,
}

impl ModelDraft {
    /// Up to `k` greedy drafts after `context` into `out`: the draft model runs the context
    /// past what its sequence shares with it (the tokens accepted since its last drafts), then
    /// a decode step a draft. Where the draft model has no room (no sequence or block left, its
    /// context full) or its logits are not finite, it drafts fewer or none: the request checks
    /// what there is, its tokens unchanged. An id past the model's vocabulary ends the drafts.
    async fn draft(
        &mut self,
        draft: &mut Engine,
        context: &[u32],
        k: usize,
        vocab: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        out.clear();
        let k = k.min(draft.context_length().saturating_sub(context.len()));
        if k == 0 {
            return Ok(());
        }
        match self.run(draft, context, k, vocab, out).await {
            Ok(()) => Ok(()),
            Err(
                Error::KvPoolFull { .. }
                | Error::TooManySequences { .. }
                | Error::ContextOverflow { .. }
                | Error::NonFiniteLogits { .. },
            ) => {
                // Its sequence may hold part of a pass: nothing of it is kept; it starts over
                // at the next drafts.
                if let Some(kv) = self.kv.take() {
                    kv.release(draft, &[]);
                }
                self.tokens.clear();
                out.clear();
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn run(
        &mut self,
        draft: &mut Engine,
        context: &[u32],
        k: usize,
        vocab: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let kv_dim = draft.config.kv_dim();
        if self.kv.is_none() {
            // From the draft model's own prefix cache (another request's drafting, or this
            // one's before it was preempted).
            let (kv, reused) = SeqState::create(draft, &context[..context.len() - 1])?;
            self.tokens.clear();
            self.tokens.extend_from_slice(&context[..reused]);
            self.kv = Some(kv);
        }
        let reuse = common_prefix(&self.tokens, context).min(context.len() - 1);
        self.tokens.truncate(reuse);
        let kv = self.kv.as_mut().expect("made above");
        let mut prev = draft_pass(&mut draft.backend, kv, &context[reuse..], reuse, kv_dim).await?;
        self.tokens.extend_from_slice(&context[reuse..]);
        for i in 0..k {
            if prev as usize >= vocab {
                break;
            }
            out.push(prev);
            if i + 1 < k {
                let at = self.tokens.len();
                prev = draft_pass(&mut draft.backend, kv, &[prev], at, kv_dim).await?;
                self.tokens.push(out[i]);
            }
        }
        Ok(())
    }

    /// Frees the sequence (the request leaves or is preempted: what it holds stays in the draft
    /// model's prefix cache).
    fn free(&mut self, draft: &mut Engine) {
        if let Some(kv) = self.kv.take() {
            kv.release(draft, &self.tokens);
        }
        self.tokens.clear();
    }
}

/// One request's generation state: what `Engine::generate` keeps in locals.
struct BatchSeq {
    prompt_len: usize,
    /// Prompt positions forked from a kept sequence (not prefilled).
    reused: usize,
    /// The prompt, then every token fed back.
    tokens: Vec<u32>,
    sampler: Sampler,
    options: GenerateOptions,
    beams: Option<BeamOptions>,
    /// Speculative decoding's state (prompt lookup).
    spec: Option<SpecState>,
    /// The next token's origin with speculation, until it is emitted.
    origin: Option<TokenSpeculation>,
    stream: StreamDecoder,
    stops: StopMatcher,
    /// The token emitted last, fed back by the next decode step (None until the prompt is run).
    next: Option<u32>,
    /// `next`'s candidates and log-probability (with `top_candidates`), until it is emitted.
    candidates: Vec<TokenCandidate>,
    logprob: Option<TokenLogprob>,
    generated: usize,
    decode_steps: usize,
    stop: Option<StopReason>,
    failed: Option<Error>,
    start: Instant,
    ttft: f64,
    decode_start: Instant,
}

impl BatchSeq {
    fn new(p: Prepared) -> Self {
        let now = Instant::now();
        Self {
            prompt_len: p.tokens.len(),
            reused: 0,
            tokens: p.tokens,
            sampler: p.sampler,
            spec: p.options.speculate.map(|speculation| SpecState {
                speculation,
                stats: SpeculationStats::default(),
                draft: Vec::new(),
                context: Vec::new(),
                model: ModelDraft::default(),
            }),
            origin: None,
            beams: p.beams,
            stops: StopMatcher::new(p.options.stop.clone()),
            options: p.options,
            stream: StreamDecoder::new(),
            next: None,
            candidates: Vec::new(),
            logprob: None,
            generated: 0,
            decode_steps: 0,
            stop: None,
            failed: None,
            start: now,
            ttft: 0.0,
            decode_start: now,
        }
    }

    /// Frees its sequence in the draft model's pool, if it has one.
    fn free_draft(&mut self, engine: &mut Engine) {
        if let (Some(spec), Some(draft)) = (&mut self.spec, engine.draft.as_deref_mut()) {
            spec.model.free(draft);
        }
    }

    /// What choosing the next token needs read back of its row of logits
    /// (`RowReadback::for_sampler`), but the whole row for a beam (its log-probabilities are
    /// normalized over the vocabulary) or for candidates, and no selection for a draft's check
    /// (the argmax, or the whole distribution).
    fn row_readback(&self, on_gpu: bool) -> RowReadback {
        if self.beams.is_some() || (self.options.top_candidates > 0 && self.spec.is_none()) {
            RowReadback::Logits
        } else {
            RowReadback::for_sampler(&self.sampler, on_gpu && self.spec.is_none())
        }
    }

    /// The next token from what its row read back (`row_readback`, `RowReadback::choose`); from
    /// the logits with its candidates and log-probability (`choose`).
    fn choose_from(
        &mut self,
        tok: &Tokenizer,
        want: RowReadback,
        argmax: u32,
        top: &[(u32, f32)],
        tail: Tail,
        logits: &mut [f32],
    ) -> Option<u32> {
        match want {
            RowReadback::Logits => Some(self.choose(tok, logits)),
            _ => want.choose(&mut self.sampler, argmax, top, tail, logits),
        }
    }

    /// Samples the next token from `logits` (which it changes); with `top_candidates`, keeps the
    /// distribution's most likely tokens and the chosen one's log-probability for its event.
    fn choose(&mut self, tok: &Tokenizer, logits: &mut [f32]) -> u32 {
        let n = self.options.top_candidates;
        if n == 0 {
            return self.sampler.sample(logits);
        }
        // The distribution reported is the one drawn from: the constraint's mask applied.
        self.sampler.mask_logits(logits);
        let original = logits.to_vec();
        self.candidates = token_candidates(tok, &mut self.sampler, &original, n);
        let id = self.sampler.sample(logits);
        self.logprob = Some(TokenLogprob {
            // A token whose probability underflows (one a grammar forces) reports -9999, as OpenAI does, not -inf (null in JSON).
            logprob: self.sampler.probability_of(&original, id).ln().max(-9999.0),
            token: tok.decode(&[id]).unwrap_or_default(),
        });
        id
    }

    /// Emits `next` as `generate` does (end of sequence, stop strings, the token limit); sets
    /// `stop` when the request ends.
    fn emit(&mut self, tok: &Tokenizer, on_token: &mut dyn FnMut(&TokenEvent) -> bool) {
        let Some(next) = self.next else { return };
        if let Err(e) = self.emit_token(tok, next, on_token) {
            self.failed = Some(e);
        }
    }

    fn emit_token(&mut self, tok: &Tokenizer, next: u32, on_token: &mut dyn FnMut(&TokenEvent) -> bool) -> Result<()> {
        let position = self.tokens.len() + 1;
        if !self.options.ignore_eos && tok.stop_ids.contains(&next) {
            let (tail, _) = self.stops.finish(&self.stream.finish(tok)?);
            if !tail.is_empty() {
                on_token(&TokenEvent {
                    id: next,
                    text: tail,
                    position: position - 1,
                    candidates: Vec::new(),
                    logprob: None,
                    speculation: None,
                    allowed: None,
                });
            }
            self.stop = Some(StopReason::Eos);
            return Ok(());
        }
        self.generated += 1;
        let last = self.generated >= self.options.max_tokens;
        let mut piece = self.stream.push(tok, next)?;
        if last {
            piece.push_str(&self.stream.finish(tok)?);
        }
        let (text, hit) = if last { self.stops.finish(&piece) } else { self.stops.push(&piece) };
        let candidates = std::mem::take(&mut self.candidates);
        let logprob = self.logprob.take();
        let speculation = self.origin.take();
        let allowed = self.sampler.constraint().map(|c| c.allowed() as u32);
        if !on_token(&TokenEvent { id: next, text, position, candidates, logprob, speculation, allowed }) {
            self.stop = Some(StopReason::Aborted);
        } else if hit {
            self.stop = Some(StopReason::StopString);
        } else if last {
            self.stop = Some(StopReason::MaxTokens);
        } else {
            self.sampler.accept(next);
        }
        Ok(())
    }

    fn stats(&self) -> Stats {
        let decode_secs = self.decode_start.elapsed().as_secs_f64();
        Stats {
            prompt_tokens: self.prompt_len,
            prefilled_tokens: self.prompt_len - self.reused,
            generated_tokens: self.generated,
            ttft_ms: self.ttft * 1e3,
            prefill_tok_s: (self.prompt_len - self.reused) as f64 / self.ttft.max(1e-9),
            decode_tok_s: self.decode_steps as f64 / decode_secs.max(1e-9),
            stop_reason: self.stop.unwrap_or(StopReason::MaxTokens),
            decode_steps: self.decode_steps,
            decode_counters: None,
            speculation: self.spec.as_ref().map(|s| s.stats),
            masks: self.sampler.constraint().map(|c| c.timing()),
        }
    }
}
