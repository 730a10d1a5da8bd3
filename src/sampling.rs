//! Sampling: parameters and the logits pipeline
//! penalties -> temperature -> top-k -> top-p -> min-p -> seeded draw.
//! The RNG and the exp are portable (xoshiro256**, libm), so one seed gives the same tokens
//! natively and in wasm.

use crate::constraint::Constraint;
use crate::error::{Error, Result};

/// The repetition penalty divides or multiplies logits: past these bounds a logit of a few
/// hundred overflows f32 or vanishes, which no caller means. (Usual values: 1.0 to 1.5.)
const MIN_REPETITION_PENALTY: f32 = 0.01;
const MAX_REPETITION_PENALTY: f32 = 100.0;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// Divides positive logits and multiplies negative ones of tokens already in the context; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already in the context.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the context.
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Added to the given tokens' logits, after the penalties and before anything else
    /// (OpenAI's `logit_bias`: each in [-100, 100], at most MAX_LOGIT_BIAS tokens).
    pub logit_bias: Vec<(u32, f32)>,
}

/// Tokens a `logit_bias` may name.
pub const MAX_LOGIT_BIAS: usize = 1024;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..Self::default() }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f32, expected| {
            Err(Error::InvalidSamplingParameter { name, value: value.to_string(), expected })
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "must be in (0, 1]");
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return bad("min_p", self.min_p, "must be in [0, 1)");
        }
        if !(MIN_REPETITION_PENALTY..=MAX_REPETITION_PENALTY).contains(&self.repetition_penalty) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be in [0.01, 100] (1 = off; further from 1 it overflows the logits it divides)",
            );
        }
        if !self.presence_penalty.is_finite() || self.presence_penalty.abs() > 2.0 {
            return bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]");
        }
        if !self.frequency_penalty.is_finite() || self.frequency_penalty.abs() > 2.0 {
            return bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]");
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return bad("logit_bias", self.logit_bias.len() as f32, "at most 1024 tokens");
        }
        if let Some(&(_, b)) = self.logit_bias.iter().find(|(_, b)| !(b.is_finite() && b.abs() <= 100.0)) {
            return bad("logit_bias", b, "each bias must be in [-100, 100]");
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Penalties or a logit bias: the logits change before a token is drawn (so the whole row
    /// is needed, and the argmax of the raw logits is not greedy's token).
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }
}

/// xoshiro256** seeded through splitmix64: small, fast and the same on every target.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Self { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// One candidate token after the pipeline: its probability, and whether top-k/top-p/min-p kept it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub prob: f32,
    pub kept: bool,
}

/// Samples tokens for one request; holds the counts the penalties need and the seeded RNG.
/// Buffers are reused, so a step allocates nothing.
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    counts: Vec<u32>,
    seen: Vec<u32>,
    candidates: Vec<(u32, f32)>,
    /// The request's structured-output constraint, its last mask, and the error that ended it
    /// (`take_error`).
    constraint: Option<Constraint>,
    mask: Vec<u32>,
    failed: Option<Error>,
    /// `mask` is the constraint's for the tokens accepted so far (computed once a step).
    mask_ready: bool,
    /// The uniform drawn for a token whose step was submitted ahead (`gpu_uniform`).
    pending: Option<f64>,
    /// The uniform of the token the GPU draws now (`gpu_uniform(false)`), and the one the next
    /// `draw` takes instead of the stream's next when the GPU could not draw (`redraw`).
    current: f64,
    redraw: Option<f64>,
}

impl Sampler {
    pub fn new(params: SamplingParams, vocab_size: usize) -> Result<Self> {
        params.validate()?;
        if let Some(&(id, _)) = params.logit_bias.iter().find(|(id, _)| *id as usize >= vocab_size) {
            return Err(Error::InvalidOption {
                name: "logit_bias",
                value: id.to_string(),
                expected: format!("token ids below the vocabulary's {vocab_size}"),
            });
        }
        Ok(Self {
            rng: Rng::new(params.seed),
            params,
            counts: vec![0; vocab_size],
            seen: Vec::new(),
            candidates: Vec::new(),
            constraint: None,
            mask: Vec::new(),
            failed: None,
            mask_ready: false,
            pending: None,
            current: 0.0,
            redraw: None,
        })
    }

