//! Tool calls (OpenAI's `tools` and `tool_choice`): the functions a request offers, how the
//! model's chat format writes a call (`ToolFormat`, from its template), the Lark grammar that
//! holds a `required` or named call to that format and to each function's parameter schema, and
//! the calls found again in the text the model wrote (`parse_calls`), for `message.tool_calls`.
//!
//! Templates that render tools themselves (Qwen 2.5/3, Hermes, SmolLM3, Llama 3.1+, Mistral...)
//! get them as Hugging Face's `apply_chat_template` passes them: a `tools` list of OpenAI's
//! `{"type": "function", "function": {...}}`, assistant messages with `tool_calls` whose
//! arguments are objects, `tool` messages with their `tool_call_id`. A template that does not (the
//! built-in ones, SmolLM2's, Gemma 3's) gets what Qwen 2.5's template writes: the functions and
//! the call format in the system prompt, calls as `<tool_call>` blocks in the assistant's text and
//! results as `<tool_response>` blocks in a user turn (`ChatTemplate::render_tools`).

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
            (ToolFormat::Llama3Json, _) => "start: call".to_string(),
        };
        format!("{start}\n{lark}")
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
}

impl ToolFormat {
    /// The format a chat template's source writes calls in.
    pub fn of_template(source: &str) -> Self {
        if source.contains("<tool_call>") {
            Self::Hermes
        } else if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<|start_header_id|>") && source.contains("tools") {
            Self::Llama3Json
        } else {
            Self::Hermes
        }
    }

    fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3Json => "parameters",
            Self::Hermes | Self::Mistral => "arguments",
        }
    }
}

/// A call found in the model's text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// The system prompt that shows a model whose template does not render tools the functions and
/// how to call them (Qwen 2.5's template's words).
fn system_prompt(tools: &Tools) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for f in tools.template_value().as_array().into_iter().flatten() {
        s.push('\n');
        s.push_str(&f.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// `messages` and `tools` as plain messages, for a template that does not render tools: the
/// functions in the system prompt, an assistant's calls as `<tool_call>` blocks after its text,
/// `tool` messages as `<tool_response>` blocks in a user turn (consecutive ones in one).
pub fn as_text(messages: &[Message], tools: Option<&Tools>) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    if let Some(t) = tools {
        match messages.first() {
            Some(m) if m.role == "system" => {}
            _ => out.push(Message::new("system", system_prompt(t))),
        }
    }
    let mut responses = false;
    for (i, m) in messages.iter().enumerate() {
        if m.role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
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
                content = format!("{content}\n\n{}", system_prompt(t));
            }
        }
        for call in &m.tool_calls {
            let f = &call["function"];
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&format!(
                "<tool_call>\n{}\n</tool_call>",
                json!({"name": f["name"], "arguments": f["arguments"]})
            ));
        }
        out.push(Message::new(m.role.clone(), content));
    }
    out
}

/// Openings of a call in any format: text from one of them on is held back from a stream until
/// the answer ends (it may be a call).
pub const CALL_MARKERS: [&str; 3] = ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"];

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
        let system = system_prompt(&tools);
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
    }
}
