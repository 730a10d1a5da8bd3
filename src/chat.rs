//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with minijinja, or, for a
//! file without one, the template of the chat format its vocabulary gives away.

use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::tools::Tools;
use minijinja::value::Object;
use minijinja::ErrorKind;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};

// Limits on rendering `tokenizer.chat_template`, which is code from the model file: a template
// that loops, recurses or writes without end stops with an error naming the limit, in well under
// a second, instead of hanging or growing until memory runs out. Not covered, for minijinja has no
// hook on its allocations: a few instructions that build a huge value out of sight of the output
// (a string doubled with `~` in a loop, 100 MB from `'x' * n`, a long string made a `list`).

/// Instructions one render may execute (minijinja's fuel). Real templates spend a few dozen per
/// message (measured: SmolLM2's about 23, the built-in ones 19 to 44), so this covers a chat of
/// 45 000 messages, or 4 500 with a template ten times heavier than Gemma's: far more than a
/// context window holds. minijinja runs some 7 to 30 million instructions a second natively
/// (macro calls are the slow ones), so a template that loops or recurses without end stops in
/// 0.07 to 0.3 s (measured on a loaded 2-core machine; wasm, not measured, is slower).
pub const MAX_TEMPLATE_INSTRUCTIONS: u64 = 2_000_000;

/// Text one render may produce, counted two ways: the prompt itself, and the text of every
/// `{{ ... }}` expression including what goes into `{% set %}` blocks and macro results (so text
/// built out of sight of the prompt is stopped too; captured text counts again each time it is
/// emitted). A million-token context holds about 4 MiB of text; a longer prompt could not run.
pub const MAX_TEMPLATE_OUTPUT_BYTES: usize = 16 << 20;

/// minijinja's nesting depth (its own default is 500): a loop or `if` adds 1, a macro call about
/// 5. A recursive macro over a tool's JSON schema (a macro, a loop and an `if` a level) goes 40
/// levels deep within 300, a bare recursive macro 49. Each macro level takes about 4 KiB of native
/// stack, so the deepest recursion allowed needs some 200 KiB, far below wasm's 1 MiB stack.
pub const MAX_TEMPLATE_RECURSION: usize = 300;

/// Marks the error the formatter raises when the expressions' text passes the limit.
const OUTPUT_LIMIT_DETAIL: &str = "the chat template's output limit was reached";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant's calls as templates take them (Hugging Face's shape): `[{"id", "type":
    /// "function", "function": {"name", "arguments": {...}}}]`, the arguments an object.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A tool message's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), tool_calls: Vec::new(), tool_call_id: None }
    }
}

/// Chat formats with a built-in template, used when the file has no `tokenizer.chat_template`.
/// Each renders what the family's official template renders for text messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFamily {
    /// Gemma 3's template: `<start_of_turn>user` ... `<end_of_turn>`, the system prompt opening the
    /// first user turn (Gemma 1 and 2 use the same turns but refuse a system prompt).
    Gemma,
    /// ChatML (Qwen2, Qwen3, SmolLM): `<|im_start|>role` ... `<|im_end|>`, with no default system
    /// prompt (Qwen2.5 and SmolLM2 templates add their own when none is given).
    ChatMl,
    /// Llama 3 Instruct: `<|start_header_id|>role<|end_header_id|>` ... `<|eot_id|>` (3.0's
    /// template; 3.1 and later add a dated system header).
    Llama3,
    /// Phi-3: `<|user|>` ... `<|end|>`.
    Phi3,
}

impl ChatFamily {
    /// The family whose turn tokens the vocabulary holds (`general.architecture` would not tell:
    /// "llama" is Llama 2, Llama 3 and SmolLM alike).
    pub fn detect(tokens: &[&str]) -> Option<Self> {
        let has = |token: &str| tokens.contains(&token);
        if has("<start_of_turn>") && has("<end_of_turn>") {
            Some(Self::Gemma)
        } else if has("<|start_header_id|>") && has("<|eot_id|>") {
            Some(Self::Llama3)
        } else if has("<|im_start|>") && has("<|im_end|>") {
            Some(Self::ChatMl)
        } else if has("<|user|>") && has("<|assistant|>") && has("<|end|>") {
            Some(Self::Phi3)
        } else {
            None
        }
    }