    /// Draws only tokens `constraint` allows from here on (the prompt already accepted).
    pub fn constrain(&mut self, constraint: Constraint) {
        self.constraint = Some(constraint);
    }

    pub fn constraint(&self) -> Option<&Constraint> {
        self.constraint.as_ref()
    }

    /// The error that ended the constraint (a state no token can continue, a grammar past
    /// its limits), once: the request fails with it.
    pub fn take_error(&mut self) -> Option<Error> {
        self.failed.take()
    }

    /// Penalties or a logit bias change the logits before a token is drawn (a constraint's
    /// mask aside: the GPU applies it to its selection).
    fn penalized(&self) -> bool {
        self.params.has_penalties()
    }

    /// The constraint's mask for the next token (a bit a token), computed once a step: on
    /// failure, the first token alone (the request ends with `take_error`'s error, never on a
    /// token the grammar refused). None without a constraint.
    pub fn prepare_mask(&mut self) -> Option<&[u32]> {
        let c = self.constraint.as_mut()?;
        if !std::mem::replace(&mut self.mask_ready, true) {
            if let Err(e) = c.fill_mask(&mut self.mask) {
                self.failed.get_or_insert(e);
                self.mask.clear();
                self.mask.resize(self.counts.len().div_ceil(32), 0);
                self.mask[0] = 1;
            }
        }
        Some(&self.mask)
    }

    /// Sets the logits the constraint does not allow to -inf (`prepare_mask`): before `sample`,
    /// for what is reported of the distribution it draws from (candidates, log-probabilities),
    /// or in it.
    pub fn mask_logits(&mut self, logits: &mut [f32]) {
        if self.prepare_mask().is_some() {
            crate::constraint::apply_mask(&self.mask, logits);
        }
    }

    /// Tokens the next draw may take: the vocabulary, or those the constraint's mask allows.
    pub fn allowed_tokens(&mut self) -> usize {
        match self.prepare_mask() {
            Some(_) => self.constraint.as_ref().map_or(1, |c| c.allowed().max(1)),
            None => self.vocab_size(),
        }
    }

