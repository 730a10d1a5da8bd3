//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with minijinja.

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

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// The model's template, or None when the file has none.
    pub fn from_gguf(gguf: &Gguf) -> Result<Option<Self>> {
        let Some(source) = gguf.get_str("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let token = |key: &str| -> Result<String> {
            let id = gguf.get_u64(key)?;
            let tokens = gguf.get_array("tokenizer.ggml.tokens")?.unwrap_or_default();
            Ok(id.and_then(|i| tokens.get(i as usize)).and_then(|v| v.as_str()).unwrap_or_default().to_string())
        };
        Ok(Some(Self::new(source, token("tokenizer.ggml.bos_token_id")?, token("tokenizer.ggml.eos_token_id")?)?))
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
        Ok(Self { env, bos_token, eos_token })
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
