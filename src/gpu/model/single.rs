//! Single-sequence entry points, driven by hand: `step`/`step_in` (a pass of one sequence's
//! tokens, reading back nothing, the argmax or the logits), greedy steps submitted ahead
//! (`submit_greedy`), self-speculation's draft pass, every position's logits (perplexity) and
//! the per-kernel profile. The kernel and golden tests, the draft model and `bench` use them;
//! the runtime's requests go through `round.rs`.

use super::*;

/// What a step reads back.
#[derive(Debug, PartialEq)]
pub enum Readback<'a> {
    /// Nothing (an intermediate prefill chunk).
    None,
    /// The argmax of the last position's logits (4 bytes).
    Argmax,
    /// The last position's logits, into the given slice (vocab values).
    Logits(&'a mut [f32]),
}

/// `GpuModel::profile`'s answer: milliseconds per kernel family, in the order of first use.
#[cfg(not(target_arch = "wasm32"))]
pub struct Profile {
    pub families: Vec<(&'static str, f64)>,
    /// Timed by the GPU's timestamps (else by the host's clock around each submission).
    pub gpu_clock: bool,
}

/// A greedy decode step submitted and not yet read (see `GpuModel::submit_greedy`).
pub struct InFlight {
    slot: usize,
    submission: wgpu::SubmissionIndex,
    position: usize,
}

impl GpuModel {
    /// Runs `tokens` at positions `start..` (at most `all_logits_chunk()` of them) and returns
    /// the logits of every position (`n * vocab`). For perplexity and tests, not the decode loop.
    pub async fn logits_all(&mut self, tokens: &[u32], start: usize) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n == 0 || n > self.all_logits_chunk() || start + n > self.context {
            return Err(Error::ContextOverflow {
                prompt_tokens: start + n,
                max_tokens: 0,
                context_length: self.context,
            });
        }
        if self.all_logits.is_none() {
            let buffer =
                self.gpu.storage("all_logits", (self.all_logits_chunk() * self.config.vocab_size * 4) as u64)?;
            let ops = self.record(Pass::AllLogits(&buffer));
            self.all_logits = Some((ops, buffer));
        }
        self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::cast_slice(tokens));
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        let main = self.main;
        self.prepare(&mut enc, (start..start + n).map(|p| (main, p)), Params::new(n, 1))?;
        let (ops, buffer) = self.all_logits.as_ref().expect("recorded above");
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            ops.iter().for_each(|op| op.encode(&mut pass, n as u32));
        }
        self.gpu.submit(enc);
        self.gpu.read_f32(buffer, n * self.config.vocab_size).await
    }

    /// Positions per `logits_all` call: a prefill chunk, fewer when its logits would not fit
    /// one binding.
    pub fn all_logits_chunk(&self) -> usize {
        let per_token = self.config.vocab_size as u64 * 4;
        let max = self.gpu.max_binding();
        self.layout.rows.min((max / per_token) as usize).max(1)
    }

    /// Time per kernel family for one pass of `n` tokens at `start`: where the time of a step
    /// goes. With timestamp queries each dispatch is timed on the GPU's clock in one submission
    /// (the sum is the GPU's busy time; a real step adds the gaps between dispatches); without,
    /// each dispatch is submitted and waited for alone, so the sum exceeds a real step. It uses
    /// (and empties) the hand-driven sequence.
    #[cfg(not(target_arch = "wasm32"))]
    pub async fn profile(&mut self, n: usize, start: usize) -> Result<Profile> {
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        let main = self.main;
        self.prepare(&mut enc, (start..start + n).map(|p| (main, p)), Params::new(n, 1))?;
        self.gpu.submit(enc);
        // The dispatches a pass at this context encodes (decode attention's one or two).
        let rows = SegmentRows::at_keys(n as u32, start + n, self.short_keys);
        let ops = if n == 1 { &self.decode } else { &self.prefill };
        let ops: Vec<&Dispatch> = ops.iter().filter(|op| rows.of(op.groups.segment) > 0).collect();
        let mut times = Vec::with_capacity(ops.len());
        if self.gpu.timestamps {
            // One pass per dispatch, its start and end stamped, all in one submission.
            let count = 2 * ops.len() as u32;
            let set = self.gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count,
            });
            let resolved = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("profile"),
                size: 8 * count as u64,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let staging = self.gpu.readback("profile", 8 * count as u64);
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            for (i, op) in ops.iter().enumerate() {
                let writes = wgpu::ComputePassTimestampWrites {
                    query_set: &set,
                    beginning_of_pass_write_index: Some(2 * i as u32),
                    end_of_pass_write_index: Some(2 * i as u32 + 1),
                };
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(op.label),
                    timestamp_writes: Some(writes),
                });
                op.encode_rows(&mut pass, &rows);
            }
            enc.resolve_query_set(&set, 0..count, &resolved, 0);
            enc.copy_buffer_to_buffer(&resolved, 0, &staging, 0, 8 * count as u64);
            self.gpu.submit(enc);
            let ticks: Vec<u64> =
                self.gpu.read_mapped(&staging, 8 * count as u64, bytemuck::pod_collect_to_vec).await?;
            let period_ms = self.gpu.queue.get_timestamp_period() as f64 / 1e6;
            for (op, t) in ops.iter().zip(ticks.chunks_exact(2)) {
                times.push((op.label, t[1].saturating_sub(t[0]) as f64 * period_ms));
            }
        } else {
            for op in ops {
                let mut enc = self.gpu.device.create_command_encoder(&Default::default());
                op.encode_rows(&mut enc.begin_compute_pass(&Default::default()), &rows);
                let t = web_time::Instant::now();
                self.gpu.submit(enc);
                self.gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| Error::Gpu(e.to_string()))?;
                times.push((op.label, t.elapsed().as_secs_f64() * 1e3));
            }
        }
        self.gpu.check()?;
        let mut families: Vec<(&'static str, f64)> = Vec::new();
        for (label, ms) in times {
            match families.iter_mut().find(|(l, _)| *l == label) {
                Some(entry) => entry.1 += ms,
                None => families.push((label, ms)),
            }
        }
        // The pass wrote junk keys at start..start + n: give its blocks back to the pool, which
        // a later run (`bench --context 512,4096 --profile`) may need whole.
        self.truncate_sequence(main, 0);
        Ok(Profile { families, gpu_clock: self.gpu.timestamps })
    }

    /// Submits the greedy decode step at `position` for `token`, or, with None, for the argmax
    /// of the step submitted before it, which stays on the GPU: the step's own argmax is copied
    /// into the token buffer for the step after. So step n + 1 can be submitted before step n's
    /// id is read (`read_greedy`), and the GPU does not wait for the host between tokens.
    pub fn submit_greedy(&mut self, token: Option<u32>, position: usize) -> Result<InFlight> {
        if position >= self.context {
            return Err(Error::ContextOverflow {
                prompt_tokens: position + 1,
                max_tokens: 0,
                context_length: self.context,
            });
        }
        self.gpu.check()?;
        let host = HostClock::now();
        if let Some(token) = token {
            self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::bytes_of(&token));
        }
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        let main = self.main;
        self.prepare(&mut enc, std::iter::once((main, position)), Params::new(1, 1))?;
        Self::encode_ops(&mut enc, &self.decode, &SegmentRows::at_keys(1, position + 1, self.short_keys));
        let (b, slot) = (&self.buf, self.next_slot);
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.tokens, 0, 4);
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[slot], 0, 4);
        let submission = self.gpu.submit(enc);
        self.count_host_time(host);
        self.next_slot = 1 - slot;
        Ok(InFlight { slot, submission, position: position + 1 })
    }

    /// The id a greedy step chose (waiting for it); non-finite logits are an error.
    pub async fn read_greedy(&mut self, step: InFlight) -> Result<u32> {
        let staging = &self.buf.staging_argmax[step.slot];
        let id = self
            .gpu
            .read_mapped_after(staging, 4, Some(step.submission), |bytes| {
                u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
            })
            .await?;
        // The argmax kernel flags NaN or infinite logits with u32::MAX.
        if id == u32::MAX {
            return Err(Error::NonFiniteLogits { position: step.position });
        }
        Ok(id)
    }

    /// Self-speculation's draft: the decode step of `token` at `pos` of sequence `seq` through
    /// the first `layers` layers, then the final norm and the LM head; the argmax. It writes those
    /// layers' keys and values at `pos`, as the whole model would for the same token.
    pub async fn draft_step_in(&mut self, seq: SeqId, layers: usize, token: u32, pos: usize) -> Result<u32> {
        let n_layers = self.layers.len();
        if layers == 0 || layers >= n_layers {
            return Err(Error::InvalidOption {
                name: "speculate",
                value: format!("layers:{layers}"),
                expected: format!("layers:L with L from 1 to {} (the model has {n_layers} layers)", n_layers - 1),
            });
        }
        if self.draft.as_ref().is_none_or(|d| d.0 != layers) {
            let ops = self.record(Pass::Decode { mb: 1, layers });
            self.draft = Some((layers, ops));
        }
        self.gpu.check()?;
        self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::bytes_of(&token));
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("draft") });
        self.prepare(&mut enc, std::iter::once((seq, pos)), Params::new(1, 1))?;
        let rows = SegmentRows::at_keys(1, pos + 1, self.short_keys);
        Self::encode_ops(&mut enc, &self.draft.as_ref().expect("recorded above").1, &rows);
        let b = &self.buf;
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[0], 0, 4);
        self.gpu.submit(enc);
        let id =
            self.gpu.read_mapped(&b.staging_argmax[0], 4, |bytes| bytemuck::cast_slice::<u8, u32>(bytes)[0]).await?;
        if id == u32::MAX {
            return Err(Error::NonFiniteLogits { position: pos + 1 });
        }
        Ok(id)
    }

    /// Up to `k` draft tokens from Qwen3.5's MTP head (greedy) in sequence `seq` after `tokens`
    /// (the sequence's positions, then the token the model chose after them, not yet run), as
    /// the CPU's `CpuModel::mtp_draft`: the head first reads the positions it has not (each
    /// with the token after it: prefill-style passes over the kept hidden states), then drafts a
    /// token a pass, each pass reading its own last output. Its keys and values at the drafts'
    /// positions are written over later. Stops early (fewer drafts) when the pool has no block
    /// for another draft position or the logits are not finite.
    pub async fn mtp_draft_in(&mut self, seq: SeqId, tokens: &[u32], k: usize, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        let len = tokens.len().saturating_sub(1);
        if k == 0 || len == 0 || self.mtp.is_none() {
            return Ok(());
        }
        if self.mtp_passes.is_none() {
            let gathered = self.record(Pass::Mtp { chained: false });
            let chained = self.record(Pass::Mtp { chained: true });
            self.mtp_passes = Some([gathered, chained]);
        }
        self.gpu.check()?;
        // The head's last position is read again when it has read them all (its logits are
        // the first draft's).
        let from = self.mtp_len[seq.0].min(len - 1);
        let d = self.config.d_model as u64 * 4;
        let mut last_rows = 0;
        for start in (from..len).step_by(self.layout.rows) {
            let n = self.layout.rows.min(len - start);
            self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::cast_slice(&tokens[start + 1..start + 1 + n]));
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            self.prepare(&mut enc, (start..start + n).map(|p| (seq, p)), Params::new(n, 1))?;
            let rows = SegmentRows::at_keys(n as u32, start + n, self.short_keys);
            Self::encode_ops(&mut enc, &self.mtp_passes.as_ref().expect("recorded above")[0], &rows);
            let b = &self.buf;
            enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[0], 0, 4);
            self.gpu.submit(enc);
            last_rows = n;
        }
        self.mtp_len[seq.0] = len;
        let mut id = self.read_mtp_argmax().await?;
        while let Some(token) = id {
            out.push(token);
            let pos = len + out.len() - 1;
            if out.len() == k || pos >= self.context {
                break;
            }
            let b = &self.buf;
            self.gpu.queue.write_buffer(&b.tokens, 0, bytemuck::bytes_of(&token));
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            let [h, _, head_out] = b.mtp_rows.as_ref().expect("made with the MTP head");
            enc.copy_buffer_to_buffer(head_out, (last_rows as u64 - 1) * d, h, 0, d);
            match self.prepare(&mut enc, std::iter::once((seq, pos)), Params::new(1, 1)) {
                // No block for another draft: those so far.
                Err(Error::KvPoolFull { .. }) => break,
                r => r?,
            }
            let rows = SegmentRows::at_keys(1, pos + 1, self.short_keys);
            Self::encode_ops(&mut enc, &self.mtp_passes.as_ref().expect("recorded above")[1], &rows);
            let b = &self.buf;
            enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[0], 0, 4);
            self.gpu.submit(enc);
            last_rows = 1;
            id = self.read_mtp_argmax().await?;
        }
        Ok(())
    }

    /// The MTP pass's argmax, None for non-finite logits (the draft stops there).
    async fn read_mtp_argmax(&self) -> Result<Option<u32>> {
        let staging = &self.buf.staging_argmax[0];
        let id = self.gpu.read_mapped(staging, 4, |bytes| bytemuck::cast_slice::<u8, u32>(bytes)[0]).await?;
        Ok((id != u32::MAX).then_some(id))
    }

    /// Runs `tokens` at positions `start..` (one pass: at most `pass_rows` tokens) of the
    /// conversation's sequence, writing their keys and values into the cache. Returns the argmax
    /// when asked for it.
    pub async fn step(&mut self, tokens: &[u32], start: usize, readback: Readback<'_>) -> Result<Option<u32>> {
        self.step_in(self.main, tokens, start, readback).await
    }

    /// `step` in sequence `seq`.
    pub async fn step_in(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        start: usize,
        readback: Readback<'_>,
    ) -> Result<Option<u32>> {
        let n = tokens.len();
        if n == 0 || n > self.layout.rows || start + n > self.context {
            return Err(Error::ContextOverflow {
                prompt_tokens: start + n,
                max_tokens: 0,
                context_length: self.context,
            });
        }
        // A lost device (or an error left by an earlier call) fails here, before any work.
        self.gpu.check()?;
        let host = HostClock::now();
        self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::cast_slice(tokens));
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        self.prepare(&mut enc, (start..start + n).map(|p| (seq, p)), Params::new(n, 1))?;
        let rows = SegmentRows::at_keys(n as u32, start + n, self.short_keys);
        Self::encode_ops(&mut enc, if n == 1 { &self.decode } else { &self.prefill }, &rows);
        let b = &self.buf;
        let logits_bytes = self.config.vocab_size as u64 * 4;
        let slot = self.next_slot;
        match &readback {
            Readback::None => {}
            Readback::Argmax => enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[slot], 0, 4),
            Readback::Logits(_) => enc.copy_buffer_to_buffer(&b.logits, 0, &b.staging_logits, 0, logits_bytes),
        }
        let submission = self.gpu.submit(enc);
        if n == 1 {
            self.count_host_time(host);
        }
        match readback {
            Readback::None => self.gpu.check().map(|_| None),
            Readback::Argmax => {
                let flight = InFlight { slot, submission, position: start + n };
                self.read_greedy(flight).await.map(Some)
            }
            Readback::Logits(out) => {
                self.gpu
                    .read_mapped(&b.staging_logits, logits_bytes, |bytes| {
                        out.copy_from_slice(bytemuck::cast_slice(bytes))
                    })
                    .await?;
                Ok(None)
            }
        }
    }
}
