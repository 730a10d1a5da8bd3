//! The runtime's submit path: a batcher round (`submit_round`) as one submission — each pass's
//! rows reserved in the pool (copy-on-write copies encoded first), its inputs uploaded into a
//! region of their own and copied into place between passes, the prefill chunks then the
//! decode step — and what each row reads back (`RowReadback`: the argmax, a selection on the
//! GPU, or the whole row), read by `read_round`.

use super::*;
use crate::sampling::{Sampler, Tail};

/// What one row of a batched decode step reads back beside its argmax.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowReadback {
    /// The argmax alone (4 bytes: greedy decoding).
    Argmax,
    /// The `k` largest logits (at most `kernels::MAX_TOP_K`), 8 bytes each; with a temperature,
    /// also what a top-p/min-p sampler needs of the rest (8 bytes; see `RowReadback::Select`).
    Select { k: usize, tail: Option<f32> },
    /// The token a sampler draws on the GPU (shaders/draw.wgsl) with the sampler's next uniform
    /// `u`: a top-k sampler from its `k` largest logits (the host's `Sampler::sample_top_k`
    /// there), a top-p/min-p sampler without top-k from the `NUCLEUS_K` largest and the tail
    /// (`Sampler::sample_nucleus` there; `kernels::UNDECIDED` where those cannot place the cut:
    /// then the host draws from the row's logits with the same `u`). 4 bytes read back, and the
    /// round can be chained as a greedy one.
    Draw { k: usize, draw: GpuDraw },
    /// The whole row of logits (a sampler with penalties, candidates or log-probabilities).
    Logits,
}

impl RowReadback {
    /// What choosing a token with `sampler` needs read back of its row: the argmax (greedy), a
    /// token drawn on the GPU (top-k alone, up to `MAX_TOP_K`; top-p/min-p without top-k), a
    /// selection on the GPU for the host to draw from (the same samplers under a constraint:
    /// the k largest the mask allows, or the `NUCLEUS_K` largest and the tail), else the whole
    /// row (penalties, a larger top-k, every sampled row off the GPU, and a draw the GPU could
    /// not decide: `Sampler::redrawing`). On the GPU a constraint's mask applies to the argmax
    /// and the selection (`GpuModel::set_mask`); off it, the host masks the whole row.
    pub fn for_sampler(sampler: &Sampler, on_gpu: bool) -> Self {
        let constrained = sampler.constraint().is_some();
        if sampler.argmax_only() && (on_gpu || !constrained) {
            Self::Argmax
        } else if !on_gpu || sampler.redrawing() {
            Self::Logits
        } else if let Some(k) = sampler.top_k_only().filter(|&k| k <= kernels::MAX_TOP_K) {
            // A constrained row's k is cut to what its mask allows, after the pass.
            match constrained {
                true => Self::Select { k, tail: None },
                false => Self::Draw { k, draw: GpuDraw::of(sampler, false) },
            }
        } else if sampler.nucleus_only() {
            match constrained {
                true => Self::Select { k: kernels::NUCLEUS_K, tail: Some(sampler.params().temperature) },
                false => Self::Draw { k: kernels::NUCLEUS_K, draw: GpuDraw::of(sampler, true) },
            }
        } else {
            Self::Logits
        }
    }

    /// The token `sampler` draws from what its row read back: the argmax or the GPU's draw, the
    /// selection (`top`, `tail`) or the logits (which it changes); None when a top-p/min-p
    /// selection cannot place the cut (then read the row's logits and draw from them; after a
    /// draw on the GPU, with its uniform: `Sampler::redraw`).
    pub fn choose(
        self,
        sampler: &mut Sampler,
        argmax: u32,
        top: &[(u32, f32)],
        tail: Tail,
        logits: &mut [f32],
    ) -> Option<u32> {
        match self {
            Self::Draw { .. } if argmax == kernels::UNDECIDED => None,
            Self::Argmax | Self::Draw { .. } => Some(argmax),
            Self::Select { tail: None, .. } => Some(sampler.sample_top_k(top)),
            Self::Select { tail: Some(_), .. } => {
                let vocab = sampler.allowed_tokens();
                sampler.sample_nucleus(top, vocab, tail)
            }
            Self::Logits => Some(sampler.sample(logits)),
        }
    }
}

