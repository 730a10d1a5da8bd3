//! OpenAI's chat completions and completions, written once for the server and the npm package
//! (which reaches it through wasm): a request's JSON into the engine's prompt and options
//! (`parse`), and the engine's token events into `chat.completion`, `chat.completion.chunk` and
//! `text_completion` bodies (`Answer`). Every field is OpenAI's or one of the engine's documented
//! extensions (`RequestOptions`); any other is refused by name, never ignored.

use crate::beam::BeamOptions;
use crate::chat::Message;
use crate::engine::{GenerateOptions, Prompt, Stats, StopReason, TokenEvent, TokenSpeculation};
use crate::options::{RequestOptions, Resolved, MAX_TOP_LOGPROBS};
use crate::tools::{parse_calls, ToolCall, ToolChoice, Tools, CALL_MARKERS};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/completions`: `prompt`.
    Completions,
}

/// What is wrong with a request.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestError {
    /// Not a JSON object, or a field of the wrong JSON type (the server's 422).
    Shape(String),
    /// A field's value, or a field the engine does not take (the server's 400 naming `param`).
    Invalid { param: String, message: String },
}

impl RequestError {
    fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError::Invalid { param: param.into(), message: message.into() }
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestError::Shape(m) => write!(f, "{m}"),
            RequestError::Invalid { param, message } => write!(f, "{param}: {message}"),
        }
    }
}

/// A parsed request: what the engine runs, and what shapes its answer.
#[derive(Debug, Clone)]
pub struct Request {
    pub endpoint: Endpoint,
    pub prompt: Prompt,
    /// The option fields as sent (the package hands them to its generation calls).
    pub option_fields: Map<String, Value>,
    /// Checked, with `top_candidates` set for `logprobs`.
    pub generate: GenerateOptions,
    pub n: usize,
    pub beams: Option<BeamOptions>,
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Alternatives per token in `logprobs`, when they are asked for.
    pub top_logprobs: Option<usize>,
}

/// Fields OpenAI defines that the engine does not honour yet, with why: refused by name.
const NOT_YET: &[(&str, &str)] = &[
    ("functions", "functions is OpenAI's deprecated form: give tools"),
    ("function_call", "function_call is OpenAI's deprecated form: give tool_choice"),
    ("echo", "echo is not supported (the prompt is not repeated in the answer)"),
    ("suffix", "suffix (fill in the middle) is not supported"),
    ("best_of", "best_of is not supported (use n, or beams for the most likely continuations)"),
    ("audio", "audio output is not supported"),
    ("modalities", "only text output is supported"),
    ("prediction", "predicted outputs are not supported (speculate: \"lookup\" drafts from the prompt)"),
    ("reasoning_effort", "reasoning_effort is not supported"),
    ("web_search_options", "web search is not supported"),
];

/// Fields both endpoints take beside the options, and the engine's own per endpoint.
const COMMON: &[&str] = &["model", "stream", "stream_options", "logprobs", "top_logprobs", "user"];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Map<String, Value>>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum CompletionPrompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

fn shape(what: &str, e: serde_json::Error) -> RequestError {
    RequestError::Shape(format!("{what}: {e}"))
}

/// Parses a request body for `endpoint`; `seed` is the seed of a request that gives none.
pub fn parse(endpoint: Endpoint, body: Value, seed: u64) -> Result<Request, RequestError> {
    let Value::Object(mut fields) = body else {
        return Err(RequestError::Shape("the request must be a JSON object".into()));
    };
    // null is "not given", as OpenAI's clients send it.
    fields.retain(|_, v| !v.is_null());
    let mut take = |name: &str| fields.remove(name);
    let prompt = match endpoint {
        Endpoint::Chat => {
            let messages =
                take("messages").ok_or_else(|| RequestError::invalid("messages", "messages are required"))?;
            Prompt::Chat(messages_of(messages)?)
        }
        Endpoint::Completions => {
            let prompt = take("prompt").ok_or_else(|| RequestError::invalid("prompt", "a prompt is required"))?;
            match serde_json::from_value(prompt).map_err(|e| shape("prompt", e))? {
                CompletionPrompt::Text(t) => Prompt::Text(t),
                CompletionPrompt::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
                CompletionPrompt::Texts(_) => {
                    return Err(RequestError::invalid(
                        "prompt",
                        "one prompt per request (send several requests: they batch)",
                    ))
                }
                CompletionPrompt::Tokens(ids) => Prompt::Tokens(ids),
            }
        }
    };
    let model = match take("model") {
        None => None,
        Some(Value::String(m)) => Some(m),
        Some(v) => return Err(RequestError::Shape(format!("model: a string, not {v}"))),
    };
    let stream = match take("stream") {
        None => false,
        Some(Value::Bool(b)) => b,
        Some(v) => return Err(RequestError::Shape(format!("stream: true or false, not {v}"))),
    };
    let include_usage = match take("stream_options") {
        None => false,
        Some(Value::Object(mut o)) => {
            o.retain(|_, v| !v.is_null());
            serde_json::from_value::<StreamOptions>(Value::Object(o))
                .map_err(|e| shape("stream_options", e))?
                .include_usage
        }
        Some(v) => return Err(RequestError::Shape(format!("stream_options: an object, not {v}"))),
    };
    let logprobs = take("logprobs");
    let top = match take("top_logprobs") {
        None => None,
        Some(v) => Some(serde_json::from_value::<usize>(v).map_err(|e| shape("top_logprobs", e))?),
    };
    // An end-user id (OpenAI's abuse monitoring); it changes nothing in the answer.
    if let Some(user) = take("user") {
        if !user.is_string() {
            return Err(RequestError::Shape(format!("user: a string, not {user}")));
        }
    }
    // Chat: `logprobs: true` with `top_logprobs: k`; completions: `logprobs: k`.
    let top_logprobs = match (logprobs, top) {
        (None | Some(Value::Bool(false)), None) => None,
        (None | Some(Value::Bool(false)), Some(_)) => {
            return Err(RequestError::invalid("top_logprobs", "top_logprobs needs logprobs: true"))
        }
        (Some(Value::Bool(true)), k) if endpoint == Endpoint::Chat => Some(k.unwrap_or(0)),
        (Some(Value::Number(n)), None) if endpoint == Endpoint::Completions => {
            Some(n.as_u64().map_or(usize::MAX, |n| n as usize))
        }
        (Some(v), _) => {
            let expected = match endpoint {
                Endpoint::Chat => "true or false (with top_logprobs: the alternatives per token)",
                Endpoint::Completions => "the alternatives per token (a count)",
            };
            return Err(RequestError::invalid("logprobs", format!("{v}: {expected}")));
        }
    };
    if top_logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        let param = if endpoint == Endpoint::Chat { "top_logprobs" } else { "logprobs" };
        return Err(RequestError::invalid(param, format!("at most {MAX_TOP_LOGPROBS} alternatives per token")));
    }
    if let Some((name, why)) = NOT_YET.iter().find(|(name, _)| fields.contains_key(*name)) {
        return Err(RequestError::invalid(*name, format!("{why}; leave {name} out")));
    }
    if endpoint == Endpoint::Completions {
        if let Some(name) =
            ["tools", "tool_choice", "parallel_tool_calls"].into_iter().find(|n| fields.contains_key(*n))
        {
            return Err(RequestError::invalid(name, "tools are for chat completions (/v1/chat/completions)"));
        }
    }
    // What is left is the options; a field they do not name is refused by name.
    let options: RequestOptions = serde_json::from_value(Value::Object(fields.clone())).map_err(|e| {
        let message = e.to_string();
        match message.strip_prefix("unknown field `").and_then(|m| m.split_once('`')) {
            Some((field, _)) => RequestError::invalid(
                field,
                format!(
                    "unknown field {field}: the fields are OpenAI's ({}) and the engine's options",
                    COMMON.join(", ")
                ),
            ),
            None => shape("options", e),
        }
    })?;
    let Resolved { generate, n, beams } = resolve(&options, seed, top_logprobs)?;
    Ok(Request {
        endpoint,
        prompt,
        option_fields: fields,
        generate,
        n,
        beams,
        model,
        stream,
        include_usage,
        top_logprobs,
    })
}

