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

/// Whether `grammar` is llama.cpp's GBNF (its rules are defined with `::=`) rather than Lark.
pub fn is_gbnf(grammar: &str) -> bool {
    grammar.lines().any(|l| l.split('#').next().is_some_and(|code| code.contains("::=")))
}

/// llama.cpp's GBNF (grammars/README.md there) as llguidance's Lark: `root` is the start, a
/// name becomes a rule of its own (Lark's rules are lowercase: `Foo` and `foo` stay apart), a
/// literal a string, a character class or `.` a one-character regex; groups, `|`, `*`, `+`,
/// `?` and `{m,n}` are the same in both. An error says what is wrong and where.
pub fn gbnf_to_lark(gbnf: &str) -> std::result::Result<String, String> {
    #[derive(PartialEq)]
    enum Tok {
        Name(String),
        Define,
        Text(String),
    }
    let chars: Vec<char> = gbnf.chars().collect();
    let line_of = |i: usize| chars[..i.min(chars.len())].iter().filter(|&&c| c == '\n').count() + 1;
    let mut toks = Vec::new();
    let mut i = 0;
    // The escape at chars[i] (after a backslash) as a char, and where it ends.
    let escape = |i: usize| -> std::result::Result<(char, usize), String> {
        let hex = |n: usize| -> std::result::Result<(char, usize), String> {
            let digits: String = chars.get(i + 1..i + 1 + n).ok_or("a short escape")?.iter().collect();
            let c = u32::from_str_radix(&digits, 16).ok().and_then(char::from_u32);
            c.map(|c| (c, i + 1 + n)).ok_or_else(|| format!("a bad escape \\{}{digits}", chars[i]))
        };
        match chars.get(i) {
            Some('n') => Ok(('\n', i + 1)),
            Some('t') => Ok(('\t', i + 1)),
            Some('r') => Ok(('\r', i + 1)),
            Some('x') => hex(2),
            Some('u') => hex(4),
            Some('U') => hex(8),
            Some(&c) => Ok((c, i + 1)),
            None => Err("an escape at the end".into()),
        }
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            c if c.is_whitespace() => i += 1,
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                toks.push(Tok::Define);
                i += 3;
            }
            '"' => {
                let (mut text, start) = (String::new(), i);
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return Err(format!("a string not closed (line {})", line_of(start))),
                        Some('"') => break,
                        Some('\\') => {
                            let (c, next) = escape(i + 1).map_err(|e| format!("{e} (line {})", line_of(i)))?;
                            text.push(c);
                            i = next;
                        }
                        Some(&c) => {
                            text.push(c);
                            i += 1;
                        }
                    }
                }
                i += 1;
                toks.push(Tok::Text(serde_json::Value::String(text).to_string()));
            }
            '[' => {
                let start = i;
                let mut class = String::from("[");
                i += 1;
                if chars.get(i) == Some(&'^') {
                    class.push('^');
                    i += 1;
                }
                loop {
                    let (c, raw) = match chars.get(i) {
                        None => return Err(format!("a character class not closed (line {})", line_of(start))),
                        Some(']') => break,
                        Some('\\') => {
                            let (c, next) = escape(i + 1).map_err(|e| format!("{e} (line {})", line_of(i)))?;
                            i = next;
                            (c, false)
                        }
                        Some(&c) => {
                            i += 1;
                            (c, true)
                        }
                    };
                    // A range's dash stays a range; every other character is written as its code.
                    let first = class == "[" || class == "[^";
                    if raw && c == '-' && !first && chars.get(i) != Some(&']') {
                        class.push('-');
                    } else {
                        class.push_str(&format!("\\x{{{:x}}}", c as u32));
                    }
                }
                i += 1;
                class.push(']');
                toks.push(Tok::Text(format!("/{class}/")));
            }
            '.' => {
                toks.push(Tok::Text("/(?s:.)/".into()));
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                toks.push(Tok::Text(c.to_string()));
                i += 1;
            }
            '{' => {
                let end = chars[i..].iter().position(|&c| c == '}').map(|p| i + p);
                let Some(end) = end else { return Err(format!("a repetition not closed (line {})", line_of(i))) };
                let inner: String = chars[i + 1..end].iter().filter(|c| !c.is_whitespace()).collect();
                if inner.is_empty() || !inner.chars().all(|c| c.is_ascii_digit() || c == ',') {
                    return Err(format!("a bad repetition {{{inner}}} (line {})", line_of(i)));
                }
                toks.push(Tok::Text(format!("{{{inner}}}")));
                i = end + 1;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while chars.get(i).is_some_and(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_') {
                    i += 1;
                }
                toks.push(Tok::Name(chars[start..i].iter().collect()));
            }
            c => return Err(format!("an unexpected {c:?} (line {})", line_of(i))),
        }
    }
    let mut names: Vec<String> = Vec::new();
    let mut rule = |name: &str| -> String {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
        rule_name(&names, name)
    };
    let mut lark = String::new();
    let mut defined = Vec::new();
    let mut k = 0;
    while k < toks.len() {
        let (Tok::Name(name), Some(Tok::Define)) = (&toks[k], toks.get(k + 1)) else {
            return Err("a rule must start with a name and ::=".into());
        };
        let head = rule(name);
        if defined.contains(&head) {
            return Err(format!("the rule {name} is defined twice"));
        }
        defined.push(head.clone());
        lark.push_str(&head);
        lark.push(':');
        k += 2;
        while k < toks.len() && !(matches!(toks[k], Tok::Name(_)) && toks.get(k + 1) == Some(&Tok::Define)) {
            let postfix =
                matches!(&toks[k], Tok::Text(t) if ["*", "+", "?"].contains(&t.as_str()) || t.starts_with('{'));
            if !postfix {
                lark.push(' ');
            }
            match &toks[k] {
                Tok::Name(n) => lark.push_str(&rule(n)),
                Tok::Text(t) => lark.push_str(t),
                Tok::Define => return Err("::= inside a rule".into()),
            }
            k += 1;
        }
        lark.push('\n');
    }
    let root = rule("root");
    if !defined.contains(&root) {
        return Err("no root rule (GBNF starts at `root ::= ...`)".into());
    }
    if let Some(missing) = names.iter().find(|n| !defined.contains(&rule_name(&names, n))) {
        return Err(format!("the rule {missing} is used but not defined"));
    }
    Ok(format!("start: {root}\n{lark}"))
}