/// What a sampler's draw on the GPU takes (a row of shaders/draw.wgsl's `draws`): its
/// temperature, top-p and min-p, whether it is a nucleus sampler (its selection has the tail),
/// and `u`, its next uniform (`Sampler::gpu_uniform`), set by the batcher for each round the row
/// is in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuDraw {
    pub u: f32,
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub nucleus: bool,
}

impl GpuDraw {
    fn of(sampler: &Sampler, nucleus: bool) -> Self {
        let p = sampler.params();
        // u is the batcher's to set, round by round (`encode_choice` checks it is).
        Self { u: f32::NAN, temperature: p.temperature, top_p: p.top_p, min_p: p.min_p, nucleus }
    }

    fn words(&self) -> [u32; kernels::DRAW_WORDS] {
        let f = |v: f32| v.to_bits();
        [f(self.u), f(self.temperature), f(self.top_p), f(self.min_p), self.nucleus as u32]
    }
}

/// What a batcher round reads back (`GpuModel::read_round`): every row's argmax into `ids` (u32::MAX flags non-finite logits, and
/// is not an error here: that row's request fails, not the step); a `Select` row's pairs (in no
/// order) into `top[row]` and its tail into `tails[row]`; a `Logits` row's logits into
/// `logits[row * vocab..]`. The slices have a row's room for each of the step's rows.
pub struct RowsReadback<'a> {
    pub want: &'a [RowReadback],
    pub ids: &'a mut [u32],
    pub top: &'a mut [Vec<(u32, f32)>],
    pub tails: &'a mut [Tail],
    pub logits: &'a mut [f32],
}

/// Bytes of a row's selection read back: the tail's two words (with a temperature), then the
/// pairs (`TOP_K_WORDS`' count word is not read: it is k, or the vocabulary when smaller).
pub(super) fn selection_bytes(k: usize, tail: bool) -> u64 {
    4 * (2 * tail as u64 + 2 * k as u64)
}

/// The selection words' first word read back (see `selection_bytes`).
pub(super) fn selection_offset(tail: bool) -> u64 {
    4 * if tail { 1 } else { 3 }
}

/// The `k` pairs and (with a tail) the tail from a row's selection bytes as read back.
pub(super) fn read_selection(bytes: &[u8], k: usize, tail: Option<&mut Tail>, out: &mut Vec<(u32, f32)>) {
    let words: &[u32] = bytemuck::cast_slice(bytes);
    let pairs = match tail {
        Some(t) => {
            *t = Tail { sum: f32::from_bits(words[0]), max_abs: f32::from_bits(words[1]) };
            &words[2..]
        }
        None => words,
    };
    out.clear();
    out.extend(pairs[..2 * k].chunks_exact(2).map(|p| (p[0], f32::from_bits(p[1]))));
}

/// A batcher round submitted and not yet read (`GpuModel::submit_round`).
pub struct RoundFlight {
    submission: wgpu::SubmissionIndex,
    /// The staging slot of a round that reads its rows' argmax alone.
    slot: Option<usize>,
    n: usize,
    /// Its readback is still to be submitted (`finish_round`, after the rows' masks).
    open: bool,
}

impl GpuModel {
    /// Readies a pass's rows, (sequence, position) each: reserves the positions in the pool
    /// (copying, in `enc`, a block shared with another sequence before it is written), uploads
    /// the block tables that changed, the rows' positions and tables, and `params` when they
    /// changed. Allocates nothing when no block is added (every decode step).
    pub(super) fn prepare(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        rows: impl Iterator<Item = (SeqId, usize)> + Clone,
        params: Params,
    ) -> Result<()> {
        self.reserve(enc, rows.clone())?;
        let queue = &self.gpu.queue;
        let mut single = rows.clone();
        match (single.next(), single.next()) {
            (Some((seq, pos)), None) => {
                // One row (a decode step): its position copied on the GPU, its block table's
                // index written only when the row changes sequence.
                let table = self.layout.table(seq.0) as u32;
                if self.row0_table != Some(table) {
                    queue.write_buffer(&self.buf.batch, 4, bytemuck::bytes_of(&table));
                    self.row0_table = Some(table);
                }
                enc.copy_buffer_to_buffer(&self.buf.positions, pos as u64 * 4, &self.buf.batch, 0, 4);
            }
            _ => {
                self.row_words.clear();
                for (seq, pos) in rows {
                    self.row_words.extend([pos as u32, self.layout.table(seq.0) as u32]);
                }
                queue.write_buffer(&self.buf.batch, 0, bytemuck::cast_slice(&self.row_words));
                self.row0_table = self.row_words.get(1).copied();
            }
        }
        if params != self.params_now {
            queue.write_buffer(&self.buf.params, 0, bytemuck::bytes_of(&params));
            self.params_now = params;
        }
        Ok(())
    }