    /// The template, as Jinja, in one line so that no block option changes its whitespace.
    pub fn template(self) -> &'static str {
        match self {
            // google/gemma-3-*-it's template, less its image and content-list branches.
            Self::Gemma => concat!(
                "{{ bos_token }}",
                "{% if messages[0]['role'] == 'system' %}",
                "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}",
                "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}",
                "{% for message in loop_messages %}",
                "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}",
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}",
                "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}",
                "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}",
                "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}",
                "{% endfor %}",
                "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
            ),
            Self::ChatMl => concat!(
                "{% for message in messages %}",
                "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
                "{% endfor %}",
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
            ),
            // meta-llama/Meta-Llama-3-8B-Instruct's template, verbatim.
            Self::Llama3 => concat!(
                "{% set loop_messages = messages %}{% for message in loop_messages %}",
                "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'",
                "+ message['content'] | trim + '<|eot_id|>' %}",
                "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}",
                "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
            ),
            // microsoft/Phi-3-mini-4k-instruct's template, verbatim.
            Self::Phi3 => concat!(
                "{% for message in messages %}",
                "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}",
                "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}",
                "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
                "{% endif %}{% endfor %}",
                "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
            ),
        }
    }
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    family: Option<ChatFamily>,
    /// The roles a message may have: system, user, assistant, and any other the template's
    /// source names in quotes (tool, developer, ipython, ...).
    roles: Vec<String>,
    /// Whether the template renders `tools` and messages' `tool_calls` itself.
    renders_tools: bool,
    /// How the model writes calls (`ToolFormat::of_template`).
    tool_format: crate::tools::ToolFormat,
    source: String,
}

