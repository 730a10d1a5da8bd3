//! The tokenizer, built from GGUF metadata with the `tokenizers` crate, and an incremental
//! detokenizer for streaming that only ever emits whole UTF-8 characters.

use crate::error::{Error, Result};
use crate::gguf::{Gguf, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The regex llama.cpp uses for `tokenizer.ggml.pre` = "llama-bpe" (Llama 3) and relatives.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Tokens that end a generation: EOS plus end-of-turn tokens the model declares.
    pub stop_ids: Vec<u32>,
    pub add_bos: bool,
    vocab_size: usize,
}

impl Tokenizer {
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let model =
            gguf.get_str("tokenizer.ggml.model")?.ok_or(Error::MissingMetadata("tokenizer.ggml.model".into()))?;
        if model != "gpt2" {
            return Err(Error::UnsupportedTokenizer(format!(
                "model {model:?} (tokenizer.ggml.model); supported: \"gpt2\" (byte-level BPE)"
            )));
        }
        let tokens = string_array(gguf, "tokenizer.ggml.tokens")?;
        let merges = string_array(gguf, "tokenizer.ggml.merges")?;
        let token_types: Vec<i64> = match gguf.get_array("tokenizer.ggml.token_type")? {
            Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };

        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Tokenizer(format!("merge {m:?} is not two tokens separated by a space")))
            })
            .collect::<Result<_>>()?;
        let bpe =
            BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| Error::Tokenizer(e.to_string()))?;

        let pre = gguf.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(t, &ty)| AddedToken::from(t.to_string(), ty == TOKEN_TYPE_CONTROL))
            .collect();
        inner.add_special_tokens(&specials);

        let id = |key: &str| -> Result<Option<u32>> {
            Ok(gguf.get_u64(key)?.filter(|&v| (v as usize) < tokens.len()).map(|v| v as u32))
        };
        let bos_id = id("tokenizer.ggml.bos_token_id")?;
        let eos_id = id("tokenizer.ggml.eos_token_id")?;
        let mut stop_ids: Vec<u32> = [eos_id, id("tokenizer.ggml.eot_token_id")?, id("tokenizer.ggml.eom_token_id")?]
            .into_iter()
            .flatten()
            .collect();
        stop_ids.dedup();
        let add_bos = matches!(gguf.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true)));
        Ok(Self { inner, bos_id, eos_id, stop_ids, add_bos, vocab_size: tokens.len() })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) become one token.
    /// Never adds BOS: callers decide (see `add_bos`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The token's string as stored in the vocabulary (byte-level form).
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

fn string_array<'a>(gguf: &'a Gguf, key: &str) -> Result<Vec<&'a str>> {
    let arr = gguf.get_array(key)?.ok_or_else(|| Error::MissingMetadata(key.into()))?;
    arr.iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| Error::Tokenizer(format!("{key} holds a {} where strings were expected", v.type_name())))
        })
        .collect()
}

/// The pre-tokenizer llama.cpp applies for a `tokenizer.ggml.pre` name.
fn pre_tokenizer(name: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| PreTokenizerWrapper::from(ByteLevel::new(false, false, use_regex));
    Ok(match name {
        // SmolLM: every digit on its own, then GPT-2's byte-level split.
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(),
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "llama-bpe" | "llama3" | "smaug-bpe" => {
            let split = Split::new(SplitPattern::Regex(LLAMA3_SPLIT.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            Sequence::new(vec![split.into(), byte_level(false)]).into()
        }
        other => {
            return Err(Error::UnsupportedTokenizer(format!(
                "pre-tokenizer {other:?} (tokenizer.ggml.pre); supported: smollm, default, gpt2, llama-bpe"
            )))
        }
    })
}

/// Turns a stream of token ids into text pieces that never split a UTF-8 character: bytes of a
/// character spread over several tokens are held back until the character is complete.
#[derive(Default)]
pub struct StreamDecoder {
    /// Tokens not yet emitted, after the last emitted window `ids[..read]` (kept as decode
    /// context: it starts at a character boundary, so decoding from it is exact).
    ids: Vec<u32>,
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the text that became complete, possibly empty.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let emitted = tokenizer.decode(&self.ids[..self.read])?;
        let now = tokenizer.decode(&self.ids)?;
        if now.len() > emitted.len() && !now.ends_with('\u{FFFD}') && now.is_char_boundary(emitted.len()) {
            self.ids.drain(..self.read);
            self.read = self.ids.len();
            Ok(now[emitted.len()..].to_string())
        } else {
            Ok(String::new())
        }
    }

    /// The text still held back at the end of a generation (an incomplete character comes out
    /// as the replacement character, as a full decode gives it).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let emitted = tokenizer.decode(&self.ids[..self.read])?;
        let now = tokenizer.decode(&self.ids)?;
        self.ids.clear();
        self.read = 0;
        Ok(now.get(emitted.len()..).unwrap_or_default().to_string())
    }
}