    /// The vocabulary it draws from.
    pub fn vocab_size(&self) -> usize {
        self.counts.len()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token of the context (prompt or generated) for the penalties.
    pub fn accept(&mut self, id: u32) {
        if let Some(c) = self.counts.get_mut(id as usize) {
            if *c == 0 {
                self.seen.push(id);
            }
            *c += 1;
        }
        if let Some(Err(e)) = self.constraint.as_mut().map(|c| c.accept(id)) {
            self.failed.get_or_insert(e);
        }
        self.mask_ready = false;
    }

    /// Whether this sampler takes the argmax of the logits as they come (given a constraint,
    /// of the tokens its mask allows): greedy, no penalties.
    pub fn argmax_only(&self) -> bool {
        self.params.is_greedy() && !self.penalized()
    }

    /// Whether `sample_top_k` can stand in for `sample`: Some(k) when this sampler draws from the
    /// k largest logits alone (top-k set, no penalties; given a constraint, the k largest of
    /// the tokens its mask allows), so those are all it needs to see.
    pub fn top_k_only(&self) -> Option<usize> {
        let p = &self.params;
        (!p.is_greedy() && !self.penalized() && p.top_k > 0).then_some(p.top_k)
    }

    /// `sample` given only the `top_k_only()` largest logits as (id, logit) pairs, in any order:
    /// the same token as `sample` on all the logits.
    pub fn sample_top_k(&mut self, top: &[(u32, f32)]) -> u32 {
        self.candidates.clear();
        self.candidates.extend_from_slice(top);
        let z = self.temper(None);
        self.cut(z);
        self.draw()
    }

    /// The uniform the next token's draw takes when the GPU draws it
    /// (`gpu::RowReadback::Draw`, shaders/draw.wgsl: `sample_top_k` there): the number of the
    /// seeded stream that `sample_top_k` would take, so a seed gives the same tokens either way.
    /// `ahead`: for a step submitted before the current one's token is read (a pipelined
    /// round): drawn now and kept, and the next call without `ahead` takes it again, so that
    /// the token gets it whether that round or one submitted in its place chooses it.
    pub fn gpu_uniform(&mut self, ahead: bool) -> f32 {
        let u = match (ahead, self.pending.take()) {
            (false, Some(u)) => u,
            _ => self.rng.next_f64(),
        };
        if ahead {
            self.pending = Some(u);
        } else {
            self.current = u;
        }
        u as f32
    }

    /// The GPU could not place the cut of the token it was to draw (`kernels::UNDECIDED`: a
    /// top-p/min-p nucleus past its selection, or too near the tail's error): the next `sample`,
    /// on the row's logits, draws with the uniform the GPU took, so that the seeded stream is
    /// `sample`'s alone either way.
    pub fn redraw(&mut self) {
        self.redraw = Some(self.current);
    }

    /// Whether the next token is drawn again on the host (`redraw`).
    pub fn redrawing(&self) -> bool {
        self.redraw.is_some()
    }

    /// Whether `sample_nucleus` can stand in for `sample`: no top-k, no penalties, and a top-p or
    /// min-p cut, which usually keeps a few of the largest logits (OpenAI-style requests).
    pub fn nucleus_only(&self) -> bool {
        let p = &self.params;
        !p.is_greedy() && !self.penalized() && p.top_k == 0 && (p.top_p < 1.0 || p.min_p > 0.0)
    }

    /// `sample` given the `top.len()` largest logits (any order) of a vocabulary of `vocab` and
    /// what the rest add up to (`tail`): the same token as `sample` on all the logits, or None,
    /// drawing nothing, when the cut cannot be told from these alone (the nucleus reaches past
    /// them, or the tail's error bound straddles a top-p boundary): then `sample` needs them all.
    pub fn sample_nucleus(&mut self, top: &[(u32, f32)], vocab: usize, tail: Tail) -> Option<u32> {
        self.candidates.clear();
        self.candidates.extend_from_slice(top);
        let complete = top.len() >= vocab;
        let Some(head) = self.temper(Some(tail.max_abs)) else {
            // All the mass on the largest logit, as `sample` has it.
            return Some(self.draw());
        };
        let p = &self.params;
        let (z, err) = (head + tail.sum as f64, tail.sum as f64 * TAIL_REL_ERROR);
        if p.top_p < 1.0 {
            // The cut falls where the running mass first reaches top_p of the total: it must
            // fall on the same candidate for every total within the tail's error.
            let (lo, hi) = (p.top_p as f64 * (z - err), p.top_p as f64 * (z + err));
            let mut mass = 0f64;
            for &(_, e) in &self.candidates {
                mass += e as f64;
                if mass >= lo && mass < hi {
                    return None;
                }
                if mass >= hi {
                    break;
                }
            }
            if mass < hi && !complete {
                return None;
            }
        } else if !complete && self.candidates.last().is_some_and(|&(_, e)| e >= p.min_p) {
            // min-p alone keeps every token up to the smallest here: more may follow.
            return None;
        }
        self.cut(Some(z));
        Some(self.draw())
    }

    /// Picks the next token from `logits` (modified in place by the penalties).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.mask_logits(logits);
        self.apply_penalties(logits);
        if self.params.is_greedy() {
            return argmax(logits);
        }
        self.filter(logits);
        self.draw()
    }