/// `gbnf_to_lark`'s rule for the GBNF name `name` (numbered in `names`): r{index}_{lowercase
/// name}, distinct for names that differ only in case.
fn rule_name(names: &[String], name: &str) -> String {
    let k = names.iter().position(|n| n == name).expect("numbered");
    format!("r{k}_{}", name.to_lowercase().replace('-', "_"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GBNF's constructs in Lark, by hand; mistakes are errors that say where.
    #[test]
    fn gbnf_becomes_lark() {
        let gbnf = "# a greeting\nroot ::= greeting \" \" Name+ (\"!\" | \"?\"){1,2}\n\
                    greeting ::= \"hi\" |\n    \"h\\x65llo\\n\"\nName ::= [A-Z] [a-z\\-]* . [^\\]\"]?\nname ::= \"x\"\n";
        assert!(is_gbnf(gbnf) && !is_gbnf("start: \"a\" # not ::= here"));
        assert_eq!(
            gbnf_to_lark(gbnf).unwrap(),
            "start: r0_root\n\
             r0_root: r1_greeting \" \" r2_name+ ( \"!\" | \"?\" ){1,2}\n\
             r1_greeting: \"hi\" | \"hello\\n\"\n\
             r2_name: /[\\x{41}-\\x{5a}]/ /[\\x{61}-\\x{7a}\\x{2d}]/* /(?s:.)/ /[^\\x{5d}\\x{22}]/?\n\
             r3_name: \"x\"\n"
        );
        let err = |g: &str| gbnf_to_lark(g).unwrap_err();
        assert!(err("root ::= \"a").contains("not closed (line 1)"));
        assert!(err("root ::= a\n").contains("a is used but not defined"));
        assert!(err("a ::= \"x\"").contains("no root rule"));
        assert!(err("root ::= \"a\"\nroot ::= \"b\"").contains("defined twice"));
        assert!(err("root ::= [a-").contains("not closed"));
        assert!(err("root ::= \"a\" @").contains("unexpected '@' (line 1)"));
    }
}