/// The options checked, with the candidates `logprobs` needs.
fn resolve(options: &RequestOptions, seed: u64, top_logprobs: Option<usize>) -> Result<Resolved, RequestError> {
    let engine_error = |e: crate::Error| match e {
        crate::Error::InvalidOption { name, .. } | crate::Error::InvalidSamplingParameter { name, .. } => {
            RequestError::invalid(name, e.to_string())
        }
        e => RequestError::invalid("options", e.to_string()),
    };
    let mut r = options.resolve(seed).map_err(engine_error)?;
    if r.beams.is_some() && top_logprobs.is_some() {
        return Err(RequestError::invalid(
            "beams",
            "beams return the N best choices themselves: no logprobs with them",
        ));
    }
    // The candidates carry the alternatives; one at least, so the token's own logprob comes too.
    r.generate.top_candidates = top_logprobs.map_or(0, |k| k.max(1));
    r.generate.validate().map_err(engine_error)?;
    Ok(r)
}

/// Chat messages: `{role, content}` with content a string or text parts. Roles are checked
/// by the chat template.
fn messages_of(messages: Value) -> Result<Vec<Message>, RequestError> {
    let Value::Array(list) = messages else {
        return Err(RequestError::Shape("messages: an array of {role, content}".into()));
    };
    if list.is_empty() {
        return Err(RequestError::invalid("messages", "at least one message is needed"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.into_iter().enumerate() {
        let Value::Object(mut m) = m else {
            return Err(RequestError::Shape(format!("messages[{i}]: an object {{role, content}}")));
        };
        // null is "not given" here too (clients send back messages with `tool_calls: null`).
        m.retain(|_, v| !v.is_null());
        let role = match m.remove("role") {
            Some(Value::String(r)) => r,
            _ => return Err(RequestError::Shape(format!("messages[{i}].role: a string"))),
        };
        let content = match m.remove("content").filter(|c| !c.is_null()) {
            None => String::new(),
            Some(c) => match serde_json::from_value(c).map_err(|e| shape(&format!("messages[{i}].content"), e))? {
                Content::Text(t) => t,
                Content::Parts(parts) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(RequestError::invalid(
                                    format!("messages[{i}].content"),
                                    format!(
                                        "content parts of type '{}' are not supported (text only)",
                                        kind.unwrap_or("?")
                                    ),
                                ))
                            }
                        }
                    }
                    text
                }
            },
        };
        // `name` is OpenAI's participant name.
        m.remove("name");
        let mut message = Message::new(role, content);
        if let Some(calls) = m.remove("tool_calls") {
            message.tool_calls =
                template_calls(calls).map_err(|e| RequestError::invalid(format!("messages[{i}].tool_calls"), e))?;
        }
        match m.remove("tool_call_id") {
            None => {}
            Some(Value::String(id)) => message.tool_call_id = Some(id),
            Some(v) => return Err(RequestError::Shape(format!("messages[{i}].tool_call_id: a string, not {v}"))),
        }
        if let Some(field) = m.keys().next() {
            return Err(RequestError::invalid(
                format!("messages[{i}].{field}"),
                "not supported (a message is {role, content, name, tool_calls, tool_call_id})",
            ));
        }
        out.push(message);
    }
    Ok(out)
}