    /// Speculative sampling's check of a drafted token against `logits` (modified in place by
    /// the penalties): kept with probability p(draft) under the distribution `sample` draws from,
    /// else a token drawn from that distribution without the draft (the residual max(0, p - q)
    /// of a draft distribution q that is one-hot: the drafters are deterministic). The token
    /// that comes out is distributed exactly as `sample`'s. Returns it and whether it is the
    /// draft.
    pub fn check_draft(&mut self, logits: &mut [f32], draft: u32) -> (u32, bool) {
        self.apply_penalties(logits);
        if self.params.is_greedy() {
            let id = argmax(logits);
            return (id, id == draft);
        }
        self.filter(logits);
        let total: f64 = self.candidates.iter().map(|&(_, p)| p as f64).sum();
        let p = self.candidates.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1 as f64) / total;
        if self.rng.next_f64() < p {
            return (draft, true);
        }
        self.candidates.retain(|c| c.0 != draft);
        (self.draw(), false)
    }

    /// Undoes `accept(id)` (a drafted token counted for the penalties of the positions after it
    /// while they are checked, counted again when it is emitted).
    pub fn forget(&mut self, id: u32) {
        if let Some(c) = self.counts.get_mut(id as usize) {
            *c = c.saturating_sub(1);
            if *c == 0 {
                self.seen.retain(|&s| s != id);
            }
        }
    }

    /// The seeded draw from the kept candidates.
    fn draw(&mut self) -> u32 {
        let total: f64 = self.candidates.iter().map(|&(_, p)| p as f64).sum();
        let u = self.redraw.take().unwrap_or_else(|| self.rng.next_f64());
        let mut r = u * total;
        for &(id, p) in &self.candidates {
            r -= p as f64;
            if r < 0.0 {
                return id;
            }
        }
        self.candidates.last().map_or(0, |&(id, _)| id)
    }

    /// The distribution the last `sample` drew from: the `n` most likely tokens after temperature,
    /// with the ones top-k/top-p/min-p kept marked. For display; allocates.
    pub fn top_candidates(&mut self, logits: &[f32], n: usize) -> Vec<Candidate> {
        let all = self.distribution(logits);
        let mut penalized = logits.to_vec();
        self.apply_penalties(&mut penalized);
        let kept: Vec<u32> = if self.params.is_greedy() {
            vec![argmax(&penalized)]
        } else {
            self.filter(&penalized);
            self.candidates.iter().map(|c| c.0).collect()
        };
        all.iter().take(n).map(|&(id, prob)| Candidate { id, prob, kept: kept.contains(&id) }).collect()
    }

    /// The probability of `id` in the distribution `top_candidates` reports (penalties and
    /// temperature applied, before the top-k/top-p/min-p cut; temperature 1 when greedy): what an
    /// API reports as the token's logprob. Allocates.
    pub fn probability_of(&self, logits: &[f32], id: u32) -> f32 {
        self.distribution(logits).iter().find(|c| c.0 == id).map_or(0.0, |c| c.1)
    }

    /// Every token's probability after penalties and temperature, most likely first.
    fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let mut logits = logits.to_vec();
        self.apply_penalties(&mut logits);
        let temperature = if self.params.temperature > 0.0 { self.params.temperature } else { 1.0 };
        let mut all: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / temperature)).collect();
        if all.iter().any(|c| !c.1.is_finite()) {
            // Overflowed by a tiny temperature: all the mass is on the argmax (see `filter`).
            let best = argmax(&logits);
            all.iter_mut().for_each(|c| c.1 = if c.0 == best { 0.0 } else { f32::NEG_INFINITY });
        }
        sort_desc(&mut all);
        softmax_pairs(&mut all);
        all
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        if !self.params.has_penalties() {
            return;
        }
        let p = &self.params;
        for &id in &self.seen {
            let Some(l) = logits.get_mut(id as usize) else { continue };
            if *l > 0.0 {
                *l /= p.repetition_penalty;
            } else {
                *l *= p.repetition_penalty;
            }
            *l -= p.presence_penalty + p.frequency_penalty * self.counts[id as usize] as f32;
        }
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
    }

    /// Fills `self.candidates` with the kept tokens and their (unnormalized) probabilities, most
    /// likely first: top-k (on the logits: temperature keeps their order), temperature, top-p
    /// and min-p.
    fn filter(&mut self, logits: &[f32]) {
        let p = &self.params;
        let cands = &mut self.candidates;
        cands.clear();
        // A token the constraint refuses (-inf) is no candidate (the logits are otherwise finite).
        cands.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).filter(|c| c.1 != f32::NEG_INFINITY));
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            cands.truncate(p.top_k);
        }
        let z = self.temper(None);
        self.cut(z);
    }

    /// The candidates (raw logits) divided by the temperature, sorted, and replaced by their
    /// weights exp(l / T - l_max / T) (unnormalized probabilities: the largest is 1); returns
    /// their sum. A temperature so small that some logit / temperature overflows (`max_abs`: the
    /// largest |logit| of the whole vocabulary, when the candidates are not all of it) leaves all
    /// the mass on the largest logit, which is greedy decoding: one candidate, and None.
    fn temper(&mut self, max_abs: Option<f32>) -> Option<f64> {
        let t = self.params.temperature;
        let cands = &mut self.candidates;
        sort_desc(cands);
        let overflows = |l: f32| !(l / t).is_finite();
        if max_abs.map_or(cands.iter().any(|c| overflows(c.1)), overflows) {
            cands.truncate(1);
            cands[0].1 = 1.0;
            return None;
        }
        cands.iter_mut().for_each(|c| c.1 /= t);
        let max = cands.first().map_or(0.0, |c| c.1);
        let mut sum = 0f64;
        for c in cands.iter_mut() {
            c.1 = libm::expf(c.1 - max);
            sum += c.1 as f64;
        }
        Some(sum)
    }

    /// Cuts the tempered candidates by top-p (the running weight first reaching top_p of `z`,
    /// the whole vocabulary's weight) and min-p (a weight of at least min_p: the largest is 1).
    /// `z` None: nothing to cut (an overflowed temperature left one candidate).
    fn cut(&mut self, z: Option<f64>) {
        let (p, cands) = (&self.params, &mut self.candidates);
        let Some(z) = z else { return };
        if p.top_p < 1.0 {
            let target = p.top_p as f64 * z;
            let mut mass = 0f64;
            let keep = cands
                .iter()
                .position(|&(_, e)| {
                    mass += e as f64;
                    mass >= target
                })
                .map_or(cands.len(), |i| i + 1);
            cands.truncate(keep);
        }
        if p.min_p > 0.0 {
            cands.retain(|&(_, e)| e >= p.min_p);
        }
    }
}

