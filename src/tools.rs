//! Tool calls (OpenAI's `tools` and `tool_choice`): the functions a request offers, how the
//! model's chat format writes a call (`ToolFormat`, from its template), the Lark grammar that
//! holds a `required` or named call to that format and to each function's parameter schema, and
//! the calls found again in the text the model wrote (`parse_calls`), for `message.tool_calls`.
//!
//! Templates that render tools themselves (Qwen 2.5/3, Hermes, SmolLM3, Llama 3.1+, Mistral...)
//! get them as Hugging Face's `apply_chat_template` passes them: a `tools` list of OpenAI's
//! `{"type": "function", "function": {...}}`, assistant messages with `tool_calls` whose
//! arguments are objects, `tool` messages with their `tool_call_id`. A template that does not (the
//! built-in ones, SmolLM2's, Gemma 3's, Llama 3.0's) gets its family's words as text (`as_text`):
//! Llama 3's turns what Llama 3.1's template writes (the functions in the first user message,
//! calls as `{"name", "parameters"}` objects, results in `ipython` turns); every other what Qwen
//! 2.5's template writes (the functions in the system prompt, calls as `<tool_call>` blocks in the
//! assistant's text, results as `<tool_response>` blocks in a user turn).

use crate::chat::Message;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Functions a request may offer (OpenAI's bound).
pub const MAX_TOOLS: usize = 128;

/// A function the model may call: OpenAI's `tools[i].function`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Function {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of the arguments object (none: an object of any properties).
    #[serde(default = "any_object")]
    pub parameters: Value,
    /// OpenAI's strict mode: accepted either way (a constrained call always follows the schema).
    #[serde(default, skip_serializing)]
    pub strict: Option<bool>,
}

fn any_object() -> Value {
    json!({"type": "object", "properties": {}})
}

/// OpenAI's `tools[i]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolEntry {
    #[serde(rename = "type")]
    kind: String,
    function: Function,
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides: a call in its format becomes `tool_calls`, other text `content`.
    Auto,
    /// No call: the answer is text (the tools are still in the prompt, as OpenAI has it).
    None,
    /// One call or more (one with `parallel_tool_calls: false`), held to the format and schemas.
    Required,
    /// A call of this function.
    Function(String),
}

/// A request's tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    /// Several calls in one answer (OpenAI's `parallel_tool_calls`, true unless told).
    pub parallel: bool,
}

fn invalid(name: &'static str, value: impl std::fmt::Display, expected: impl Into<String>) -> Error {
    Error::InvalidOption { name, value: value.to_string(), expected: expected.into() }
}