/// An assistant message's `tool_calls` (OpenAI's, arguments as JSON text) as templates take
/// them: the arguments an object (Hugging Face's shape).
fn template_calls(calls: Value) -> Result<Vec<Value>, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Call {
        id: Option<String>,
        #[serde(rename = "type")]
        kind: Option<String>,
        function: CallFunction,
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct CallFunction {
        name: String,
        arguments: Value,
    }
    let calls: Vec<Call> = serde_json::from_value(calls)
        .map_err(|e| format!("a list of {{id, type, function: {{name, arguments}}}}: {e}"))?;
    calls
        .into_iter()
        .map(|c| {
            if c.kind.as_deref().is_some_and(|k| k != "function") {
                return Err("calls of type \"function\"".to_string());
            }
            let arguments = match c.function.arguments {
                Value::String(text) => serde_json::from_str(&text)
                    .map_err(|e| format!("{}'s arguments are not JSON ({e})", c.function.name))?,
                v => v,
            };
            Ok(json!({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}}))
        })
        .collect()
}

/// A token's log-probability and the most likely alternatives (`logprobs` requests).
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32, bool)>,
}

impl Logprobs {
    /// What a token event says of its log-probability (None unless it was asked for).
    pub fn of(ev: &TokenEvent) -> Option<Self> {
        ev.logprob.as_ref().map(|lp| Logprobs {
            token: lp.token.clone(),
            logprob: lp.logprob,
            top: ev.candidates.iter().map(|c| (c.text.clone(), c.prob.ln(), c.kept)).collect(),
        })
    }
}

