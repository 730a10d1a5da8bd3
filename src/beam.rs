//! Beam search with the semantics of transformers' `generate(num_beams=N)` (5.x): every step the
//! `K = max(2, 1 + stop ids) × N` best (beam, token) continuations by summed log-probability; the
//! best N of them that do not stop run on; those among the first N that stop (a stop id, or the
//! token limit) are finished hypotheses scored sum / length^length_penalty, the N best kept; the
//! search ends by `early_stopping` (false: when no running beam, scored at its current length,
//! can beat the worst finished one; true: when N are finished; never: with a positive length
//! penalty, scored at the token limit). Returns the N best finished hypotheses, best first.
//!
//! `BeamSearch` is the search a step at a time; the batcher runs it (`Batcher::prepare_beams`):
//! a KV-pool sequence per running beam, after each step beam i continues the sequence its new
//! beam came from (a fork of the pool's block tables, shared blocks copied only when written),
//! and the beams are rows of the batch's decode steps beside the other requests.

use crate::error::{Error, Result};

/// When the search stops, as transformers' `early_stopping`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EarlyStopping {
    /// `False`: once no running beam's score at its current length beats the worst finished one.
    #[default]
    Heuristic,
    /// `True`: once N hypotheses are finished.
    Done,
    /// `"never"`: as `Heuristic`, but with a positive length penalty a running beam is scored at
    /// the token limit (the canonical beam search).
    Never,
}

#[derive(Debug, Clone)]
pub struct BeamOptions {
    /// Beams kept (N), and hypotheses returned.
    pub beams: usize,
    /// New tokens at most per hypothesis.
    pub max_tokens: usize,
    /// Tokens that finish a hypothesis (the model's end-of-sequence ids; empty: none does, and
    /// every hypothesis runs `max_tokens`).
    pub stop_ids: Vec<u32>,
    pub length_penalty: f64,
    pub early_stopping: EarlyStopping,
}

/// The most beams a search keeps: each is a KV-cache sequence and a row of every decode step.
pub const MAX_BEAMS: usize = 32;
/// The largest `length_penalty` magnitude (scores stay finite and ordered).
pub const MAX_LENGTH_PENALTY: f64 = 50.0;

impl BeamOptions {
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_BEAMS).contains(&self.beams) {
            return Err(Error::InvalidOption {
                name: "beams",
                value: self.beams.to_string(),
                expected: format!("between 1 and {MAX_BEAMS}"),
            });
        }
        if self.max_tokens == 0 {
            return Err(Error::InvalidOption {
                name: "max tokens",
                value: "0".into(),
                expected: "beam search needs at least 1 new token".into(),
            });
        }
        // length^penalty stays a finite f64 for any length a context holds (2^17 tokens) up to
        // |penalty| 50; past it scores would be infinite or zero, and their order meaningless.
        if !self.length_penalty.is_finite() || self.length_penalty.abs() > MAX_LENGTH_PENALTY {
            return Err(Error::InvalidOption {
                name: "length penalty",
                value: self.length_penalty.to_string(),
                expected: format!(
                    "a number from -{MAX_LENGTH_PENALTY} to {MAX_LENGTH_PENALTY} (1.0: score = sum of log-probabilities / length)"
                ),
            });
        }
        Ok(())
    }
}

/// A finished hypothesis: its new tokens (a stop id last, when one finished it), its score and
/// its summed log-probability.
#[derive(Debug, Clone, PartialEq)]
pub struct Hypothesis {
    pub ids: Vec<u32>,
    pub score: f64,
    pub sum_logprob: f64,
}

/// A score that can never win (transformers' -1e9).
const NEVER: f64 = -1.0e9;

#[derive(Debug, Clone)]
struct Running {
    ids: Vec<u32>,
    /// Summed log-probability (NEVER added once for a beam that had to run on stopped).
    score: f64,
}

/// Log-probabilities of `logits` (f64, so that the sums of many steps keep their precision),
/// the `k` largest as (log-probability, token), largest first; ties to the lower id.
/// `position`: the logits' position in the sequence, for the error when they are not finite.
fn top_log_probs(logits: &[f32], k: usize, position: usize) -> Result<Vec<(f64, u32)>> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) as f64;
    if !max.is_finite() || logits.iter().any(|l| !l.is_finite()) {
        return Err(Error::NonFiniteLogits { position });
    }
    let log_sum = logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln() + max;
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let k = k.min(ids.len());
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, by_logit);
        ids.truncate(k);
    }
    ids.sort_by(by_logit);
    Ok(ids.into_iter().map(|id| (logits[id as usize] as f64 - log_sum, id)).collect())
}