/// The roles every template takes.
const BASE_ROLES: [&str; 3] = ["system", "user", "assistant"];
/// Roles a template may take, when its source names them.
const OTHER_ROLES: [&str; 6] = ["tool", "developer", "ipython", "function", "model", "tool_response"];

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// The model's template; else the built-in one of its family; None when neither exists.
    pub fn from_gguf(gguf: &Gguf) -> Result<Option<Self>> {
        let tokens: Vec<&str> = gguf
            .get_array("tokenizer.ggml.tokens")?
            .unwrap_or_default()
            .iter()
            .map(|v| v.as_str().unwrap_or_default())
            .collect();
        let (source, family) = match gguf.get_str("tokenizer.chat_template")? {
            Some(source) => (source, None),
            None => match ChatFamily::detect(&tokens) {
                Some(family) => (family.template(), Some(family)),
                None => return Ok(None),
            },
        };
        let token = |key: &str| -> Result<String> {
            let id = gguf.get_u64(key)?;
            Ok(id.and_then(|i| tokens.get(i as usize)).copied().unwrap_or_default().to_string())
        };
        let mut template =
            Self::new(source, token("tokenizer.ggml.bos_token_id")?, token("tokenizer.ggml.eos_token_id")?)?;
        template.family = family;
        Ok(Some(template))
    }

    /// The family whose built-in template this is; None for the file's own template.
    pub fn family(&self) -> Option<ChatFamily> {
        self.family
    }

    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        // Jinja2 (what transformers uses) keeps a template's trailing newline only when asked to.
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(MAX_TEMPLATE_INSTRUCTIONS));
        env.set_recursion_limit(MAX_TEMPLATE_RECURSION);
        env.set_formatter(count_expression_output);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(template_error)?;
        let named = |r: &str| source.contains(&format!("'{r}'")) || source.contains(&format!("\"{r}\""));
        let others = OTHER_ROLES.into_iter().filter(|r| named(r));
        let roles = BASE_ROLES.into_iter().chain(others).map(String::from).collect();
        let renders_tools = source.contains("tools") && source.contains("tool_call");
        let tool_format = crate::tools::ToolFormat::of_template(source, renders_tools);
        let source = source.to_string();
        Ok(Self { env, bos_token, eos_token, family: None, roles, renders_tools, tool_format, source })
    }

    /// How the model writes a call: the format a forced call is held to and calls are read in.
    pub fn tool_format(&self) -> crate::tools::ToolFormat {
        self.tool_format
    }

    /// The template's Jinja source (its markup tokens are spelled in it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt text for `messages` (`render`) with the byte ranges that came from the
    /// messages' text and hold a special token's spelling (`special_spans(text)` finds them):
    /// those are to be tokenized as text, never as control tokens, so a message cannot open a
    /// turn of its own. A role the template does not take is refused. `tools` and the messages'
    /// calls go to a template that renders them (then they may hold no special token's
    /// spelling); for one that does not, they become text (`crate::tools`'s module comment).
    pub fn render_guarded(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&Tools>,
        special_spans: &dyn Fn(&str) -> Result<Vec<std::ops::Range<usize>>>,
    ) -> Result<(String, Vec<std::ops::Range<usize>>)> {
        let has_calls = messages.iter().any(|m| !m.tool_calls.is_empty() || m.role == "tool");
        // The roles as given; a template without tools gets a `tool` message as its format's
        // result turn.
        let converting = !self.renders_tools && (tools.is_some() || has_calls);
        self.check_roles(messages.iter().filter(|m| !(converting && m.role == "tool")))?;
        let converted;
        let (messages, tools) = if self.renders_tools {
            let calls = messages.iter().flat_map(|m| &m.tool_calls).map(|c| c.to_string());
            for text in tools.map(|t| t.template_value().to_string()).into_iter().chain(calls) {
                if !special_spans(&text)?.is_empty() {
                    return Err(Error::InvalidOption {
                        name: "tools",
                        value: text.chars().take(64).collect(),
                        expected: "tools and tool calls without the spelling of a special token of the model".into(),
                    });
                }
            }
            (messages, tools)
        } else if converting {
            converted = crate::tools::as_text(messages, tools, self.tool_format);
            (&converted[..], None)
        } else {
            (messages, None)
        };
        let spans: Vec<Vec<std::ops::Range<usize>>> =
            messages.iter().map(|m| special_spans(&m.content)).collect::<Result<_>>()?;
        if spans.iter().all(Vec::is_empty) {
            return Ok((self.render_with(messages, add_generation_prompt, tools)?, Vec::new()));
        }
        // Each such spelling is wrapped in markers no message holds, found again in the
        // rendered text and taken out, their places kept.
        let mut nonce = 0u64;
        let (open, close) = loop {
            let (open, close) = (format!("\u{E000}{nonce:x}\u{E001}"), format!("\u{E002}{nonce:x}\u{E003}"));
            if !messages.iter().any(|m| m.content.contains(&open) || m.content.contains(&close)) {
                break (open, close);
            }
            nonce += 1;
        };
        let wrapped: Vec<Message> = messages
            .iter()
            .zip(&spans)
            .map(|(m, spans)| {
                let mut content = String::with_capacity(m.content.len() + spans.len() * (open.len() + close.len()));
                let mut at = 0;
                for r in spans {
                    content.push_str(&m.content[at..r.start]);
                    content.push_str(&open);
                    content.push_str(&m.content[r.clone()]);
                    content.push_str(&close);
                    at = r.end;
                }
                content.push_str(&m.content[at..]);
                Message { content, ..m.clone() }
            })
            .collect();
        let marked = self.render_with(&wrapped, add_generation_prompt, tools)?;
        let (mut text, mut plain) = (String::with_capacity(marked.len()), Vec::new());
        let mut rest = marked.as_str();
        while let Some(i) = rest.find(&open) {
            text.push_str(&rest[..i]);
            rest = &rest[i + open.len()..];
            let Some(j) = rest.find(&close) else { break };
            plain.push(text.len()..text.len() + j);
            text.push_str(&rest[..j]);
            rest = &rest[j + close.len()..];
        }
        text.push_str(rest);
        if text.contains(&open) || text.contains(&close) || plain.len() != spans.iter().map(Vec::len).sum::<usize>() {
            return Err(Error::ChatTemplate(
                "the chat template changed a message's text around a special token's spelling; \
                 such a message cannot be rendered safely with it"
                    .into(),
            ));
        }
        Ok((text, plain))
    }

    /// A role the template does not take is refused.
    fn check_roles<'a>(&self, mut messages: impl Iterator<Item = &'a Message>) -> Result<()> {
        match messages.find(|m| !self.roles.contains(&m.role)) {
            Some(m) => Err(Error::InvalidOption {
                name: "role",
                value: m.role.chars().take(64).collect(),
                expected: format!("one of the roles this model's chat template takes: {}", self.roles.join(", ")),
            }),
            None => Ok(()),
        }
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's
    /// reply begins. A template past one of the limits above is an error naming it; the template
    /// can be rendered again after it.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, None)
    }

    /// `render` with `tools` (for a template that renders them).
    fn render_with(&self, messages: &[Message], add_generation_prompt: bool, tools: Option<&Tools>) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        let mut out = LimitedWriter { text: Vec::new(), exceeded: false };
        let rendered = tmpl.render_captured_to(
            minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                tools => tools.map(Tools::template_value),
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            },
            &mut out,
        );
        match rendered {
            Ok(_) => String::from_utf8(out.text)
                .map_err(|e| Error::ChatTemplate(format!("tokenizer.chat_template rendered invalid UTF-8: {e}"))),
            Err(_) if out.exceeded => Err(self.limit_error(Limit::Output)),
            Err(e) => Err(match (e.kind(), e.detail()) {
                (ErrorKind::OutOfFuel, _) => self.limit_error(Limit::Instructions),
                (_, Some(OUTPUT_LIMIT_DETAIL)) => self.limit_error(Limit::Output),
                (ErrorKind::InvalidOperation, Some("recursion limit exceeded")) => self.limit_error(Limit::Recursion),
                _ => template_error(e),
            }),
        }
    }

    /// The error for a render stopped by `limit`.
    fn limit_error(&self, limit: Limit) -> Error {
        let template = match self.family {
            None => "the model file's template (tokenizer.chat_template)".to_string(),
            Some(family) => format!("the built-in {family:?} template (the file has no tokenizer.chat_template)"),
        };
        let what = match limit {
            Limit::Instructions => format!(
                "hit its instruction limit: it ran more than {MAX_TEMPLATE_INSTRUCTIONS} instructions, \
                 which is a loop without end or far more work than any chat needs"
            ),
            Limit::Output => format!(
                "hit its output limit: it produced more than {} MiB of text, more than any context window \
                 holds (a template that writes without end, or messages far too long)",
                MAX_TEMPLATE_OUTPUT_BYTES >> 20
            ),
            Limit::Recursion => format!(
                "hit its recursion limit: it nested deeper than {MAX_TEMPLATE_RECURSION} levels \
                 (a macro that calls itself without end?)"
            ),
        };
        Error::ChatTemplate(format!("{template} {what}"))
    }
}