/// Whether a token event makes a stream chunk: text, or what a client asked to see of it.
pub fn worth_a_chunk(ev: &TokenEvent) -> bool {
    !ev.text.is_empty() || ev.logprob.is_some() || ev.speculation.is_some()
}

/// Bytes of `text` a stream may send while the answer may be calls: up to where a call may
/// begin (the text opening with `{` or `[`, a call marker, or a tail that may be the start of
/// one).
fn streamable(text: &str) -> usize {
    let t = text.trim_start();
    if t.is_empty() || t.starts_with('{') || t.starts_with('[') {
        return 0;
    }
    if let Some(i) = CALL_MARKERS.iter().filter_map(|m| text.find(m)).min() {
        return i;
    }
    let partial = |m: &str| (1..m.len()).rev().find(|&k| text.ends_with(&m[..k])).unwrap_or(0);
    text.len() - CALL_MARKERS.iter().map(|m| partial(m)).max().unwrap_or(0)
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(stats: &Stats) -> &'static str {
    match stats.stop_reason {
        StopReason::MaxTokens => "length",
        StopReason::Eos | StopReason::StopString | StopReason::Aborted => "stop",
    }
}

/// The answer to one request: its envelope, and each choice's progress (streamed chunks, or
/// the text and log-probabilities of a whole answer).
pub struct Answer {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_tokens: usize,
    pub include_usage: bool,
    top_logprobs: usize,
    choices: Vec<Choice>,
    completion_tokens: usize,
    /// The request's tools when the answer may be calls (a chat with `tool_choice` not "none"):
    /// streamed text that may be a call is held back until the choice ends.
    tools: Option<Arc<Tools>>,
}

#[derive(Default, Clone)]
struct Choice {
    started: bool,
    /// The whole text (a stream's too, when the answer may be calls).
    text: String,
    /// Bytes of `text` a stream has sent as content (the answer may be calls).
    streamed: usize,
    /// Bytes of its text so far (completions' `text_offset`).
    offset: usize,
    logprobs: Vec<Logprobs>,
    logprobs_asked: bool,
    finish: Option<String>,
}

impl Answer {
    /// `n` choices of `request`, `number` making its id unique.
    pub fn new(request: &Request, model: &str, number: u64, created: u64, prompt_tokens: usize) -> Self {
        let prefix = match request.endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        let choice = Choice { logprobs_asked: request.top_logprobs.is_some(), ..Choice::default() };
        Answer {
            endpoint: request.endpoint,
            id: format!("{prefix}-{number:016x}"),
            created,
            model: model.to_string(),
            prompt_tokens,
            include_usage: request.include_usage,
            top_logprobs: request.top_logprobs.unwrap_or(0),
            choices: vec![choice; request.n],
            completion_tokens: 0,
            tools: request.generate.tools.clone().filter(|t| t.choice != ToolChoice::None),
        }
    }