/// What a beam search does next (`BeamSearch::advance`).
#[derive(Debug, Clone, PartialEq)]
pub enum BeamStep {
    /// Beam i continues the sequence of beam `from[i]`, cut to its first `pos` positions, and
    /// runs `tokens[i]` at `pos`; their logits go to the next `advance`.
    Run { from: Vec<usize>, tokens: Vec<u32>, pos: usize },
    /// The search ended: the N best finished hypotheses, best first.
    Done(Vec<Hypothesis>),
}

/// A beam search as a state machine, a step at a time, so that a batch can run its beams as rows
/// beside other requests: `advance` takes the running beams' logits (the prompt's last
/// position's at first) and says what runs next.
#[derive(Debug, Clone)]
pub struct BeamSearch {
    options: BeamOptions,
    prompt_len: usize,
    /// Continuations considered per step: `max(2, 1 + stop ids) × N`.
    keep: usize,
    running: Vec<Running>,
    finished: Vec<Hypothesis>,
    improvable: bool,
    /// Tokens chosen so far per beam (the step `advance` takes next).
    generated: usize,
}

impl BeamSearch {
    pub fn new(options: BeamOptions, prompt_len: usize) -> Result<Self> {
        options.validate()?;
        let keep = 2usize.max(1 + options.stop_ids.len()) * options.beams;
        // transformers starts from N copies of the prompt scored 0, -1e9, ...: only the first is
        // expanded at the first step.
        let running = vec![Running { ids: Vec::new(), score: 0.0 }];
        Ok(Self { options, prompt_len, keep, running, finished: Vec::new(), improvable: true, generated: 0 })
    }

    /// The beams whose logits the next `advance` takes (1, the prompt's, at first).
    pub fn rows(&self) -> usize {
        self.running.len()
    }

    /// One step from the running beams' logits (`rows()` of them, in beam order).
    pub fn advance(&mut self, logits: &[impl AsRef<[f32]>]) -> Result<BeamStep> {
        let options = &self.options;
        let n = options.beams;
        let generated = self.generated;
        // The K best continuations of all beams: a beam's own K best suffice.
        let mut candidates: Vec<(f64, usize, u32)> = Vec::with_capacity(self.keep * self.running.len());
        for (b, beam) in self.running.iter().enumerate() {
            for (lp, id) in top_log_probs(logits[b].as_ref(), self.keep, self.prompt_len + generated)? {
                candidates.push((beam.score + lp, b, id));
            }
        }
        candidates.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        candidates.truncate(self.keep);
        let length = generated + 1;
        let stops = |id: u32| options.stop_ids.contains(&id) || length >= options.max_tokens;

        // Finished: those among the first N that stop, unless the search can no longer improve
        // (or, with early_stopping true, N are finished already).
        let full = self.finished.len() == n && options.early_stopping == EarlyStopping::Done;
        if self.improvable && !full {
            for &(score, b, id) in candidates.iter().take(n).filter(|c| stops(c.2)) {
                let mut ids = self.running[b].ids.clone();
                ids.push(id);
                let normalized = score / (length as f64).powf(options.length_penalty);
                self.finished.push(Hypothesis { ids, score: normalized, sum_logprob: score });
            }
            self.finished.sort_by(|x, y| y.score.total_cmp(&x.score));
            self.finished.truncate(n);
        }

        // Running on: the N best that do not stop (a stopped one only when fewer remain).
        let mut next: Vec<(f64, usize, u32)> =
            candidates.iter().map(|&(s, b, id)| (if stops(id) { s + NEVER } else { s }, b, id)).collect();
        next.sort_by(|x, y| y.0.total_cmp(&x.0));
        next.truncate(n);
        if candidates.iter().all(|c| stops(c.2)) {
            return Ok(BeamStep::Done(std::mem::take(&mut self.finished)));
        }
        self.running = next
            .iter()
            .map(|&(score, b, id)| {
                let mut ids = self.running[b].ids.clone();
                ids.push(id);
                Running { ids, score }
            })
            .collect();

        // Can a running beam still beat the worst finished hypothesis?
        let best_length = match options.early_stopping {
            EarlyStopping::Never if options.length_penalty > 0.0 => options.max_tokens,
            _ => length,
        };
        let best_running = self.running[0].score / (best_length as f64).powf(options.length_penalty);
        let worst_finished = if self.finished.len() == n { self.finished[n - 1].score } else { NEVER };
        self.improvable &= best_running > worst_finished;
        if !self.improvable
            || (self.finished.len() == n && options.early_stopping == EarlyStopping::Done)
            || length >= options.max_tokens
        {
            return Ok(BeamStep::Done(std::mem::take(&mut self.finished)));
        }
        self.generated = length;
        Ok(BeamStep::Run {
            from: next.iter().map(|c| c.1).collect(),
            tokens: self.running.iter().map(|beam| *beam.ids.last().expect("one token per step")).collect(),
            pos: self.prompt_len + generated,
        })
    }
}