impl Tools {
    /// `tools`, `tool_choice` and `parallel_tool_calls` as a request gives them (JSON), checked:
    /// an error names the field. None when no tools are given (and no choice needs them).
    pub fn from_request(tools: Option<&Value>, choice: Option<&Value>, parallel: Option<bool>) -> Result<Option<Self>> {
        // As OpenAI has it: a choice among no tools is refused, not ignored.
        let Some(tools) = tools else {
            return match (choice, parallel) {
                (None, None) => Ok(None),
                (Some(c), _) => Err(invalid("tool_choice", c, "tools to choose from: tool_choice only with tools")),
                (None, Some(_)) => Err(invalid("parallel_tool_calls", "given", "only with tools")),
            };
        };
        let entries: Vec<ToolEntry> = serde_json::from_value(tools.clone()).map_err(|e| {
            invalid("tools", e, "a list of {\"type\": \"function\", \"function\": {name, description, parameters}}")
        })?;
        if entries.is_empty() || entries.len() > MAX_TOOLS {
            return Err(invalid("tools", format!("{} tools", entries.len()), format!("from 1 to {MAX_TOOLS} tools")));
        }
        let mut functions = Vec::with_capacity(entries.len());
        for e in entries {
            if e.kind != "function" {
                return Err(invalid("tools", format!("a tool of type {:?}", e.kind), "tools of type \"function\""));
            }
            let f = e.function;
            let good = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
            if f.name.is_empty() || f.name.len() > 64 || !f.name.chars().all(good) {
                return Err(invalid(
                    "tools",
                    format!("a function named {:?}", f.name.chars().take(80).collect::<String>()),
                    "function names of 1 to 64 letters, digits, _ and - (OpenAI's rule)",
                ));
            }
            if !f.parameters.is_object() {
                return Err(invalid("tools", format!("{}'s parameters", f.name), "a JSON schema object"));
            }
            if functions.iter().any(|g: &Function| g.name == f.name) {
                return Err(invalid("tools", format!("two functions named {}", f.name), "distinct function names"));
            }
            functions.push(f);
        }
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                _ => {
                    return Err(invalid(
                        "tool_choice",
                        s,
                        "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\"}}",
                    ))
                }
            },
            Some(v) => {
                let name = (v["type"] == "function").then(|| v["function"]["name"].as_str()).flatten();
                let extra = v.as_object().is_some_and(|o| o.keys().any(|k| k != "type" && k != "function"))
                    || v["function"].as_object().is_some_and(|o| o.keys().any(|k| k != "name"));
                match name {
                    Some(n) if !extra && functions.iter().any(|f| f.name == n) => ToolChoice::Function(n.to_string()),
                    Some(n) if !extra => {
                        return Err(invalid(
                            "tool_choice",
                            format!("the function {n:?}"),
                            "one of the tools' functions",
                        ))
                    }
                    _ => {
                        return Err(invalid(
                            "tool_choice",
                            v,
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                        ))
                    }
                }
            }
        };
        Ok(Some(Tools { functions, choice, parallel: parallel.unwrap_or(true) }))
    }

    /// Whether the output is held to calls (a constraint).
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// The `tools` list templates get (OpenAI's shape, as transformers passes it).
    pub fn template_value(&self) -> Value {
        self.functions.iter().map(|f| json!({"type": "function", "function": f})).collect()
    }

    /// The functions a forced call may name.
    fn callable(&self) -> Vec<&Function> {
        match &self.choice {
            ToolChoice::Function(name) => self.functions.iter().filter(|f| &f.name == name).collect(),
            _ => self.functions.iter().collect(),
        }
    }

    /// Lark (llguidance's dialect) for a forced answer in `format`: one call, or several with
    /// `parallel`, each naming a callable function with arguments its schema validates.
    pub fn grammar(&self, format: ToolFormat) -> String {
        if format == ToolFormat::Pythonic {
            return self.python_grammar();
        }
        let mut lark = String::new();
        let calls: Vec<String> = self
            .callable()
            .iter()
            .enumerate()
            .map(|(i, f)| {
                // Lark strings are JSON strings; %json takes the schema as JSON.
                let head = format!("{{\"name\": \"{}\", \"{}\": ", f.name, format.arguments_key());
                lark.push_str(&format!("args{i}: %json {}\n", f.parameters));
                format!("{} args{i} {}", json!(head), json!("}"))
            })
            .collect();
        lark.push_str(&format!("call: {}\n", calls.join(" | ")));
        let parallel = self.parallel && format != ToolFormat::Llama3Json;
        let start = match (format, parallel) {
            (ToolFormat::Hermes, false) => "start: \"<tool_call>\\n\" call \"\\n</tool_call>\"".to_string(),
            (ToolFormat::Hermes, true) => {
                "start: block (\"\\n\" block)*\nblock: \"<tool_call>\\n\" call \"\\n</tool_call>\"".to_string()
            }
            (ToolFormat::Mistral, false) => "start: \"[TOOL_CALLS][\" call \"]\"".to_string(),
            (ToolFormat::Mistral, true) => "start: \"[TOOL_CALLS][\" call (\", \" call)* \"]\"".to_string(),
            (ToolFormat::Llama3Json | ToolFormat::Pythonic, _) => "start: call".to_string(),
        };
        format!("{start}\n{lark}")
    }

    /// `grammar` for Python calls: `[name(p=value, ...)]`, the parameters in their schema's
    /// order, each value JSON its property's schema validates (Python reads JSON's strings and
    /// numbers alike; `parse_calls` reads `true` and `True`), the required ones always there.
    fn python_grammar(&self) -> String {
        let mut lark = String::new();
        let mut calls = Vec::new();
        for (i, f) in self.callable().iter().enumerate() {
            let props: Vec<(&String, &Value)> =
                f.parameters["properties"].as_object().map(|o| o.iter().collect()).unwrap_or_default();
            let required = |name: &str| {
                f.parameters["required"].as_array().is_some_and(|r| r.iter().any(|n| n.as_str() == Some(name)))
            };
            // From the last parameter back: r{k}, what may follow once something is written, and
            // the first parameter written (`first`: None when none need be).
            let (mut rest, mut first): (Option<String>, Option<String>) = (None, None);
            for (k, (name, schema)) in props.iter().enumerate().rev() {
                lark.push_str(&format!("v{i}_{k}: %json {schema}\n"));
                let tail = rest.clone().map(|r| format!(" {r}")).unwrap_or_default();
                let written = format!("{} v{i}_{k}{tail}", json!(format!("{name}=")));
                let after = format!("{} v{i}_{k}", json!(format!(", {name}=")));
                let r = if required(name) { format!("{after}{tail}") } else { format!("({after})?{tail}") };
                if k > 0 {
                    lark.push_str(&format!("r{i}_{k}: {r}\n"));
                    rest = Some(format!("r{i}_{k}"));
                }
                first = Some(match (required(name), first) {
                    (true, _) => written,
                    (false, Some(f)) => format!("({written} | {f})"),
                    (false, None) => format!("({written})?"),
                });
            }
            let args = first.map(|f| format!(" {f}")).unwrap_or_default();
            calls.push(format!("{}{args} \")\"", json!(format!("{}(", f.name))));
        }
        let list = if self.parallel { "\"[\" call (\", \" call)* \"]\"" } else { "\"[\" call \"]\"" };
        format!("start: {list}\ncall: {}\n{lark}", calls.join(" | "))
    }
}