    /// Choice `index`'s calls, when its text (from byte `from`) holds calls of the request's
    /// functions: the text outside them, and the calls.
    fn calls(&self, index: usize, from: usize) -> Option<(String, Vec<ToolCall>)> {
        let tools = self.tools.as_ref()?;
        let prefix = format!("call_{}_{index}_", self.id.rsplit('-').next().unwrap_or_default());
        parse_calls(&self.choices[index].text[from..], tools, &prefix)
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn envelope(&self, stream: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// A choice of a stream chunk: a chat `delta` or a completion's `text`.
    fn chunk_choice(&self, index: usize, text: Option<&str>, first: bool, finish: Option<&str>, lp: Value) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let mut delta = Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({ "index": index, "delta": delta, "logprobs": lp, "finish_reason": finish })
            }
            Endpoint::Completions => {
                json!({ "index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish })
            }
        }
    }

    /// `logprobs` of tokens in OpenAI's shape: chat's `{content: [{token, logprob, bytes,
    /// top_logprobs}]}` (each alternative also says whether top-k/top-p/min-p `kept` it, the
    /// engine's extension), or completions' `{tokens, token_logprobs, top_logprobs,
    /// text_offset}` (offsets into the choice's text, from `offset`).
    fn logprobs(&self, tokens: &[Logprobs], mut offset: usize) -> Value {
        let k = self.top_logprobs;
        match self.endpoint {
            Endpoint::Chat => {
                let entry = |t: &str, l: f32| json!({ "token": t, "logprob": l, "bytes": t.as_bytes() });
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|lp| {
                        let mut e = entry(&lp.token, lp.logprob);
                        e["top_logprobs"] = lp
                            .top
                            .iter()
                            .take(k)
                            .map(|(t, l, kept)| {
                                let mut alt = entry(t, *l);
                                alt["kept"] = json!(kept);
                                alt
                            })
                            .collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
            Endpoint::Completions => {
                let mut text_offset = Vec::with_capacity(tokens.len());
                for lp in tokens {
                    text_offset.push(offset);
                    offset += lp.token.len();
                }
                json!({
                    "tokens": tokens.iter().map(|lp| lp.token.as_str()).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
                    "top_logprobs": tokens.iter().map(|lp| {
                        lp.top.iter().take(k).map(|(t, l, _)| (t.clone(), json!(l))).collect::<Map<_, _>>()
                    }).collect::<Vec<_>>(),
                    "text_offset": text_offset,
                })
            }
        }
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }

    /// The stream chunk of a token of choice `index` (its text, its log-probabilities when
    /// asked for, and the engine's extensions: `position`, tokens in the KV cache once it is
    /// fed back, `speculation` with speculative decoding, `allowed` with a constraint: tokens
    /// its mask allowed at this step). None when it sends nothing: text held back while it may
    /// be a tool call.
    pub fn token_chunk(
        &mut self,
        index: usize,
        text: &str,
        logprobs: Option<&Logprobs>,
        position: usize,
        speculation: Option<&TokenSpeculation>,
        allowed: Option<u32>,
    ) -> Option<Value> {
        let holding = self.tools.is_some();
        let c = &mut self.choices[index];
        // Text that may be a call waits for the end of the choice (`finish_chunks`).
        let text = if holding {
            c.text.push_str(text);
            let end = streamable(&c.text).max(c.streamed);
            let sent = &c.text[std::mem::replace(&mut c.streamed, end)..end];
            if sent.is_empty() && logprobs.is_none() {
                return None;
            }
            sent.to_string()
        } else {
            text.to_string()
        };
        let first = !std::mem::replace(&mut c.started, true);
        let offset = c.offset;
        if let Some(lp) = logprobs {
            c.offset += lp.token.len();
        }
        let lp = logprobs.map_or(Value::Null, |lp| self.logprobs(std::slice::from_ref(lp), offset));
        let choice = self.chunk_choice(index, Some(&text), first, None, lp);
        let mut chunk = self.envelope(true, vec![choice]);
        chunk["position"] = json!(position);
        if let Some(s) = speculation {
            chunk["speculation"] = json!(s);
        }
        if let Some(n) = allowed {
            chunk["allowed"] = json!(n);
        }
        Some(chunk)
    }

    /// The stream chunks when choice `index` ends (`finish_reason`, tokens generated): its
    /// `finish_reason`, then, when it was the last choice and `stream_options.include_usage`
    /// asked for it, the usage chunk.
    pub fn finish_chunks(&mut self, index: usize, reason: &str, generated: usize) -> Vec<Value> {
        self.completion_tokens += generated;
        let mut out = Vec::new();
        let mut reason = reason;
        if self.tools.is_some() {
            // What was held back: calls (their text apart), or text after all.
            let from = self.choices[index].streamed;
            let (rest, calls) = match self.calls(index, from) {
                Some((content, calls)) => (content, calls),
                None => (self.choices[index].text[from..].to_string(), Vec::new()),
            };
            let c = &mut self.choices[index];
            c.streamed = c.text.len();
            let first = !std::mem::replace(&mut c.started, true);
            if !rest.is_empty() || first {
                out.push(self.envelope(true, vec![self.chunk_choice(index, Some(&rest), first, None, Value::Null)]));
            }
            if !calls.is_empty() {
                let deltas: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, call)| {
                        let mut d = call.openai();
                        d["index"] = json!(i);
                        d
                    })
                    .collect();
                let choice = json!({ "index": index, "delta": { "tool_calls": deltas }, "logprobs": null, "finish_reason": null });
                out.push(self.envelope(true, vec![choice]));
                reason = "tool_calls";
            }
        }
        let c = &mut self.choices[index];
        c.finish = Some(reason.to_string());
        let first = !std::mem::replace(&mut c.started, true);
        let text = (first && self.endpoint == Endpoint::Chat).then_some("");
        out.push(self.envelope(true, vec![self.chunk_choice(index, text, first, Some(reason), Value::Null)]));
        if self.include_usage && self.choices.iter().all(|c| c.finish.is_some()) {
            let mut usage = self.envelope(true, Vec::new());
            usage["usage"] = self.usage();
            out.push(usage);
        }
        out
    }

    /// Adds a token to choice `index` of a whole answer.
    pub fn push(&mut self, index: usize, text: &str, logprobs: Option<Logprobs>) {
        let c = &mut self.choices[index];
        c.text.push_str(text);
        c.logprobs.extend(logprobs);
    }

    /// Choice `index` of a whole answer ended (`finish_reason`, tokens generated).
    pub fn finish(&mut self, index: usize, reason: &str, generated: usize) {
        self.completion_tokens += generated;
        self.choices[index].finish = Some(reason.to_string());
    }

    /// Whether every choice has ended.
    pub fn done(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// The whole answer (`chat.completion` or `text_completion`) with its usage.
    pub fn completion(&self) -> Value {
        let choices = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let lp = if c.logprobs_asked { self.logprobs(&c.logprobs, 0) } else { Value::Null };
                match (self.endpoint, self.calls(index, 0)) {
                    (Endpoint::Chat, Some((content, calls))) => json!({
                        "index": index,
                        "message": {
                            "role": "assistant",
                            "content": (!content.is_empty()).then_some(content),
                            "tool_calls": calls.iter().map(ToolCall::openai).collect::<Vec<_>>(),
                        },
                        "logprobs": lp,
                        "finish_reason": "tool_calls",
                    }),
                    (Endpoint::Chat, None) => json!({
                        "index": index,
                        "message": { "role": "assistant", "content": c.text },
                        "logprobs": lp,
                        "finish_reason": c.finish,
                    }),
                    (Endpoint::Completions, _) => {
                        json!({ "index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish })
                    }
                }
            })
            .collect();
        let mut body = self.envelope(false, choices);
        body["usage"] = self.usage();
        body
    }

    /// A beam search's answer (its N best continuations as the choices, each with its `ids`
    /// and `score`, the engine's extension; `stopped`: it ended on a stop token, so its
    /// `finish_reason` is "stop", else "length"): the whole body, or its stream chunks.
    pub fn beams(&mut self, beams: &[(Vec<u32>, String, f64, bool)], stream: bool) -> Vec<Value> {
        self.completion_tokens = beams.iter().map(|b| b.0.len()).sum();
        let choice = |index: usize, (ids, text, score, stopped): &(Vec<u32>, String, f64, bool)| {
            let finish = if *stopped { "stop" } else { "length" };
            let mut c = match (self.endpoint, stream) {
                (_, true) => self.chunk_choice(index, Some(text), true, Some(finish), Value::Null),
                (Endpoint::Chat, false) => json!({
                    "index": index,
                    "message": { "role": "assistant", "content": text },
                    "logprobs": null,
                    "finish_reason": finish,
                }),
                (Endpoint::Completions, false) => {
                    json!({ "index": index, "text": text, "logprobs": null, "finish_reason": finish })
                }
            };
            c["score"] = json!(score);
            c["ids"] = json!(ids);
            c
        };
        if stream {
            return beams.iter().enumerate().map(|(i, b)| self.envelope(true, vec![choice(i, b)])).collect();
        }
        let mut body = self.envelope(false, beams.iter().enumerate().map(|(i, b)| choice(i, b)).collect());
        body["usage"] = self.usage();
        vec![body]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<Request, RequestError> {
        parse(Endpoint::Chat, body, 0)
    }

    fn param(r: Result<Request, RequestError>) -> String {
        match r {
            Err(RequestError::Invalid { param, .. }) => param,
            Err(e) => panic!("not a field error: {e:?}"),
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn a_chat_request_becomes_the_engines_prompt_and_options() {
        let r = chat(json!({
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 5, "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
            "logprobs": true, "top_logprobs": 3, "user": "u1",
        }))
        .unwrap();
        assert!(matches!(&r.prompt, Prompt::Chat(m) if m.len() == 1 && m[0].content == "Hi"));
        assert_eq!((r.generate.max_tokens, r.generate.top_candidates, r.n), (5, 3, 1));
        assert_eq!((r.stream, r.include_usage, r.top_logprobs, r.model.as_deref()), (true, true, Some(3), Some("m")));
        let c = parse(Endpoint::Completions, json!({"prompt": ["a"], "logprobs": 2}), 0).unwrap();
        assert!(matches!(c.prompt, Prompt::Text(ref t) if t == "a"));
        assert_eq!(c.top_logprobs, Some(2));
    }

    #[test]
    fn response_format_regex_and_grammar_become_the_one_constraint() {
        use crate::constraint::ConstraintSpec;
        let m = json!([{"role": "user", "content": "x"}]);
        let request = |extra: Value| {
            let mut body = json!({"messages": m});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            chat(body)
        };
        let constraint = |extra: Value| request(extra).map(|r| r.generate.constraint);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        assert_eq!(constraint(json!({"response_format": format})).unwrap(), Some(ConstraintSpec::JsonSchema(schema)));
        let object = json!({"response_format": {"type": "json_object"}});
        assert_eq!(constraint(object).unwrap(), Some(ConstraintSpec::JsonObject));
        assert_eq!(constraint(json!({"response_format": {"type": "text"}})).unwrap(), None);
        assert_eq!(constraint(json!({"regex": "a+"})).unwrap(), Some(ConstraintSpec::Regex("a+".into())));
        assert_eq!(
            constraint(json!({"grammar": "start: \"a\""})).unwrap(),
            Some(ConstraintSpec::Lark("start: \"a\"".into()))
        );
        // Two at once, an unknown type, a field OpenAI's shape does not have: refused.
        assert_eq!(param(request(json!({"regex": "a", "grammar": "start: \"a\""}))), "response_format");
        assert!(matches!(constraint(json!({"response_format": {"type": "xml"}})), Err(RequestError::Shape(_))));
        let extra =
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "frob": 1}}});
        assert_eq!(param(request(extra)), "frob");
        // Not with beams or speculation (not yet).
        assert_eq!(param(request(json!({"regex": "a", "beams": 2}))), "regex");
        assert_eq!(param(request(json!({"regex": "a", "speculate": "lookup"}))), "speculate");
        // Past a complete grammar only the end of sequence may follow.
        assert_eq!(param(request(json!({"regex": "a", "ignore_eos": true}))), "ignore_eos");
    }

    #[test]
    fn tools_become_the_prompts_functions_and_a_forced_call_the_constraint() {
        use crate::constraint::ConstraintSpec;
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let history = json!([
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"}]);
        let r = chat(json!({"messages": history, "tools": tools, "tool_choice": "required"})).unwrap();
        let t = r.generate.tools.clone().unwrap();
        assert_eq!((t.functions[0].name.as_str(), &t.choice, t.parallel), ("f", &ToolChoice::Required, true));
        assert_eq!(r.generate.constraint, Some(ConstraintSpec::Tools(t)));
        let Prompt::Chat(m) = &r.prompt else { panic!() };
        // The arguments as an object, as templates take them.
        assert_eq!(m[1].tool_calls[0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        let auto = chat(json!({"messages": history, "tools": tools})).unwrap();
        assert_eq!((auto.generate.constraint, auto.generate.tools.unwrap().choice.clone()), (None, ToolChoice::Auto));
        let with = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            param(chat(body))
        };
        assert_eq!(with(json!({"tool_choice": "required", "regex": "a"})), "tool_choice");
        assert_eq!(with(json!({"tool_choice": "required", "ignore_eos": true})), "ignore_eos");
        let bad_args = json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]);
        assert_eq!(with(json!({"messages": bad_args})), "messages[0].tool_calls");
        let c = parse(Endpoint::Completions, json!({"prompt": "x", "tools": tools}), 0);
        assert_eq!(param(c), "tools");
    }

    #[test]
    fn a_stream_holds_back_what_may_be_a_call_and_sends_it_as_tool_calls() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let body = |choice: &str| json!({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice});
        let request = chat(body("auto")).unwrap();
        let mut a = Answer::new(&request, "m", 1, 0, 3);
        let mut sent = String::new();
        for piece in
            ["Let me", " check. <", "tool_", "call>\n{\"name\": \"f\",", " \"arguments\": {\"q\": 2}}\n</tool_call>"]
        {
            if let Some(c) = a.token_chunk(0, piece, None, 0, None, None) {
                sent += c["choices"][0]["delta"]["content"].as_str().unwrap();
            }
        }
        assert_eq!(sent, "Let me check. ", "text up to where a call may begin");
        let end = a.finish_chunks(0, "stop", 9);
        let calls = &end[0]["choices"][0]["delta"]["tool_calls"];
        assert_eq!(calls[0]["function"], json!({"name": "f", "arguments": "{\"q\":2}"}));
        assert_eq!((calls[0]["index"].clone(), calls[0]["type"].clone()), (json!(0), json!("function")));
        assert_eq!(end.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
        // Text that only looked like a call comes out at the end; a whole answer has no calls.
        let mut b = Answer::new(&request, "m", 2, 0, 3);
        assert!(b.token_chunk(0, "{not a call", None, 0, None, None).is_none());
        let end = b.finish_chunks(0, "length", 3);
        assert_eq!(end[0]["choices"][0]["delta"]["content"], "{not a call");
        assert_eq!(end.last().unwrap()["choices"][0]["finish_reason"], "length");
        let mut w = Answer::new(&request, "m", 4, 0, 3);
        w.push(0, "{not a call", None);
        w.finish(0, "length", 3);
        assert_eq!(w.completion()["choices"][0]["message"]["content"], "{not a call");
        assert_eq!(w.completion()["choices"][0]["finish_reason"], "length");
        // tool_choice none: text streams as it comes.
        let mut n = Answer::new(&chat(body("none")).unwrap(), "m", 3, 0, 3);
        assert!(n.token_chunk(0, "{", None, 0, None, None).is_some());
    }

    #[test]
    fn fields_the_engine_does_not_take_are_refused_by_name() {
        let m = json!([{"role": "user", "content": "x"}]);
        for field in ["tools", "tool_choice", "echo", "suffix", "best_of", "frobnicate"] {
            let mut body = json!({"messages": m, field: 1});
            assert_eq!(param(chat(body.clone())), field);
            body["messages"] = json!([{"role": "user", "content": "x", "audio": {}}]);
            body.as_object_mut().unwrap().remove(field);
            assert_eq!(param(chat(body)), "messages[0].audio");
        }
        assert_eq!(param(chat(json!({"messages": m, "top_logprobs": 2}))), "top_logprobs");
        assert_eq!(param(chat(json!({"messages": m, "logprobs": true, "top_logprobs": 21}))), "top_logprobs");
        assert_eq!(param(chat(json!({"messages": m, "logprobs": 2}))), "logprobs");
        assert_eq!(param(chat(json!({"messages": m, "max_tokens": 0}))), "max_tokens");
        assert_eq!(param(chat(json!({"messages": []}))), "messages");
        assert_eq!(param(chat(json!({}))), "messages");
        assert!(matches!(chat(json!({"messages": m, "stream": "yes"})), Err(RequestError::Shape(_))));
        assert!(matches!(chat(json!([1])), Err(RequestError::Shape(_))));
        // null is "not given", as OpenAI's clients send it.
        assert!(
            chat(json!({"messages": m, "stream": null, "tools": null, "logit_bias": null})).is_ok_and(|r| !r.stream)
        );
        let back = json!([{"role": "assistant", "content": "x", "tool_calls": null, "refusal": null}]);
        assert!(chat(json!({"messages": back, "stream_options": {"include_usage": null}})).is_ok());
    }
}