/// What a GPU selection of the largest logits says of the rest of the vocabulary, for
/// `Sampler::sample_nucleus`.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Tail {
    /// The sum of exp(l / T - l_max / T) over the logits not selected (f32 on the GPU).
    pub sum: f32,
    /// The largest |logit| of the whole vocabulary.
    pub max_abs: f32,
}

/// The bound on `Tail::sum`'s relative error that `sample_nucleus` allows for: WGSL's `exp` may
/// be off by 3 + 2|x| ULP (|x| < 88 for any term that is not 0: 1.1e-5), its argument by the
/// rounding of l / T (5e-6), and the f32 sum of up to 192 terms a thread then a tree of 256
/// (1.2e-5): 3e-5 at worst, with a margin of 3.
pub const TAIL_REL_ERROR: f64 = 1e-4;

/// Whether every logit is a finite number: a model that produced NaN or infinity gives no token.
pub fn all_finite(logits: &[f32]) -> bool {
    logits.iter().all(|l| l.is_finite())
}

/// First index of the largest value (ties go to the lower id, as torch's argmax does).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

fn sort_desc(c: &mut [(u32, f32)]) {
    c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

/// Replaces the logits of `c` (sorted, largest first) with softmax probabilities.
fn softmax_pairs(c: &mut [(u32, f32)]) {
    let Some(&(_, max)) = c.first() else { return };
    let mut sum = 0f64;
    for e in c.iter_mut() {
        e.1 = libm::expf(e.1 - max);
        sum += e.1 as f64;
    }
    for e in c.iter_mut() {
        e.1 = (e.1 as f64 / sum) as f32;
    }
}