    /// The pool's side of `prepare`: reserves the rows' positions, copies (in `enc`) shared
    /// blocks before they are written, and uploads the block tables that changed.
    pub(super) fn reserve(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        rows: impl Iterator<Item = (SeqId, usize)> + Clone,
    ) -> Result<()> {
        self.copies.clear();
        if let Some((_, pos)) = rows.clone().find(|&(_, pos)| pos >= self.context) {
            return Err(Error::ContextOverflow { prompt_tokens: pos + 1, max_tokens: 0, context_length: self.context });
        }
        for (seq, pos) in rows.clone() {
            match self.pool.reserve(seq, pos + 1, &mut self.copies) {
                Ok(changed) => self.dirty[seq.0] |= changed,
                Err(e) => {
                    // Tables of earlier rows may already point at copy-on-write blocks: copy
                    // them now, or those sequences would read blocks never written.
                    if !self.copies.is_empty() {
                        let mut own = self.gpu.device.create_command_encoder(&Default::default());
                        self.copy_blocks(&mut own)?;
                        self.gpu.submit(own);
                    }
                    return Err(e);
                }
            }
        }
        if !self.copies.is_empty() {
            self.copy_blocks(enc)?;
        }
        let queue = &self.gpu.queue;
        for (seq, dirty) in self.dirty.iter_mut().enumerate() {
            let table = self.pool.table(SeqId(seq));
            if std::mem::take(dirty) && !table.is_empty() {
                let at = self.layout.table(seq) as u64 * 4;
                queue.write_buffer(&self.buf.batch, at, bytemuck::cast_slice(table));
            }
        }
        Ok(())
    }