/// How a model's chat format writes a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen 2.5/3, Hermes,
    /// SmolLM3; the engine's own for templates without tools).
    Hermes,
    /// `{"name": ..., "parameters": {...}}` alone (Llama 3.1 and later; one call an answer).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral).
    Mistral,
    /// `[name(arg=value, ...), ...]`, Python calls (Google's function-calling guide for Gemma 3,
    /// which has no tool tokens; the engine's words for Gemma's turns).
    Pythonic,
}

impl ToolFormat {
    /// The format a chat template's source writes calls in; for one that does not render tools
    /// (`renders_tools` false), its family's (`as_text`): Llama 3's turns take Llama 3.1's JSON
    /// calls, Gemma's turns Python calls, every other Qwen 2.5's `<tool_call>` blocks.
    pub fn of_template(source: &str, renders_tools: bool) -> Self {
        if source.contains("<tool_call>") {
            Self::Hermes
        } else if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<|start_header_id|>") {
            Self::Llama3Json
        } else if !renders_tools && source.contains("<start_of_turn>") {
            Self::Pythonic
        } else {
            Self::Hermes
        }
    }

    fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3Json => "parameters",
            _ => "arguments",
        }
    }
}

/// A call found in the model's text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's `tool_calls[i]`.
    pub fn openai(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// The instructions that show a model whose template does not render tools the functions and
/// how to call them, for the system prompt: Qwen 2.5's template's words (`<tool_call>` blocks, or
/// a `[TOOL_CALLS]` list for a Mistral template), or Google's for Gemma (Python calls).
fn instructions(tools: &Tools, format: ToolFormat) -> String {
    if format == ToolFormat::Pythonic {
        // Google's function-calling guide for Gemma 3: the functions' definitions as JSON.
        let functions: Vec<&Function> = tools.functions.iter().collect();
        let list = serde_json::to_string_pretty(&functions).expect("functions serialize");
        return format!(
            "You have access to functions. If you decide to invoke any of the function(s),\n you MUST put it in \
             the format of\n[func_name1(params_name1=params_value1, params_name2=params_value2...), \
             func_name2(params)]\n\nYou SHOULD NOT include any other text in the response if you call a \
             function\n{list}"
        );
    }
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for f in tools.template_value().as_array().into_iter().flatten() {
        s.push('\n');
        s.push_str(&f.to_string());
    }
    s.push_str(if format == ToolFormat::Mistral {
        "\n</tools>\n\nFor the function calls, return a list of json objects with function name and \
         arguments after [TOOL_CALLS]:\n[TOOL_CALLS][{\"name\": <function-name>, \"arguments\": \
         <args-json-object>}]"
    } else {
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>"
    });
    s
}

/// A message's calls (OpenAI's `tool_calls` entries) as `format` writes them.
fn calls_as_text(calls: &[Value], format: ToolFormat) -> String {
    let parts = calls.iter().map(|c| (c["function"]["name"].as_str().unwrap_or_default(), &c["function"]["arguments"]));
    match format {
        ToolFormat::Hermes => parts
            .map(|(name, args)| format!("<tool_call>\n{}\n</tool_call>", json!({"name": name, "arguments": args})))
            .collect::<Vec<_>>()
            .join("\n"),
        ToolFormat::Mistral => {
            let list: Vec<Value> = parts.map(|(name, args)| json!({"name": name, "arguments": args})).collect();
            format!("[TOOL_CALLS]{}", Value::Array(list))
        }
        ToolFormat::Llama3Json => parts
            .map(|(name, args)| format!("{{\"name\": {}, \"parameters\": {}}}", json!(name), python_json(args)))
            .collect::<Vec<_>>()
            .join("\n"),
        ToolFormat::Pythonic => {
            let call = |(name, args): (&str, &Value)| {
                let args = args.as_object().into_iter().flatten();
                let args: Vec<String> = args.map(|(k, v)| format!("{k}={}", python_literal(v))).collect();
                format!("{name}({})", args.join(", "))
            };
            format!("[{}]", parts.map(call).collect::<Vec<_>>().join(", "))
        }
    }
}

/// A value as a Python literal (`True`, `None`; strings and numbers as JSON writes them, which
/// Python reads the same).
fn python_literal(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Array(items) => format!("[{}]", items.iter().map(python_literal).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let items: Vec<String> = map.iter().map(|(k, v)| format!("{}: {}", json!(k), python_literal(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
        v => v.to_string(),
    }
}

/// JSON as Python's `json.dumps` writes it by default (`", "` and `": "` between items, as
/// transformers' `tojson`): Llama 3.1's template writes call arguments so.
fn python_json(v: &Value) -> String {
    match v {
        Value::Array(items) => format!("[{}]", items.iter().map(python_json).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let items: Vec<String> = map.iter().map(|(k, v)| format!("{}: {}", json!(k), python_json(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
        v => v.to_string(),
    }
}

/// JSON indented by 4 (transformers' `tojson(indent=4)`).
fn indented_json(v: &Value) -> String {
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    v.serialize(&mut ser).expect("a Value serializes");
    String::from_utf8(out).expect("JSON is UTF-8")
}

/// `messages` and `tools` as plain messages in `format`'s words, for a template that does not
/// render tools (the module comment).
pub fn as_text(messages: &[Message], tools: Option<&Tools>, format: ToolFormat) -> Vec<Message> {
    match format {
        ToolFormat::Llama3Json => llama3_as_text(messages, tools),
        _ => system_as_text(messages, tools, format),
    }
}

/// Llama 3.1's template's words: the functions before the first user message's text, each
/// call as its own `{"name", "parameters"}` message text, results as `ipython` turns.
fn llama3_as_text(messages: &[Message], tools: Option<&Tools>) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    let mut preamble = tools.map(|t| {
        let mut s = String::from(
            "Given the following functions, please respond with a JSON for a function call with its proper \
             arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \
             \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n",
        );
        for f in t.template_value().as_array().into_iter().flatten() {
            s.push_str(&indented_json(f));
            s.push_str("\n\n");
        }
        s
    });
    for m in messages {
        let mut m = m.clone();
        if m.role == "tool" {
            m.role = "ipython".into();
        } else if m.role == "user" {
            if let Some(p) = preamble.take() {
                m.content = p + m.content.trim();
            }
        }
        let calls = std::mem::take(&mut m.tool_calls);
        if !calls.is_empty() {
            if !m.content.is_empty() {
                m.content.push('\n');
            }
            m.content.push_str(&calls_as_text(&calls, ToolFormat::Llama3Json));
        }
        m.tool_call_id = None;
        out.push(m);
    }
    if let Some(p) = preamble {
        out.push(Message::new("user", p.trim_end()));
    }
    out
}

/// The words of a format whose instructions go in the system prompt (`instructions`): an
/// assistant's calls after its text, `tool` messages as result blocks in a user turn
/// (consecutive ones in one): `<tool_response>` blocks (Qwen 2.5's), or Gemma's `tool_output`.
fn system_as_text(messages: &[Message], tools: Option<&Tools>, format: ToolFormat) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    if let Some(t) = tools {
        match messages.first() {
            Some(m) if m.role == "system" => {}
            _ => out.push(Message::new("system", instructions(t, format))),
        }
    }
    let mut responses = false;
    for (i, m) in messages.iter().enumerate() {
        if m.role == "tool" {
            let block = match format {
                ToolFormat::Pythonic => format!("```tool_output\n{}\n```", m.content),
                _ => format!("<tool_response>\n{}\n</tool_response>", m.content),
            };
            match out.last_mut() {
                Some(last) if responses => {
                    last.content.push('\n');
                    last.content.push_str(&block);
                }
                _ => out.push(Message::new("user", block)),
            }
            responses = true;
            continue;
        }
        responses = false;
        let mut content = m.content.clone();
        if i == 0 && m.role == "system" {
            if let Some(t) = tools {
                content = format!("{content}\n\n{}", instructions(t, format));
            }
        }
        if !m.tool_calls.is_empty() {
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&calls_as_text(&m.tool_calls, format));
        }
        out.push(Message::new(m.role.clone(), content));
    }
    out
}

/// Openings of a call in any format: text from one of them on is held back from a stream until
/// the answer ends (it may be a call).
pub const CALL_MARKERS: [&str; 4] = ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "```tool_code"];

/// The calls of functions in `tools` that `text` holds (`<tool_call>` blocks, a `[TOOL_CALLS]`
/// list, or the text being a call object or a list of them), with the text outside them
/// (trimmed). None when it holds none: the text is the answer's content.
pub fn parse_calls(text: &str, tools: &Tools, id_prefix: &str) -> Option<(String, Vec<ToolCall>)> {
    let known = |v: &Value| -> Option<(String, String)> {
        let name = v.get("name")?.as_str()?;
        tools.functions.iter().find(|f| f.name == name)?;
        let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or_else(|| json!({}));
        // Arguments given as JSON text are kept as that text.
        let args = match args {
            Value::String(s) if serde_json::from_str::<Value>(&s).is_ok() => s,
            a => a.to_string(),
        };
        Some((name.to_string(), args))
    };
    let objects = |v: Value| -> Vec<Value> {
        match v {
            Value::Array(list) => list,
            v => vec![v],
        }
    };
    let mut found = Vec::new();
    let mut content = String::new();
    if text.contains("<tool_call>") {
        let mut rest = text;
        while let Some(i) = rest.find("<tool_call>") {
            content.push_str(&rest[..i]);
            let body = &rest[i + "<tool_call>".len()..];
            let (inner, after) = match body.find("</tool_call>") {
                Some(j) => (&body[..j], &body[j + "</tool_call>".len()..]),
                None => (body, ""),
            };
            match serde_json::from_str::<Value>(inner.trim()).ok().map(objects) {
                Some(list) if !list.is_empty() && list.iter().all(|v| known(v).is_some()) => {
                    found.extend(list.iter().filter_map(known))
                }
                _ => content.push_str(&rest[i..rest.len() - after.len()]),
            }
            rest = after;
        }
        content.push_str(rest);
    } else if let Some((calls, end)) = python_calls(text.trim()).filter(|(c, _)| c.iter().all(|v| known(v).is_some())) {
        // Python calls (Gemma's): the whole text, or a `tool_code` block.
        found.extend(calls.iter().filter_map(known));
        content.push_str(&text.trim()[end..]);
    } else {
        let trimmed = text.trim_start();
        let (before, json_text) = match trimmed.find("[TOOL_CALLS]") {
            Some(i) => (&trimmed[..i], &trimmed[i + "[TOOL_CALLS]".len()..]),
            None => ("", trimmed.strip_prefix("<|python_tag|>").unwrap_or(trimmed)),
        };
        let mut stream = serde_json::Deserializer::from_str(json_text).into_iter::<Value>();
        if let Some(Ok(v)) = stream.next() {
            let list = objects(v);
            if !list.is_empty() && list.iter().all(|v| known(v).is_some()) {
                found.extend(list.iter().filter_map(known));
                content.push_str(before);
                content.push_str(&json_text[stream.byte_offset()..]);
            }
        }
    }
    if found.is_empty() {
        return None;
    }
    let calls = found
        .into_iter()
        .enumerate()
        .map(|(i, (name, arguments))| ToolCall { id: format!("{id_prefix}{i}"), name, arguments })
        .collect();
    Some((content.trim().to_string(), calls))
}

/// A list of Python calls, `[name(p=value, ...), ...]` (in a ```tool_code block or not), at the
/// start of `text`: each call as `{"name", "arguments"}`, and where the list ends. None when
/// `text` does not open with one.
fn python_calls(text: &str) -> Option<(Vec<Value>, usize)> {
    let fenced = ["```tool_code\n", "```python\n", "```\n"].iter().find_map(|f| text.strip_prefix(f));
    let body = fenced.unwrap_or(text);
    let mut p = PyParser { s: body.as_bytes(), at: 0 };
    p.eat(b'[')?;
    let mut calls = Vec::new();
    loop {
        let name = p.ident()?;
        p.eat(b'(')?;
        let mut args = serde_json::Map::new();
        if !p.peek(b')') {
            loop {
                let key = p.ident()?;
                p.eat(b'=')?;
                args.insert(key, p.value(0)?);
                if !p.peek(b',') {
                    break;
                }
                p.eat(b',')?;
            }
        }
        p.eat(b')')?;
        calls.push(json!({"name": name, "arguments": args}));
        if !p.peek(b',') {
            break;
        }
        p.eat(b',')?;
    }
    p.eat(b']')?;
    let mut end = text.len() - body.len() + p.at;
    if fenced.is_some() {
        p.ws();
        p.s[p.at..].starts_with(b"```").then_some(())?;
        end = text.len() - body.len() + p.at + 3;
    }
    Some((calls, end))
}

/// Python literals: strings, numbers, True/False/None (JSON's spellings too), lists, tuples,
/// dicts; nesting bounded.
struct PyParser<'a> {
    s: &'a [u8],
    at: usize,
}

impl PyParser<'_> {
    fn ws(&mut self) {
        while self.s.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }
    fn peek(&mut self, c: u8) -> bool {
        self.ws();
        self.s.get(self.at) == Some(&c)
    }
    fn eat(&mut self, c: u8) -> Option<()> {
        self.peek(c).then(|| self.at += 1)
    }
    fn ident(&mut self) -> Option<String> {
        self.ws();
        let start = self.at;
        while self.s.get(self.at).is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.') {
            self.at += 1;
        }
        (self.at > start).then(|| String::from_utf8_lossy(&self.s[start..self.at]).into_owned())
    }
    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > 64 {
            return None;
        }
        self.ws();
        let c = *self.s.get(self.at)?;
        match c {
            b'"' | b'\'' => self.string(c).map(Value::String),
            b'[' | b'(' => {
                let close = if c == b'[' { b']' } else { b')' };
                self.at += 1;
                let mut items = Vec::new();
                while !self.peek(close) {
                    items.push(self.value(depth + 1)?);
                    if !self.peek(b',') {
                        break;
                    }
                    self.at += 1;
                }
                self.eat(close)?;
                Some(Value::Array(items))
            }
            b'{' => {
                self.at += 1;
                let mut map = serde_json::Map::new();
                while !self.peek(b'}') {
                    let Value::String(k) = self.value(depth + 1)? else { return None };
                    self.eat(b':')?;
                    map.insert(k, self.value(depth + 1)?);
                    if !self.peek(b',') {
                        break;
                    }
                    self.at += 1;
                }
                self.eat(b'}')?;
                Some(Value::Object(map))
            }
            _ => {
                let start = self.at;
                while self.s.get(self.at).is_some_and(|&c| c.is_ascii_alphanumeric() || b"+-.".contains(&c)) {
                    self.at += 1;
                }
                match std::str::from_utf8(&self.s[start..self.at]).ok()? {
                    "True" | "true" => Some(Value::Bool(true)),
                    "False" | "false" => Some(Value::Bool(false)),
                    "None" | "null" => Some(Value::Null),
                    n => serde_json::from_str::<serde_json::Number>(n).ok().map(Value::Number),
                }
            }
        }
    }
    fn string(&mut self, quote: u8) -> Option<String> {
        self.at += 1;
        let mut out = Vec::new();
        loop {
            let c = *self.s.get(self.at)?;
            self.at += 1;
            match c {
                b'\\' => {
                    let e = *self.s.get(self.at)?;
                    self.at += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'u' => {
                            let hex = std::str::from_utf8(self.s.get(self.at..self.at + 4)?).ok()?;
                            let ch = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
                            self.at += 4;
                            out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
                        }
                        e => out.push(e),
                    }
                }
                c if c == quote => return String::from_utf8(out).ok(),
                c => out.push(c),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tools {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add"}}]);
        Tools::from_request(Some(&tools), Some(&json!("required")), None).unwrap().unwrap()
    }

    #[test]
    fn requests_are_checked_field_by_field() {
        let field = |tools: Value, choice: Option<Value>| match Tools::from_request(Some(&tools), choice.as_ref(), None)
        {
            Err(Error::InvalidOption { name, .. }) => name,
            other => panic!("{other:?}"),
        };
        let f = |name: &str| json!([{"type": "function", "function": {"name": name}}]);
        assert_eq!(field(f("a b"), None), "tools");
        assert_eq!(field(json!([{"type": "retrieval", "function": {"name": "a"}}]), None), "tools");
        assert_eq!(field(json!([]), None), "tools");
        assert_eq!(field(json!([{"type": "function", "function": {"name": "a", "params": {}}}]), None), "tools");
        assert_eq!(field(f("a"), Some(json!("sometimes"))), "tool_choice");
        assert_eq!(field(f("a"), Some(json!({"type": "function", "function": {"name": "b"}}))), "tool_choice");
        let named =
            Tools::from_request(Some(&f("a")), Some(&json!({"type": "function", "function": {"name": "a"}})), None);
        assert_eq!(named.unwrap().unwrap().choice, ToolChoice::Function("a".into()));
        assert!(Tools::from_request(None, Some(&json!("required")), None).is_err());
        assert!(Tools::from_request(None, Some(&json!("auto")), None).is_err());
        assert!(Tools::from_request(None, None, None).unwrap().is_none());
    }

    /// The forced grammar of Python calls, by hand: parameters in order, the optional ones
    /// optional, each value its property's schema.
    #[test]
    fn python_calls_grammar_lists_the_parameters_in_order() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]}}}]);
        let t = Tools::from_request(Some(&tools), Some(&json!("required")), Some(false)).unwrap().unwrap();
        assert_eq!(
            t.grammar(ToolFormat::Pythonic),
            "start: \"[\" call \"]\"\ncall: \"f(\" (\"a=\" v0_0 r0_1 | \"b=\" v0_1) \")\"\n\
             v0_1: %json {\"type\":\"string\"}\nr0_1: \", b=\" v0_1\n\
             v0_0: %json {\"type\":\"integer\"}\n"
        );
    }

    #[test]
    fn calls_are_found_in_every_format_and_other_text_is_content() {
        let t = weather();
        let (content, calls) =
            parse_calls("Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", &t, "call_")
                .unwrap();
        assert_eq!(content, "Let me look.");
        assert_eq!(
            calls,
            vec![ToolCall { id: "call_0".into(), name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }]
        );
        let (_, calls) = parse_calls(r#"{"name": "add", "parameters": {"a": 1}}"#, &t, "c").unwrap();
        assert_eq!((calls[0].name.as_str(), calls[0].arguments.as_str()), ("add", r#"{"a":1}"#));
        let (_, calls) = parse_calls(
            r#"[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]"#,
            &t,
            "c",
        )
        .unwrap();
        assert_eq!(calls.len(), 2);
        // Python calls (Gemma's), bare or in a tool_code block, with Python's and JSON's literals.
        let (content, calls) =
            parse_calls("[get_weather(city='Paris'), add(a=1, b=[True, None, {'k': \"v\\n\"}], c=-2.5e1)]", &t, "c")
                .unwrap();
        assert_eq!(content, "");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].arguments, r#"{"a":1,"b":[true,null,{"k":"v\n"}],"c":-25.0}"#);
        let (content, calls) = parse_calls("```tool_code\n[add()]\n```\nDone.", &t, "c").unwrap();
        assert_eq!((content.as_str(), calls[0].arguments.as_str()), ("Done.", "{}"));
        assert!(parse_calls("[rm(path='/')]", &t, "c").is_none());
        assert!(parse_calls("[1, 2, 3]", &t, "c").is_none());
        // Unknown functions and broken JSON are text.
        assert!(parse_calls(r#"{"name": "rm", "arguments": {}}"#, &t, "c").is_none());
        assert!(parse_calls("<tool_call>\n{\"name\": \"add\", \"argu", &t, "c").is_none());
        assert!(parse_calls("The weather is fine.", &t, "c").is_none());
    }

    /// A template that renders tools gets them as transformers passes them; one that does not
    /// gets them as text (hand-written expectations).
    #[test]
    fn templates_get_tools_their_way() {
        use crate::chat::ChatTemplate;
        let tools = weather();
        let call = json!({"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}});
        let messages = vec![
            Message::new("user", "hi"),
            Message { tool_calls: vec![call], ..Message::new("assistant", "") },
            Message { tool_call_id: Some("c1".into()), ..Message::new("tool", "2") },
        ];
        let plain = |_: &str| Ok(Vec::new());
        let native = ChatTemplate::new(
            "{% for t in tools %}{{ t.type }}:{{ t.function.name }};{% endfor %}\
             {% for m in messages %}[{{ m.role }}{% for c in m.tool_calls %} {{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}\
             {% if m.role == 'tool' %} {{ m.tool_call_id }}{% endif %}:{{ m.content }}]{% endfor %}",
            String::new(),
            String::new(),
        )
        .unwrap();
        let (text, _) = native.render_guarded(&messages, false, Some(&tools), &plain).unwrap();
        assert_eq!(text, r#"function:get_weather;function:add;[user:hi][assistant add{"a":1}:][tool c1:2]"#);
        // Special tokens' spellings in what the template renders unguarded are refused.
        let special = |t: &str| Ok(t.find("<|x|>").map(|i| std::iter::once(i..i + 5).collect()).unwrap_or_default());
        let mut sneaky = tools.clone();
        sneaky.functions[0].description = Some("<|x|>".into());
        assert!(native.render_guarded(&messages, false, Some(&sneaky), &special).is_err());

        let chatml =
            ChatTemplate::new(crate::chat::ChatFamily::ChatMl.template(), String::new(), String::new()).unwrap();
        let (text, _) = chatml.render_guarded(&messages, true, Some(&tools), &plain).unwrap();
        let system = instructions(&tools, ToolFormat::Hermes);
        assert!(
            system.contains(r#"{"type":"function","function":{"name":"get_weather","description":"Weather in a city""#)
        );
        assert_eq!(
            text,
            format!(
                "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n\
                 <|im_start|>assistant\n<tool_call>\n{{\"name\":\"add\",\"arguments\":{{\"a\":1}}}}\n</tool_call><|im_end|>\n\
                 <|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            )
        );
        assert_eq!(chatml.tool_format(), ToolFormat::Hermes);

        // Llama 3's turns: Llama 3.1's words (the functions before the first user message, the
        // call as a {"name", "parameters"} object, the result in an ipython turn).
        let llama = ChatTemplate::new(crate::chat::ChatFamily::Llama3.template(), "<s>".into(), String::new()).unwrap();
        assert_eq!(llama.tool_format(), ToolFormat::Llama3Json);
        let (text, _) = llama.render_guarded(&messages, true, Some(&tools), &plain).unwrap();
        let header = |role: &str| format!("<|start_header_id|>{role}<|end_header_id|>\n\n");
        let function = "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"add\",\n        \
                        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {}\n        }\n    }\n}";
        let preamble = "Given the following functions, please respond with a JSON for a function call with its proper \
                        arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \
                        \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n";
        assert!(text.contains(&format!("{function}\n\nhi<|eot_id|>")), "{text}");
        assert!(text.starts_with(&format!("<s>{}{preamble}{{\n    \"type\": \"function\"", header("user"))), "{text}");
        assert!(
            text.ends_with(&format!(
                "{}{{\"name\": \"add\", \"parameters\": {{\"a\": 1}}}}<|eot_id|>{}2<|eot_id|>{}",
                header("assistant"),
                header("ipython"),
                header("assistant")
            )),
            "{text}"
        );
        // Gemma's turns: Google's words and Python calls; results in tool_output blocks.
        let gemma =
            ChatTemplate::new(crate::chat::ChatFamily::Gemma.template(), "<bos>".into(), String::new()).unwrap();
        assert_eq!(gemma.tool_format(), ToolFormat::Pythonic);
        let (text, _) = gemma.render_guarded(&messages, true, Some(&tools), &plain).unwrap();
        assert!(text.starts_with("<bos><start_of_turn>user\nYou have access to functions."), "{text}");
        assert!(
            text.contains("\n[\n  {\n    \"name\": \"get_weather\",\n    \"description\": \"Weather in a city\""),
            "{text}"
        );
        assert!(
            text.ends_with(
                "\n\nhi<end_of_turn>\n<start_of_turn>model\n[add(a=1)]<end_of_turn>\n\
                 <start_of_turn>user\n```tool_output\n2\n```<end_of_turn>\n<start_of_turn>model\n"
            ),
            "{text}"
        );
        // A role the template does not take is still refused.
        let odd = vec![Message::new("narrator", "hi")];
        assert!(llama.render_guarded(&odd, true, Some(&tools), &plain).is_err());
    }
}
