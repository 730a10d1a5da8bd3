//! Structured output: a request's constraint — a JSON schema, any JSON object, a regex or a Lark
//! grammar — compiled by llguidance over the model's vocabulary, and the tokens it allows at
//! each step. One `Grammars` per loaded model (the vocabulary's token trie, built once);
//! one `Constraint` per constrained sequence, which follows its tokens.
//!
//! llguidance's default JSON-schema options are used (separators `,` and `:`, any whitespace
//! between JSON tokens unless the schema's `x-guidance` says `whitespace_flexible: false`,
//! additional properties allowed unless the schema says `additionalProperties: false`), and its
//! default parser limits bound what a hostile grammar can cost: lexer fuel and Earley items per
//! mask, lexer states, grammar size.

use crate::error::{Error, Result};
use crate::tokenizer::{TokenBytes, Tokenizer};
use crate::tools::{ToolFormat, Tools};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// Text that a JSON schema validates (OpenAI's `response_format: json_schema`).
    JsonSchema(serde_json::Value),
    /// Any JSON object (OpenAI's `response_format: json_object`).
    JsonObject,
    /// Text the whole regex matches.
    Regex(String),
    /// Text of a Lark grammar (llguidance's dialect).
    Lark(String),
    /// Calls of the request's functions in the model's call format, each with arguments its
    /// parameter schema validates (`tools` with `tool_choice` "required" or a function).
    Tools(Arc<Tools>),
}

impl ConstraintSpec {
    fn grammar(&self, format: ToolFormat) -> TopLevelGrammar {
        match self {
            Self::Tools(tools) => TopLevelGrammar::from_lark(tools.grammar(format)),
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Self::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }

    /// The request field it came from, for errors.
    pub fn field(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) | Self::JsonObject => "response_format",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "grammar",
            Self::Tools(_) => "tool_choice",
        }
    }
}

/// The vocabulary as llguidance sees it: each token's bytes in a trie, specials marked, the
/// model's stop tokens as its end of sequence.
struct Vocabulary {
    trie: TokTrie,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy longest-match tokenization on the trie: llguidance uses it for the text a grammar
    /// forces, never for the masks.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// Compiles constraints for one model: its vocabulary's token trie and llguidance's factory.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
    /// How the model writes a tool call (its chat template's format).
    tool_format: ToolFormat,
}

impl Grammars {
    /// For a model of `vocab` output rows whose tokens `tokenizer` spells (rows past the
    /// tokenizer's tokens are never allowed; tokens past the rows are dropped), that writes tool
    /// calls in `tool_format`.
    pub fn new(tokenizer: &Tokenizer, vocab: usize, tool_format: ToolFormat) -> Result<Self> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Some(TokenBytes::Text(bytes)) => bytes,
                Some(TokenBytes::Special(name)) => special(&name),
                None => special(&format!("<[{id}]>")),
            })
            .collect();
        let eos = tokenizer.stop_ids.iter().copied().filter(|&id| (id as usize) < vocab).collect::<Vec<_>>();
        let first = *eos.first().ok_or_else(|| Error::Tokenizer("no end-of-sequence token".into()))?;
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, first), &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(Vocabulary { trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| Error::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory, vocab, tool_format })
    }

    /// The constraint's matcher at the start of the output, or the error naming what is wrong
    /// with it (a schema llguidance does not take, a grammar past the limits).
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint> {
        let bad = |e: String| Error::InvalidConstraint { field: spec.field(), reason: e };
        check_size(spec).map_err(bad)?;
        let matcher = Matcher::new(Ok(self.create_parser(spec.grammar(self.tool_format)).map_err(bad)?));
        if let Some(e) = matcher.get_error() {
            return Err(bad(e));
        }
        let words = self.vocab.div_ceil(32);
        Ok(Constraint { matcher, field: spec.field(), words, allowed: 0, timing: MaskTiming::default() })
    }
}

/// Nesting a schema, regex or grammar may have, and properties a schema's object may list:
/// llguidance compiles them recursively, and past a few thousand properties its recursion
/// overflows a 2 MiB stack (wasm has 1 MiB and no thread to move it to; natively the compiler
/// has a large stack of its own, `Grammars::create_parser`). Real schemas stay far below both.
pub const MAX_NESTING: usize = 64;
pub const MAX_PROPERTIES: usize = 1024;
/// Values (objects, arrays, strings, numbers...) in a schema.
pub const MAX_SCHEMA_VALUES: usize = 100_000;