    /// A round of the batcher as ONE forward pass and one submission, not waited for (read it
    /// with `read_round`, the same `want`): the decode `rows`, then the tokens of `prefills`
    /// (sequence, tokens, first position: prompt chunks, at most ROUND_PASSES - 1 of them and
    /// `pass_rows` rows in all), each decode row reading back what `want` says. `chained`: the
    /// decode rows' tokens are the argmax of the same rows of the round submitted before (kept
    /// on the GPU), not `rows[i].1`, so that greedy round n + 1 can be submitted before round
    /// n's ids are read. A round whose rows all read their argmax alone reads it from one of
    /// two staging slots, in turn, so that two can be in flight. `masked`: some rows choose
    /// under a constraint; the forward pass is submitted alone, and the host computes their
    /// masks while the GPU runs it (`set_mask`, then `finish_round` submits the selection and
    /// the readback).
    pub fn submit_round(
        &mut self,
        prefills: &[(SeqId, &[u32], usize)],
        rows: &[(SeqId, u32, usize)],
        want: &[RowReadback],
        chained: bool,
        masked: bool,
    ) -> Result<RoundFlight> {
        let d = rows.len();
        let chunk_rows: usize = prefills.iter().map(|p| p.1.len()).sum();
        let n = d + chunk_rows;
        if d > self.max_batch || n > self.layout.rows || prefills.len() + 1 > ROUND_PASSES || want.len() != d {
            return Err(Error::InvalidOption {
                name: "round",
                value: format!("{} prompt chunks ({chunk_rows} tokens) and {d} decode rows", prefills.len()),
                expected: format!(
                    "at most {} prompt chunks, {} decode rows and {} rows in all a round on this GPU, a readback a row",
                    ROUND_PASSES - 1,
                    self.max_batch,
                    self.layout.rows
                ),
            });
        }
        for &(_, tokens, start) in prefills {
            if tokens.is_empty() || start + tokens.len() > self.context {
                return Err(Error::ContextOverflow {
                    prompt_tokens: start + tokens.len(),
                    max_tokens: 0,
                    context_length: self.context,
                });
            }
        }
        self.gpu.check()?;
        let host = HostClock::now();
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("round") });
        // The rows: the decode rows first (their logits are the pass's first rows), then each
        // chunk's tokens; their positions reserved and uploaded, and their tokens.
        let positions = rows.iter().map(|r| (r.0, r.2)).chain(
            prefills.iter().flat_map(|&(seq, tokens, start)| (start..start + tokens.len()).map(move |p| (seq, p))),
        );
        if n > 0 {
            self.prepare(&mut enc, positions, Params::new(n, n))?;
        }
        self.round_tokens.clear();
        self.round_tokens.extend(rows.iter().map(|r| r.1));
        // Decode attention takes one dispatch a layer while every decode row's context is short.
        let keys = rows.iter().map(|r| r.2 + 1).max().unwrap_or(0);
        let mut segments =
            kernels::SegmentRows { decode: d as u32, ..kernels::SegmentRows::at_keys(n as u32, keys, self.short_keys) };
        let mut first = d;
        for (k, &(_, tokens, _)) in prefills.iter().enumerate() {
            self.round_tokens.extend_from_slice(tokens);
            let chunk = Params { n_tokens: tokens.len() as u32, rows: 1, first: first as u32, pad1: 0 };
            self.gpu.queue.write_buffer(&self.buf.params_chunks[k], 0, bytemuck::bytes_of(&chunk));
            segments.chunks[k] = tokens.len() as u32;
            first += tokens.len();
        }
        let b = &self.buf;
        // A chained step's tokens are all copied on the GPU below: no upload (each write is a
        // staging buffer made and freed).
        if n > 0 && !(chained && n == d) {
            self.gpu.queue.write_buffer(&b.tokens, 0, bytemuck::cast_slice(&self.round_tokens));
        }
        if chained {
            enc.copy_buffer_to_buffer(&b.chain, 0, &b.tokens, 0, 4 * d as u64);
        }
        if n > 1 {
            self.record_batched();
        }
        if prefills.is_empty() {
            // Decode rows alone: a decode step (one row, up to WIDE_ROWS, past them).
            let ops = match d {
                0 => &[][..],
                1 => &self.decode[..],
                d if d <= kernels::WIDE_ROWS => self.decode_batch.as_deref().expect("recorded above"),
                _ => self.decode_wide.as_deref().expect("recorded above"),
            };
            Self::encode_ops(&mut enc, ops, &segments);
        } else {
            // With prompt chunks, `Pass::Round`: its logits for the decode rows alone.
            let decode = Params::new(d, d);
            self.gpu.queue.write_buffer(&self.buf.params_decode, 0, bytemuck::bytes_of(&decode));
            let round = if n > kernels::WIDE_ROWS { &self.round_wide } else { &self.round_narrow };
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("round"), timestamp_writes: None });
            for op in round.as_ref().expect("recorded above") {
                op.encode_rows(&mut pass, &segments);
            }
        }
        // Rows that read their id alone (the argmax, or a token drawn on the GPU) read it from
        // one of two staging slots, in turn.
        let ids_alone = want.iter().all(|w| matches!(w, RowReadback::Argmax | RowReadback::Draw { .. }));
        let slot = (d > 0 && !masked && ids_alone).then(|| {
            let slot = self.next_slot;
            self.next_slot = 1 - slot;
            slot
        });
        if slot.is_some() && want.iter().any(|w| matches!(w, RowReadback::Draw { .. })) {
            self.encode_choice(&mut enc, want);
        }
        if d > 0 {
            let b = &self.buf;
            // The next round's tokens when it is chained to this one.
            enc.copy_buffer_to_buffer(&b.argmax, 0, &b.chain, 0, 4 * d as u64);
            match slot {
                Some(slot) => enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[slot], 0, 4 * d as u64),
                None if masked => {}
                None => self.encode_rows(&mut enc, want)?,
            }
        }
        let submission = self.gpu.submit(enc);
        self.count_host_time(host);
        Ok(RoundFlight { submission, slot, n: d, open: masked && d > 0 })
    }

    /// Decode row `row`'s constraint mask for the round submitted with `masked` (a bit a token,
    /// `Constraint::fill_mask`'s words): its argmax, or its selection, takes only the tokens
    /// the mask allows.
    pub fn set_mask(&mut self, row: usize, words: &[u32]) {
        let at = (self.max_batch + row * kernels::mask_words(self.config.vocab_size)) * 4;
        self.gpu.queue.write_buffer(&self.buf.masks, at as u64, bytemuck::cast_slice(words));
        self.mask_flags[row] = 1;
    }

    /// Submits the selection and the readback of a round submitted with `masked`, once its
    /// rows' masks are set (`want` as the rows now read: a masked row's k at most the tokens
    /// its mask allows). Natively, counts whether the forward pass had already finished: then
    /// the GPU waited for the masks.
    pub fn finish_round(&mut self, flight: &mut RoundFlight, want: &[RowReadback]) -> Result<()> {
        if !flight.open {
            return Ok(());
        }
        let host = HostClock::now();
        let counters = &self.gpu.counters;
        counters.mask_rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(target_arch = "wasm32"))]
        if self.gpu.device.poll(wgpu::PollType::Poll).is_ok_and(|s| s.is_queue_empty()) {
            counters.mask_waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("masked") });
        self.encode_rows(&mut enc, want)?;
        self.mask_flags.fill(0);
        flight.submission = self.gpu.submit(enc);
        flight.open = false;
        self.count_host_time(host);
        Ok(())
    }

    /// The batched passes (a decode step of up to WIDE_ROWS rows and past them, a round with
    /// prompt chunks of either width), all recorded at the first that is needed: no pipeline
    /// or bind group is made by a later round.
    fn record_batched(&mut self) {
        if self.decode_batch.is_some() {
            return;
        }
        self.decode_batch = Some(self.record(Pass::Decode { mb: BATCH_MB, layers: self.layers.len() }));
        self.decode_wide = Some(self.record(Pass::WideDecode));
        self.round_narrow = Some(self.record(Pass::Round { tiled: false }));
        self.round_wide = Some(self.record(Pass::Round { tiled: true }));
    }

    /// What a round submitted by `submit_round` reads back, waiting for it.
    pub async fn read_round(&self, flight: RoundFlight, readback: RowsReadback<'_>) -> Result<()> {
        debug_assert!(!flight.open, "a masked round is read after finish_round");
        match (flight.n, flight.slot) {
            (0, _) => self.gpu.check(),
            (n, Some(slot)) => {
                let ids = readback.ids;
                let staging = &self.buf.staging_argmax[slot];
                self.gpu
                    .read_mapped_after(staging, 4 * n as u64, Some(flight.submission), |bytes| {
                        ids[..n].copy_from_slice(bytemuck::cast_slice(bytes))
                    })
                    .await
            }
            (_, None) => self.read_rows(readback).await,
        }
    }

    /// The pool's copy-on-write copies (`self.copies`), every attention layer's K and V block
    /// and every short-convolution layer's state block, through a scratch block (WebGPU copies
    /// nothing within one buffer).
    pub(super) fn copy_blocks(&mut self, enc: &mut wgpu::CommandEncoder) -> Result<()> {
        let kv = (KV_BLOCK * self.config.kv_dim()) as u64 * self.gpu.kv_bytes();
        let state = (KV_BLOCK * self.config.d_model) as u64 * 4;
        // A Gated DeltaNet layer's blocks: its convolution input and delta-rule inputs.
        let delta = self.plan.layers.iter().find_map(|l| l.delta.as_ref()).map(|dn| {
            let s = &dn.shape;
            ((KV_BLOCK * s.conv_dim()) as u64 * 4, (KV_BLOCK * s.inputs()) as u64 * 4)
        });
        if self.block_scratch.is_none() {
            let largest = delta.map_or(0, |(a, b)| a.max(b));
            self.block_scratch = Some(self.gpu.storage("block_scratch", kv.max(state).max(largest))?);
        }
        let scratch = self.block_scratch.as_ref().expect("made above");
        let b = &self.buf;
        let mut copy = |cache: &wgpu::Buffer, bytes: u64, from: u32, to: u32| {
            enc.copy_buffer_to_buffer(cache, from as u64 * bytes, scratch, 0, bytes);
            enc.copy_buffer_to_buffer(scratch, 0, cache, to as u64 * bytes, bytes);
        };
        // With an MTP head: the kept hidden states and the head's keys and values.
        let (hidden, mtp_kv) = (
            (KV_BLOCK * self.config.d_model) as u64 * 4,
            (KV_BLOCK * self.config.kv_dim()) as u64 * self.gpu.kv_bytes(),
        );
        for &(from, to) in &self.copies {
            if let (Some(h), Some([k, v])) = (&b.hidden, &b.mtp_kv) {
                copy(h, hidden, from, to);
                copy(k, mtp_kv, from, to);
                copy(v, mtp_kv, from, to);
            }
            for i in 0..self.plan.layers.len() {
                match (&b.conv_state[i], &b.delta[i], delta) {
                    (Some(s), _, _) => copy(s, state, from, to),
                    (_, Some(d), Some((conv, inputs))) => {
                        copy(&d.conv_in, conv, from, to);
                        copy(&d.inputs, inputs, from, to);
                    }
                    // A layer that reads another's keys (Gemma 4's KV sharing) has none to copy.
                    _ if self.plan.layers[i].kv_source.is_some() => {}
                    _ => {
                        // Each layer's block at its own size (Gemma 4's differ by layer).
                        let dims = &self.plan.layers[i].dims;
                        let kv = (KV_BLOCK * self.config.with_dims(dims).kv_dim()) as u64 * self.gpu.kv_bytes();
                        copy(&b.k_cache[i], kv, from, to);
                        copy(&b.v_cache[i], kv, from, to);
                    }
                }
            }
        }
        Ok(())
    }

    /// Encodes `ops` for a pass of `n` rows.
    pub(super) fn encode_ops(enc: &mut wgpu::CommandEncoder, ops: &[Dispatch], rows: &kernels::SegmentRows) {
        let mut pass =
            enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("forward"), timestamp_writes: None });
        for op in ops {
            op.encode_rows(&mut pass, rows);
        }
    }

    pub(super) fn count_host_time(&self, since: HostClock) {
        self.gpu.counters.host_ns.fetch_add(since.elapsed_ns(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Row `row`'s logits of the last step, still in GPU memory until the next step: for a
    /// sampler that the selection on the GPU could not serve (`Sampler::sample_nucleus` said
    /// None). A single sequence's step has its logits in row 0.
    pub async fn read_logits(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let (b, bytes) = (&self.buf, self.config.vocab_size as u64 * 4);
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&b.logits, row as u64 * bytes, &b.staging_logits, 0, bytes);
        self.gpu.submit(enc);
        self.gpu.read_mapped(&b.staging_logits, bytes, |v| out.copy_from_slice(bytemuck::cast_slice(v))).await
    }

    /// What a round encodes after its decode pass to choose its rows' tokens: the argmax again
    /// for masked rows, the selection for the rows that want one (their k and temperatures
    /// written first), and the draws of the rows that draw on the GPU (their parameters written
    /// first) into the ids.
    pub(super) fn encode_choice(&mut self, enc: &mut wgpu::CommandEncoder, want: &[RowReadback]) {
        let n = want.len();
        let b = &self.buf;
        let vocab = self.config.vocab_size;
        let selects = want.iter().any(|w| matches!(w, RowReadback::Select { .. } | RowReadback::Draw { .. }));
        // The rows' mask flags: this round's (`set_mask`), or zeros over a past round's before
        // a selection reads them.
        let masked = self.mask_flags.iter().any(|&f| f != 0);
        if masked || (selects && self.masks_flagged) {
            self.gpu.queue.write_buffer(&b.masks, 0, bytemuck::cast_slice(&self.mask_flags));
            self.masks_flagged = masked;
        }
        if masked {
            Self::encode_ops(enc, self.argmax_masked.as_slice(), &kernels::SegmentRows::all(n as u32));
        }
        if !selects {
            return;
        }
        self.row_words.clear();
        for w in want {
            let k = |k: usize| k.clamp(1, kernels::MAX_TOP_K.min(vocab)) as u32;
            self.row_words.extend(match *w {
                RowReadback::Select { k: top, tail } => {
                    let t = tail.unwrap_or(0.0);
                    debug_assert!(tail.is_none() || t > 0.0, "a tail needs a temperature");
                    [k(top), t.to_bits()]
                }
                // A nucleus row's selection has the tail.
                RowReadback::Draw { k: top, draw } => {
                    [k(top), if draw.nucleus { draw.temperature.to_bits() } else { 0 }]
                }
                _ => [0, 0],
            });
        }
        self.gpu.queue.write_buffer(&b.top_k_want, 0, bytemuck::cast_slice(&self.row_words));
        Self::encode_ops(enc, self.select.as_slice(), &kernels::SegmentRows::all(n as u32));
        if want.iter().any(|w| matches!(w, RowReadback::Draw { .. })) {
            self.row_words.clear();
            for w in want {
                self.row_words.extend(match w {
                    RowReadback::Draw { draw, .. } => {
                        debug_assert!((0.0..=1.0).contains(&draw.u), "a drawing row's uniform is set");
                        draw.words()
                    }
                    _ => [0; kernels::DRAW_WORDS],
                });
            }
            self.gpu.queue.write_buffer(&b.draws, 0, bytemuck::cast_slice(&self.row_words));
            Self::encode_ops(enc, self.draw.as_slice(), &kernels::SegmentRows::all(n as u32));
        }
    }

    /// A round's readback work after its decode pass (rows that read more than their id): the
    /// choice (`encode_choice`), then the copies of what each row reads, one after another in
    /// the staging buffers (so that only those bytes are mapped).
    pub(super) fn encode_rows(&mut self, enc: &mut wgpu::CommandEncoder, want: &[RowReadback]) -> Result<()> {
        let n = want.len();
        self.encode_choice(enc, want);
        let b = &self.buf;
        let vocab = self.config.vocab_size;
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_top_k, 0, 4 * n as u64);
        let (mut at, mut logits_at) = (4 * n as u64, 0u64);
        let (row_words, row_logits) = (kernels::TOP_K_WORDS as u64 * 4, vocab as u64 * 4);
        for (r, w) in want.iter().enumerate() {
            match *w {
                RowReadback::Argmax | RowReadback::Draw { .. } => {}
                RowReadback::Select { k, tail } => {
                    let (from, len) = (selection_offset(tail.is_some()), selection_bytes(k.min(vocab), tail.is_some()));
                    enc.copy_buffer_to_buffer(&b.top_k_out, r as u64 * row_words + from, &b.staging_top_k, at, len);
                    at += len;
                }
                RowReadback::Logits => {
                    enc.copy_buffer_to_buffer(
                        &b.logits,
                        r as u64 * row_logits,
                        &b.staging_logits,
                        logits_at,
                        row_logits,
                    );
                    logits_at += row_logits;
                }
            }
        }
        Ok(())
    }

    /// Reads what `encode_rows` copied into `r`.
    pub(super) async fn read_rows(&self, r: RowsReadback<'_>) -> Result<()> {
        let b = &self.buf;
        let (n, vocab) = (r.want.len(), self.config.vocab_size);
        let select_bytes: u64 = r
            .want
            .iter()
            .map(|w| match *w {
                RowReadback::Select { k, tail } => selection_bytes(k.min(vocab), tail.is_some()),
                _ => 0,
            })
            .sum();
        let (want, ids, top, tails) = (r.want, r.ids, r.top, r.tails);
        self.gpu
            .read_mapped(&b.staging_top_k, 4 * n as u64 + select_bytes, |bytes| {
                ids[..n].copy_from_slice(bytemuck::cast_slice(&bytes[..4 * n]));
                let mut at = 4 * n;
                for (row, w) in want.iter().enumerate() {
                    if let RowReadback::Select { k, tail } = *w {
                        let (k, len) = (k.min(vocab), selection_bytes(k.min(vocab), tail.is_some()) as usize);
                        read_selection(&bytes[at..at + len], k, tail.map(|_| &mut tails[row]), &mut top[row]);
                        at += len;
                    }
                }
            })
            .await?;
        let logit_rows = want.iter().filter(|w| **w == RowReadback::Logits).count();
        if logit_rows > 0 {
            let logits = r.logits;
            self.gpu
                .read_mapped(&b.staging_logits, (logit_rows * vocab * 4) as u64, |bytes| {
                    let mut values = bytemuck::cast_slice::<u8, f32>(bytes).chunks_exact(vocab);
                    for (row, _) in want.iter().enumerate().filter(|(_, w)| **w == RowReadback::Logits) {
                        let read = values.next().expect("a row read for each");
                        logits[row * vocab..][..vocab].copy_from_slice(read);
                    }
                })
                .await?;
        }
        Ok(())
    }
}
