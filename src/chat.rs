//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with minijinja, or, for a
//! file without one, the template of the chat format its vocabulary gives away.

use crate::error::{Error, Result};
use crate::gguf::Gguf;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
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
}

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
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(template_error)?;
        Ok(Self { env, bos_token, eos_token, family: None })
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(template_error)
    }
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
