//! Speculative decoding: a drafter proposes the next K tokens cheaply, one forward pass of the
//! model checks them all (a batched decode step whose rows are the positions of one sequence, so
//! every row's logits are bit for bit those of a plain decode step), and the longest prefix the
//! model agrees with is kept, plus the model's own token after it. Greedy output is unchanged.
//! Drafters: prompt lookup (an n-gram of the context seen earlier proposes what followed it: no
//! extra model), self-speculation (the model's first L layers and its LM head), a separate
//! draft model with the same tokenizer (`Engine::set_draft_model`) and the model's own
//! multi-token-prediction head (Qwen3.5's MTP layer).

use crate::error::{Error, Result};
use std::str::FromStr;

/// Tokens of the context's suffix prompt lookup tries to match, longest first.
pub const MAX_NGRAM: usize = 3;

/// The most tokens a verifying pass checks (the drafted ones and the one before them are rows of
/// one decode step).
pub const MAX_DRAFT_TOKENS: usize = 31;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drafter {
    /// An n-gram match in the context.
    Lookup,
    /// The first L layers of the model, then its final norm and LM head.
    Layers(usize),
    /// The engine's draft model (`Engine::set_draft_model`; the CLI's `draft:PATH` loads it).
    Model,
    /// The model's multi-token-prediction head (`arch::Mtp`), one draft token a pass of it.
    Mtp,
}

impl FromStr for Drafter {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::InvalidOption {
            name: "speculate",
            value: s.to_string(),
            expected: "lookup, layers:L (L = layers of the model that draft, at least 1), draft (the loaded draft \
                       model) or mtp (the model's multi-token-prediction head)"
                .into(),
        };
        match s.split_once(':') {
            None if s == "lookup" => Ok(Drafter::Lookup),
            None if s == "draft" => Ok(Drafter::Model),
            None if s == "mtp" => Ok(Drafter::Mtp),
            Some(("layers", l)) => l.parse().ok().filter(|&l| l >= 1).map(Drafter::Layers).ok_or_else(bad),
            // A path is the command line's to load (`--speculate draft:PATH`), never a request's.
            Some(("draft", _)) => Err(Error::InvalidOption {
                name: "speculate",
                value: s.to_string(),
                expected: "lookup, layers:L or draft: a draft model is loaded from a path only by the command line (--speculate draft:PATH)".into(),
            }),
            _ => Err(bad()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    pub drafter: Drafter,
    /// Tokens drafted per verifying pass (K).
    pub draft_tokens: usize,
}

impl Speculation {
    /// Checks what needs no model (the layer count is checked against the model when it runs).
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.draft_tokens) {
            return Err(Error::InvalidOption {
                name: "draft tokens",
                value: self.draft_tokens.to_string(),
                expected: format!("from 1 to {MAX_DRAFT_TOKENS}"),
            });
        }
        Ok(())
    }
}

/// What speculation did over a generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpeculationStats {
    /// Tokens proposed and checked.
    pub drafted: usize,
    /// Of those, kept.
    pub accepted: usize,
    /// Forward passes of the whole model (verifying passes, and plain steps when nothing was
    /// drafted).
    pub passes: usize,
    /// Passes of the drafting layers (self-speculation).
    pub draft_passes: usize,
}

/// Prompt lookup: finds the most recent earlier occurrence of the context's last n tokens
/// (n = MAX_NGRAM down to 1) and puts the at most `k` tokens that followed it into `out`.
pub fn lookup(context: &[u32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = context.len();
    for n in (1..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &context[len - n..];
        // Latest first: recent text predicts best. A match must leave a token after it.
        if let Some(at) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
            out.extend(context[at + n..].iter().take(k));
            return;
        }
    }
}

/// How many drafted tokens the model agrees with: `verified[i]` is the model's token after the
/// i-th checked position (the last token before the draft, then each drafted one).
pub fn accepted(draft: &[u32], verified: &[u32]) -> usize {
    draft.iter().zip(verified).take_while(|(d, v)| d == v).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix() {
        let mut out = Vec::new();
        // "1 2 3 4 5 ... 1 2 3" -> 4 5 (the 3-gram matched at 0).
        lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2, &mut out);
        assert_eq!(out, [4, 5]);
        // The latest of two matches: 3 followed by 7 last time.
        lookup(&[3, 4, 8, 3, 7, 6, 3], 3, &mut out);
        assert_eq!(out, [7, 6, 3]);
        // Only a 1-gram matches.
        lookup(&[5, 6, 1, 2, 6], 4, &mut out);
        assert_eq!(out, [1, 2, 6]);
        // Nothing matches, or too short a context.
        lookup(&[1, 2, 3], 4, &mut out);
        assert!(out.is_empty());
        lookup(&[1], 4, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn the_accepted_prefix_ends_at_the_first_disagreement() {
        assert_eq!(accepted(&[4, 5, 6], &[4, 5, 9, 1]), 2);
        assert_eq!(accepted(&[4, 5, 6], &[4, 5, 6, 1]), 3);
        assert_eq!(accepted(&[4, 5, 6], &[7, 5, 6, 1]), 0);
    }

    #[test]
    fn drafters_parse_and_bad_values_are_typed_errors() {
        assert_eq!("lookup".parse::<Drafter>().unwrap(), Drafter::Lookup);
        assert_eq!("layers:4".parse::<Drafter>().unwrap(), Drafter::Layers(4));
        assert_eq!("draft".parse::<Drafter>().unwrap(), Drafter::Model);
        assert_eq!("mtp".parse::<Drafter>().unwrap(), Drafter::Mtp);
        for bad in ["layers:0", "layers:x", "look", "", "draft:/tmp/m.gguf"] {
            assert!(matches!(bad.parse::<Drafter>(), Err(Error::InvalidOption { name: "speculate", .. })), "{bad}");
        }
        let spec = |k| Speculation { drafter: Drafter::Lookup, draft_tokens: k };
        assert!(spec(4).validate().is_ok());
        assert!(spec(0).validate().is_err());
        assert!(spec(MAX_DRAFT_TOKENS + 1).validate().is_err());
    }
}