/// Which limit stopped a render.
#[derive(Debug, Clone, Copy)]
enum Limit {
    Instructions,
    Output,
    Recursion,
}

/// The prompt, refused past `MAX_TEMPLATE_OUTPUT_BYTES`.
struct LimitedWriter {
    text: Vec<u8>,
    exceeded: bool,
}

impl std::io::Write for LimitedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > MAX_TEMPLATE_OUTPUT_BYTES {
            self.exceeded = true;
            return Err(std::io::Error::other(OUTPUT_LIMIT_DETAIL));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes the expressions of one render have emitted (a minijinja temp: one per render, shared
/// with the macros it calls).
#[derive(Debug, Default)]
struct ExpressionOutput(AtomicUsize);

impl Object for ExpressionOutput {}

/// minijinja's formatter, after counting the value's text against `MAX_TEMPLATE_OUTPUT_BYTES`.
/// It sees every `{{ ... }}`, also inside `{% set %}` blocks and macros, which the prompt's
/// writer never sees.
fn count_expression_output(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &minijinja::Value,
) -> std::result::Result<(), minijinja::Error> {
    let len = value.as_str().map_or_else(|| value.to_string().len(), str::len);
    let total = state.get_or_set_temp_object("expression_output_bytes", ExpressionOutput::default);
    if total.0.fetch_add(len, Ordering::Relaxed).saturating_add(len) > MAX_TEMPLATE_OUTPUT_BYTES {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, OUTPUT_LIMIT_DETAIL));
    }
    minijinja::escape_formatter(out, state, value)
}

fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::ChatTemplate(msg)
}
