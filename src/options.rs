//! A request's options as every entry point receives them: the server's JSON (OpenAI's field
//! names), the package's objects (the same names in camelCase, as aliases) and the CLI's flags.
//! Every default and every bound of a request is here, once; `resolve` checks them and makes
//! the engine's options, naming the field of whatever is wrong.

use crate::beam::{BeamOptions, EarlyStopping};
use crate::constraint::ConstraintSpec;
use crate::engine::GenerateOptions;
use crate::error::{Error, Result};
use crate::sampling::SamplingParams;
use crate::speculate::Speculation;
use crate::tools::Tools;
use serde::Deserialize;
use std::sync::Arc;

/// Tokens generated when a request does not say.
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// Tokens drafted per verifying pass when a speculative request does not say.
pub const DEFAULT_DRAFT_TOKENS: usize = 4;
/// Stop strings a request may give (OpenAI's bound), and the bytes of each: matching costs
/// grow with both at every token.
pub const MAX_STOPS: usize = 4;
pub const MAX_STOP_BYTES: usize = 1024;
/// Choices (`n`) a request may ask for.
pub const MAX_CHOICES: usize = 8;
/// Alternatives per token a request may ask for with its log-probabilities (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One stop string or several.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// What a request asks for; None is the default. A field it does not name is refused (serde's
/// "unknown field" error, which `openai::parse` turns into an error naming it).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestOptions {
    #[serde(alias = "maxTokens")]
    pub max_tokens: Option<usize>,
    /// OpenAI's newer name for `max_tokens` (chat), which it takes before `max_tokens`.
    #[serde(alias = "maxCompletionTokens")]
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    #[serde(alias = "topP")]
    pub top_p: Option<f32>,
    #[serde(alias = "topK")]
    pub top_k: Option<usize>,
    #[serde(alias = "minP")]
    pub min_p: Option<f32>,
    #[serde(alias = "repetitionPenalty")]
    pub repetition_penalty: Option<f32>,
    #[serde(alias = "presencePenalty")]
    pub presence_penalty: Option<f32>,
    #[serde(alias = "frequencyPenalty")]
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    /// OpenAI's `logit_bias`: token id (as a string) -> a bias in [-100, 100] added to its logit.
    #[serde(alias = "logitBias")]
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    #[serde(alias = "ignoreEos")]
    pub ignore_eos: bool,
    /// Choices sampled from the same prompt, each with seed + i.
    pub n: Option<usize>,
    /// Speculative decoding: "lookup", "layers:L" or "draft" (a loaded draft model).
    pub speculate: Option<String>,
    #[serde(alias = "draftTokens")]
    pub draft_tokens: Option<usize>,
    /// Beam search with this many beams (deterministic: the sampling fields do not apply).
    pub beams: Option<usize>,
    #[serde(alias = "lengthPenalty")]
    pub length_penalty: Option<f64>,
    /// true, false or "never" (transformers' `early_stopping`).
    #[serde(alias = "earlyStopping")]
    pub early_stopping: Option<serde_json::Value>,
    /// OpenAI's structured output: `{"type": "text"}` (none), `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
    #[serde(alias = "responseFormat")]
    pub response_format: Option<ResponseFormat>,
    /// Engine extension: the output is text the whole regex matches.
    pub regex: Option<String>,
    /// Engine extension: the output follows this Lark grammar (llguidance's dialect).
    pub grammar: Option<String>,
    /// OpenAI's function tools (chat): `[{"type": "function", "function": {"name",
    /// "description", "parameters"}}]`, rendered by the chat template (`crate::tools`).
    pub tools: Option<serde_json::Value>,
    /// "auto" (the default with tools), "none", "required" or `{"type": "function", "function":
    /// {"name"}}`: the last two hold the answer to calls (a constraint).
    #[serde(alias = "toolChoice")]
    pub tool_choice: Option<serde_json::Value>,
    /// Several calls in one answer (true unless told).
    #[serde(alias = "parallelToolCalls")]
    pub parallel_tool_calls: Option<bool>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema {
        #[serde(alias = "jsonSchema")]
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`. `strict` is accepted either way: the output always follows
/// the schema (llguidance's default options; OpenAI's strict mode refuses some schemas the
/// constraint takes).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    pub schema: Option<serde_json::Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// Bytes a regex or a grammar may have (a JSON schema is bounded by the body's size and
/// llguidance's grammar-size limit).
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;

/// A checked request: the engine's options, the choices to sample and, for beam search, its
/// options.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub generate: GenerateOptions,
    pub n: usize,
    pub beams: Option<BeamOptions>,
}

fn invalid(name: &'static str, value: impl std::fmt::Display, expected: impl Into<String>) -> Error {
    Error::InvalidOption { name, value: value.to_string(), expected: expected.into() }
}

/// The `grammar` field's constraint: Lark (llguidance's dialect), or llama.cpp's GBNF, told
/// apart by its `::=` and converted to Lark.
fn grammar_spec(text: &str) -> Result<ConstraintSpec> {
    if !crate::constraint::is_gbnf(text) {
        return Ok(ConstraintSpec::Lark(text.to_string()));
    }
    crate::constraint::gbnf_to_lark(text)
        .map(ConstraintSpec::Lark)
        .map_err(|e| Error::InvalidConstraint { field: "grammar", reason: format!("GBNF: {e}") })
}

impl RequestOptions {
    /// The request's tools, and the one constraint `response_format`, `regex`, `grammar` or a
    /// forced `tool_choice` asks for, if any.
    fn constraint(&self) -> Result<(Option<Arc<Tools>>, Option<ConstraintSpec>)> {
        let tools = Tools::from_request(self.tools.as_ref(), self.tool_choice.as_ref(), self.parallel_tool_calls)?
            .map(Arc::new);
        let forced = tools.clone().filter(|t| t.forced()).map(ConstraintSpec::Tools);
        let format = match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) => Some(ConstraintSpec::JsonObject),
            Some(ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
                // No schema: any JSON object.
                None => Some(ConstraintSpec::JsonObject),
                Some(schema) => Some(ConstraintSpec::JsonSchema(schema.clone())),
            },
        };
        let given = [format.is_some(), self.regex.is_some(), self.grammar.is_some(), forced.is_some()];
        if given.iter().filter(|&&g| g).count() > 1 {
            let name = if forced.is_some() { "tool_choice" } else { "response_format" };
            return Err(invalid(
                name,
                "with another constraint",
                "one of response_format, regex, grammar and a required tool_choice",
            ));
        }
        for (name, text) in [("regex", &self.regex), ("grammar", &self.grammar)] {
            if let Some(t) = text.as_ref().filter(|t| t.len() > MAX_GRAMMAR_BYTES) {
                return Err(invalid(name, format!("{} bytes", t.len()), format!("at most {MAX_GRAMMAR_BYTES} bytes")));
            }
        }
        let constraint = format
            .or(forced)
            .or_else(|| self.regex.clone().map(ConstraintSpec::Regex))
            .map(Ok)
            .or_else(|| self.grammar.as_deref().map(grammar_spec))
            .transpose()?;
        Ok((tools, constraint))
    }

    /// The request's options with their defaults (`SamplingParams::default()`'s sampler, 256
    /// tokens, `seed` when none is given), checked: an error names the field.
    pub fn resolve(&self, seed: u64) -> Result<Resolved> {
        self.resolve_over(SamplingParams { seed, ..SamplingParams::default() })
    }

    /// `resolve` with another base sampler (the CLI's `bench` is greedy unless told).
    pub fn resolve_over(&self, base: SamplingParams) -> Result<Resolved> {
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_p: self.top_p.unwrap_or(base.top_p),
            top_k: self.top_k.unwrap_or(base.top_k),
            min_p: self.min_p.unwrap_or(base.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(base.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(base.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(base.frequency_penalty),
            seed: self.seed.unwrap_or(base.seed),
            logit_bias: match &self.logit_bias {
                None => Vec::new(),
                Some(map) => map
                    .iter()
                    .map(|(k, &b)| {
                        k.parse::<u32>().map(|id| (id, b)).map_err(|_| invalid("logit_bias", k, "token ids as keys"))
                    })
                    .collect::<Result<_>>()?,
            },
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS {
            return Err(invalid(
                "stop",
                format!("{} strings", stop.len()),
                format!("at most {MAX_STOPS} stop strings"),
            ));
        }
        if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(invalid(
                "stop",
                format!("a string of {} bytes", long.len()),
                format!("a stop string of at most {MAX_STOP_BYTES} bytes"),
            ));
        }
        let max_tokens = self.max_completion_tokens.or(self.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS);
        let speculate = match &self.speculate {
            None => None,
            Some(s) => Some(Speculation {
                drafter: s.parse()?,
                draft_tokens: self.draft_tokens.unwrap_or(DEFAULT_DRAFT_TOKENS),
            }),
        };
        if self.draft_tokens.is_some() && speculate.is_none() {
            return Err(invalid("draft_tokens", self.draft_tokens.unwrap_or(0), "draft tokens only with speculate"));
        }
        let n = self.n.unwrap_or(1);
        if n == 0 || n > MAX_CHOICES {
            return Err(invalid("n", n, format!("from 1 to {MAX_CHOICES} choices")));
        }
        let (tools, constraint) = self.constraint()?;
        let generate = GenerateOptions {
            max_tokens,
            sampling,
            stop,
            ignore_eos: self.ignore_eos,
            top_candidates: 0,
            speculate,
            constraint,
            tools,
        };
        generate.validate()?;
        if generate.speculate.is_some() && n > 1 {
            return Err(invalid("n", n, "speculate runs one choice"));
        }
        let beam_fields = self.length_penalty.is_some() || self.early_stopping.is_some();
        let beams = match self.beams {
            None if beam_fields => {
                return Err(invalid("beams", "none", "beams with length_penalty or early_stopping"));
            }
            None => None,
            Some(beams) => {
                if n > 1 || generate.speculate.is_some() {
                    return Err(invalid(
                        "beams",
                        beams,
                        "no n or speculate with beams: they return the N best choices themselves",
                    ));
                }
                if let Some(c) = &generate.constraint {
                    return Err(invalid(c.field(), "given", "no constraint with beams (not supported yet)"));
                }
                if generate.tools.is_some() {
                    return Err(invalid("tools", "given", "no tools with beams (not supported yet)"));
                }
                if self.logit_bias.is_some() {
                    return Err(invalid(
                        "logit_bias",
                        "given",
                        "no logit_bias with beams (their search is deterministic)",
                    ));
                }
                // Beam search ends hypotheses on EOS or max_tokens; stop strings are not applied.
                if !generate.stop.is_empty() {
                    return Err(invalid(
                        "stop",
                        format!("{} strings", generate.stop.len()),
                        "no stop strings with beams (a beam search ends on EOS or max_tokens)",
                    ));
                }
                let early_stopping = match &self.early_stopping {
                    None | Some(serde_json::Value::Bool(false)) => EarlyStopping::Heuristic,
                    Some(serde_json::Value::Bool(true)) => EarlyStopping::Done,
                    Some(serde_json::Value::String(s)) if s == "never" => EarlyStopping::Never,
                    Some(v) => return Err(invalid("early_stopping", v, "true, false or \"never\"")),
                };
                let b = BeamOptions {
                    beams,
                    max_tokens,
                    stop_ids: Vec::new(),
                    length_penalty: self.length_penalty.unwrap_or(1.0),
                    early_stopping,
                };
                b.validate()?;
                Some(b)
            }
        };
        Ok(Resolved { generate, n, beams })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(json: &str) -> RequestOptions {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn defaults_are_the_engine_sampler_and_256_tokens() {
        let r = RequestOptions::default().resolve(9).unwrap();
        assert_eq!(r.generate.max_tokens, 256);
        assert_eq!(r.generate.sampling, SamplingParams { seed: 9, ..SamplingParams::default() });
        assert_eq!((r.n, r.beams.is_none(), r.generate.speculate.is_none()), (1, true, true));
    }

    #[test]
    fn snake_case_and_camel_case_name_the_same_fields() {
        let snake =
            from(r#"{"max_tokens": 7, "top_p": 0.5, "ignore_eos": true, "draft_tokens": 2, "speculate": "lookup"}"#);
        let camel =
            from(r#"{"maxTokens": 7, "topP": 0.5, "ignoreEos": true, "draftTokens": 2, "speculate": "lookup"}"#);
        assert_eq!(snake, camel);
        let r = snake.resolve(0).unwrap();
        assert_eq!((r.generate.max_tokens, r.generate.sampling.top_p, r.generate.ignore_eos), (7, 0.5, true));
        assert_eq!(r.generate.speculate.unwrap().draft_tokens, 2);
        assert_eq!(from(r#"{"max_tokens": 7, "max_completion_tokens": 9}"#).resolve(0).unwrap().generate.max_tokens, 9);
    }

    /// `grammar` takes Lark as it is and GBNF converted; a broken GBNF is the field's error.
    #[test]
    fn a_gbnf_grammar_becomes_lark() {
        let lark = |json: &str| match from(json).resolve(0).map(|r| r.generate.constraint) {
            Ok(Some(ConstraintSpec::Lark(text))) => text,
            other => panic!("{json}: {other:?}"),
        };
        assert_eq!(lark(r#"{"grammar": "start: \"a\""}"#), "start: \"a\"");
        assert_eq!(lark(r#"{"grammar": "root ::= \"a\""}"#), "start: r0_root\nr0_root: \"a\"\n");
        match from(r#"{"grammar": "root ::= b"}"#).resolve(0) {
            Err(Error::InvalidConstraint { field: "grammar", reason }) => {
                assert!(reason.contains("b is used"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_bound_names_its_field() {
        let field = |json: &str| match from(json).resolve(0) {
            Err(Error::InvalidOption { name, .. } | Error::InvalidSamplingParameter { name, .. }) => name,
            other => panic!("{json}: {other:?}"),
        };
        let long = format!(r#"{{"stop": ["{}"]}}"#, "x".repeat(1025));
        assert_eq!(field(&long), "stop");
        assert_eq!(field(r#"{"stop": ["a", "b", "c", "d", "e"]}"#), "stop");
        assert_eq!(field(r#"{"stop": ""}"#), "stop");
        assert_eq!(field(r#"{"n": 9}"#), "n");
        assert_eq!(field(r#"{"n": 0}"#), "n");
        assert_eq!(field(r#"{"max_tokens": 0}"#), "max_tokens");
        assert_eq!(field(r#"{"temperature": -1}"#), "temperature");
        assert_eq!(field(r#"{"speculate": "lookup", "n": 2}"#), "n");
        assert_eq!(field(r#"{"draft_tokens": 3}"#), "draft_tokens");
        assert_eq!(field(r#"{"beams": 2, "n": 2}"#), "beams");
        assert_eq!(field(r#"{"length_penalty": 2}"#), "beams");
        assert_eq!(field(r#"{"beams": 2, "early_stopping": "soon"}"#), "early_stopping");
        assert_eq!(field(r#"{"speculate": "nonsense"}"#), "speculate");
        assert_eq!(field(r#"{"beams": 2, "stop": "x"}"#), "stop");
        assert_eq!(field(r#"{"logit_bias": {"x": 1}}"#), "logit_bias");
        assert_eq!(field(r#"{"logit_bias": {"5": 101}}"#), "logit_bias");
        assert_eq!(field(r#"{"beams": 2, "logit_bias": {"5": 1}}"#), "logit_bias");
        assert_eq!(field(r#"{"beams": 2, "speculate": "lookup"}"#), "beams");
        let tools = r#""tools": [{"type": "function", "function": {"name": "f"}}]"#;
        assert_eq!(field(&format!(r#"{{"beams": 2, {tools}}}"#)), "tools");
        assert_eq!(field(r#"{"beams": 2, "length_penalty": 1e308}"#), "length penalty");
        assert_eq!(field(r#"{"beams": 2, "length_penalty": -51}"#), "length penalty");
        let four = from(r#"{"stop": ["a", "b", "c", "d"]}"#).resolve(0).unwrap();
        assert_eq!(four.generate.stop.len(), 4);
        let never = from(r#"{"beams": 3, "early_stopping": "never"}"#).resolve(0).unwrap();
        assert_eq!(never.beams.unwrap().early_stopping, EarlyStopping::Never);
    }
}