/// Refuses what could exhaust the stack before llguidance sees it (its own limits bound the
/// rest: grammar size, lexer states, fuel per mask).
fn check_size(spec: &ConstraintSpec) -> std::result::Result<(), String> {
    match spec {
        ConstraintSpec::JsonObject => Ok(()),
        ConstraintSpec::Tools(tools) => tools.functions.iter().try_for_each(|f| {
            check_size(&ConstraintSpec::JsonSchema(f.parameters.clone())).map_err(|e| format!("{}: {e}", f.name))
        }),
        ConstraintSpec::Regex(text) | ConstraintSpec::Lark(text) => {
            // Brackets of every kind, quoted or not: a conservative bound on the parsers' depth.
            let mut depth = 0usize;
            for b in text.bytes() {
                match b {
                    b'(' | b'[' | b'{' => depth += 1,
                    b')' | b']' | b'}' => depth = depth.saturating_sub(1),
                    _ => continue,
                }
                if depth > MAX_NESTING {
                    return Err(format!("brackets nested more than {MAX_NESTING} deep"));
                }
            }
            Ok(())
        }
        ConstraintSpec::JsonSchema(schema) => {
            // Iteratively, so that the check itself cannot overflow.
            let mut stack = vec![(schema, 1usize)];
            let mut values = 0usize;
            while let Some((v, depth)) = stack.pop() {
                values += 1;
                if values > MAX_SCHEMA_VALUES {
                    return Err(format!("a schema of more than {MAX_SCHEMA_VALUES} values"));
                }
                if depth > MAX_NESTING {
                    return Err(format!("a schema nested more than {MAX_NESTING} deep"));
                }
                match v {
                    serde_json::Value::Object(map) => {
                        if let Some(n) = map.get("properties").and_then(|p| p.as_object()).map(|p| p.len()) {
                            if n > MAX_PROPERTIES {
                                return Err(format!("an object of {n} properties (at most {MAX_PROPERTIES})"));
                            }
                        }
                        stack.extend(map.values().map(|v| (v, depth + 1)));
                    }
                    serde_json::Value::Array(items) => stack.extend(items.iter().map(|v| (v, depth + 1))),
                    _ => {}
                }
            }
            Ok(())
        }
    }
}

impl Grammars {
    /// llguidance's parser for `grammar`. Its compiler recurses along chains of JSON-schema
    /// references and of Lark rules, which `check_size` cannot bound by nesting alone: natively
    /// it runs on a thread of its own with a large stack (reserved, committed only as used), so
    /// that no request can overflow the caller's. (In wasm, which has no threads, `check_size`'s
    /// bounds are the guard.)
    fn create_parser(&self, grammar: TopLevelGrammar) -> std::result::Result<llguidance::TokenParser, String> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            std::thread::scope(|scope| {
                let compile = || self.factory.create_parser(grammar).map_err(|e| e.to_string());
                std::thread::Builder::new()
                    .name("grammar-compiler".into())
                    .stack_size(COMPILER_STACK)
                    .spawn_scoped(scope, compile)
                    .map_err(|e| format!("no thread to compile it on: {e}"))?
                    .join()
                    .map_err(|_| "the grammar compiler failed".to_string())?
            })
        }
        #[cfg(target_arch = "wasm32")]
        {
            self.factory.create_parser(grammar).map_err(|e| e.to_string())
        }
    }
}

/// The grammar compiler's stack natively (`Grammars::create_parser`): chains of 10^5 references
/// or rules fit.
#[cfg(not(target_arch = "wasm32"))]
const COMPILER_STACK: usize = 512 << 20;

/// A special token's trie entry: llguidance's marker byte, then its name.
fn special(name: &str) -> Vec<u8> {
    let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    bytes.extend_from_slice(name.as_bytes());
    bytes
}

/// One sequence's constraint: the grammar's state after the tokens it has accepted.
pub struct Constraint {
    matcher: Matcher,
    field: &'static str,
    /// Words of a mask: one bit per token of the model's vocabulary.
    words: usize,
    /// Tokens the last mask allowed.
    allowed: usize,
    /// Masks computed, and their time.
    timing: MaskTiming,
}

/// The masks a constraint computed and their CPU time (`Stats::masks`: `bench --json-schema`
/// and the package's stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct MaskTiming {
    pub masks: usize,
    pub total_us: f64,
    pub max_us: f64,
}

impl MaskTiming {
    pub fn mean_us(&self) -> f64 {
        self.total_us / self.masks.max(1) as f64
    }
}

impl Clone for Constraint {
    /// An independent copy (its own parser state and lexer caches): another choice of the
    /// same request.
    fn clone(&self) -> Self {
        Self { matcher: self.matcher.deep_clone(), ..*self }
    }
}

impl Constraint {
    /// The tokens allowed next into `mask` (bit i % 32 of word i / 32 for token i; the stop
    /// tokens once the grammar is complete). A state that allows nothing, or a grammar the
    /// output can no longer satisfy, is an error naming the request's field.
    pub fn fill_mask(&mut self, mask: &mut Vec<u32>) -> Result<()> {
        let start = web_time::Instant::now();
        let vob = self.matcher.compute_mask_or_eos().map_err(|e| self.error(e.to_string()))?;
        let us = start.elapsed().as_secs_f64() * 1e6;
        self.timing = MaskTiming {
            masks: self.timing.masks + 1,
            total_us: self.timing.total_us + us,
            max_us: self.timing.max_us.max(us),
        };
        mask.clear();
        mask.extend(vob.as_slice().iter().copied().take(self.words));
        mask.resize(self.words, 0);
        self.allowed = mask.iter().map(|w| w.count_ones() as usize).sum();
        if self.allowed == 0 {
            return Err(self.error("no token can continue the output".into()));
        }
        Ok(())
    }

    /// Tokens the last mask allowed (the page's and the stats' count).
    pub fn allowed(&self) -> usize {
        self.allowed
    }

    /// The masks computed so far and their time.
    pub fn timing(&self) -> MaskTiming {
        self.timing
    }

    /// Moves the grammar past `token` (one the mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| self.error(e.to_string()))
    }

    /// The grammar is complete: only a stop token may follow.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn error(&self, reason: String) -> Error {
        Error::InvalidConstraint { field: self.field, reason }
    }
}

/// Sets every logit `mask` does not allow to -inf.
pub fn apply_mask(mask: &[u32], logits: &mut [f32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        if mask.get(i / 32).is_none_or(|w| w >> (i % 32) & 1 == 0) {
            *l = f32::NEG_INFINITY;
        }
    }
}
