//! The tokenizer, built from GGUF metadata with the `tokenizers` crate, and an incremental
//! detokenizer for streaming that only ever emits whole UTF-8 characters.
//!
//! Two vocabulary kinds (`tokenizer.ggml.model`), as llama.cpp reads them:
//! - "gpt2": byte-level BPE with merges, text first cut by the regex `tokenizer.ggml.pre` names;
//! - "llama": SentencePiece (Llama 2, Gemma): pieces with scores, `▁` for a space, `<0xNN>` byte
//!   fallback and no merges, so the merges are derived from the scores.

use crate::error::{Error, Result};
use crate::gguf::{Gguf, Value};
use std::collections::HashMap;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// SentencePiece's space.
const SPACE: char = '▁';

/// Tokens that end a chat turn, by name: files often declare only one of them as EOS, and
/// llama.cpp stops on all of these whatever the metadata says.
const END_OF_TURN_TOKENS: [&str; 6] =
    ["<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>"];

// Pre-tokenizer regexes, as the original tokenizer.json files write them (llama.cpp keeps these
// in comments next to rewrites its own regex engine needs; fancy-regex takes the originals).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special tokens' spellings taken as text (made the first time a message
    /// holds one: `encode_guarded`).
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// The ids of tokens a message's text may never produce: special (control, unknown) ones,
    /// and the user-defined ones that are a chat template's markup (`guard_markup`).
    special: std::collections::HashSet<u32>,
    /// User-defined tokens that are not whitespace (candidates for `guard_markup`), and those
    /// of them that the template spells (taken as text in `plain` too).
    user_defined: Vec<(u32, String)>,
    markup: Vec<String>,
    /// Tokens matched as written, as the file declares them: id -> true for a control or
    /// unknown token (special), false for a user-defined one (text spelled as it is stored).
    added: HashMap<u32, bool>,
    /// Byte-level BPE ("gpt2"): a token's characters stand for bytes; else SentencePiece.
    byte_level: bool,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Tokens that end a generation: EOS, EOT and EOM as declared, plus the end-of-turn tokens
    /// of the known chat formats present in the vocabulary.
    pub stop_ids: Vec<u32>,
    pub add_bos: bool,
    vocab_size: usize,
    /// Bytes of the vocabulary's longest token string (at least the bytes of any token's text).
    max_token_bytes: usize,
}

impl Tokenizer {
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let model =
            gguf.get_str("tokenizer.ggml.model")?.ok_or(Error::MissingMetadata("tokenizer.ggml.model".into()))?;
        let tokens = string_array(gguf, "tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err(Error::Tokenizer("tokenizer.ggml.tokens holds no tokens".into()));
        }
        let token_types = token_types(gguf, tokens.len())?;
        let mut inner = match model {
            "gpt2" => byte_level_bpe(gguf, &tokens)?,
            "llama" => sentencepiece_bpe(gguf, &tokens)?,
            other => {
                return Err(Error::UnsupportedTokenizer(format!(
                    "model {other:?} (tokenizer.ggml.model); supported: \"gpt2\" (byte-level BPE), \"llama\" (SentencePiece)"
                )))
            }
        };

        // Control, user-defined and unknown tokens written in the text are that one token, matched
        // in the raw text before any other processing (llama.cpp's special-token partition). Gemma
        // relies on it: its whitespace-run tokens are stored with plain spaces, not `▁`.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, &ty)| matches!(ty, TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(t, &ty)| AddedToken::from(t.to_string(), ty != TOKEN_TYPE_USER_DEFINED).normalized(false))
            .collect();
        inner.add_special_tokens(&specials);
        let special = specials.iter().filter(|t| t.special).filter_map(|t| inner.token_to_id(&t.content)).collect();
        let user_defined = specials
            .iter()
            .filter(|t| !t.special && !t.content.trim().is_empty())
            .filter_map(|t| Some((inner.token_to_id(&t.content)?, t.content.clone())))
            .collect();

        let id = |key: &str| token_id(gguf, key, tokens.len());
        let bos_id = id("tokenizer.ggml.bos_token_id")?;
        let eos_id = id("tokenizer.ggml.eos_token_id")?;
        let declared = [eos_id, id("tokenizer.ggml.eot_token_id")?, id("tokenizer.ggml.eom_token_id")?];
        let by_name = END_OF_TURN_TOKENS.iter().map(|name| inner.token_to_id(name));
        let mut stop_ids: Vec<u32> = Vec::new();
        for stop in declared.into_iter().chain(by_name).flatten() {
            if !stop_ids.contains(&stop) {
                stop_ids.push(stop);
            }
        }
        let add_bos = flag(gguf, "tokenizer.ggml.add_bos_token", false)?;
        let added = specials.iter().filter_map(|t| Some((inner.token_to_id(&t.content)?, t.special))).collect();
        Ok(Self {
            added,
            byte_level: model == "gpt2",
            inner,
            plain: std::sync::OnceLock::new(),
            special,
            user_defined,
            markup: Vec::new(),
            bos_id,
            eos_id,
            stop_ids,
            add_bos,
            vocab_size: tokens.len(),
            max_token_bytes: tokens.iter().map(|t| t.len()).max().unwrap_or(1),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Bytes of the longest token string in the vocabulary: no token's text is longer (a
    /// byte-level token's characters are 1 or 2 bytes for each byte they stand for, a
    /// SentencePiece token's `▁` 3 for a space, its byte tokens `<0xAB>` 6 for one), so a text of
    /// B bytes is at least B / max_token_bytes tokens.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// Checks the token list against the model's vocabulary, `model_vocab` rows of its embedding
    /// and output (`ModelConfig::vocab_size`); the engine calls it when it loads a model.
    ///
    /// Fewer tokens than rows is an error: the model would sample ids past the list, which have
    /// no text and print nothing. Files never need it: converters pad the list to the rows with
    /// `[PADn]` tokens (Qwen's rows are a multiple of 128), and llama.cpp, which takes its vocab
    /// size from the list, refuses such a file, so a shorter list is a truncated one. More tokens
    /// than rows is accepted (a file may carry a token the model has no row for: Llama 3.2
    /// Vision's `<|image|>` is one past its output rows): every id the model produces has text, and a prompt holding one of
    /// the extra tokens is refused when it is run (`Error::TokenOutOfRange`).
    pub fn check_vocab(&self, model_vocab: usize) -> Result<()> {
        if self.vocab_size >= model_vocab {
            return Ok(());
        }
        Err(Error::InvalidMetadata {
            key: "tokenizer.ggml.tokens".into(),
            value: format!("{} tokens", self.vocab_size),
            reason: format!(
                "the model's vocabulary (token_embd.weight, output.weight) has {model_vocab} rows, so ids {} \
                 to {} would have no text; the token list is truncated: convert the model again",
                self.vocab_size,
                model_vocab - 1
            ),
        })
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) become one token.
    /// Never adds BOS: callers decide (see `add_bos`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Counts among the tokens a message's text may not produce the user-defined tokens that
    /// `template` (a chat template's source) spells: Gemma's `<start_of_turn>` is user-defined
    /// in many conversions, not a control token, yet it opens a turn. (Before any encoding.)
    pub fn guard_markup(&mut self, template: &str) {
        for (id, text) in &self.user_defined {
            if template.contains(text.as_str()) && self.special.insert(*id) {
                self.markup.push(text.clone());
            }
        }
    }

    /// The byte ranges of `text` that `encode` makes special (control) tokens or a chat
    /// template's markup (`guard_markup`): spellings such as `<|im_start|>` written in it.
    pub fn special_spans(&self, text: &str) -> Result<Vec<std::ops::Range<usize>>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc
            .get_ids()
            .iter()
            .zip(enc.get_offsets())
            .filter(|(id, _)| self.special.contains(id))
            .map(|(_, &(start, end))| start..end)
            .collect())
    }

    /// `encode`, but the byte ranges in `plain` are text: a special token's spelling there is
    /// its characters' tokens, never the special token (messages' text in a chat prompt).
    pub fn encode_guarded(&self, text: &str, plain: &[std::ops::Range<usize>]) -> Result<Vec<u32>> {
        if plain.is_empty() {
            return self.encode(text);
        }
        let as_text = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            // The markup tokens count as special here, so that they are taken as text too.
            let markup: Vec<AddedToken> =
                self.markup.iter().map(|m| AddedToken::from(m.clone(), true).normalized(false)).collect();
            t.add_special_tokens(&markup);
            t.set_encode_special_tokens(true);
            t
        });
        let mut ids = Vec::new();
        let mut at = 0;
        for r in plain {
            if at < r.start {
                ids.extend(self.encode(&text[at..r.start])?);
            }
            let enc = as_text.encode(&text[r.clone()], false).map_err(|e| Error::Tokenizer(e.to_string()))?;
            ids.extend_from_slice(enc.get_ids());
            at = r.end;
        }
        if at < text.len() {
            ids.extend(self.encode(&text[at..])?);
        }
        Ok(ids)
    }

    /// Text of `ids`, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// What token `id` stands for: a special token (its name), or the bytes it adds to a text
    /// (a byte-level token's characters mapped back to bytes, SentencePiece's `▁` a space and
    /// `<0xAB>` one byte). None past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<TokenBytes> {
        let piece = self.inner.id_to_token(id)?;
        Some(match self.added.get(&id) {
            Some(true) => TokenBytes::Special(piece),
            Some(false) => TokenBytes::Text(piece.into_bytes()),
            None if self.byte_level => TokenBytes::Text(piece.chars().filter_map(byte_of_char).collect()),
            None => match piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                Some(hex) if hex.len() == 2 => TokenBytes::Text(vec![u8::from_str_radix(hex, 16).ok()?]),
                _ => TokenBytes::Text(piece.replace(SPACE, " ").into_bytes()),
            },
        })
    }

    /// The token's string as stored in the vocabulary (byte-level or SentencePiece form).
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The pieces of `text` that BPE works on separately, as slices of `text`: what the
    /// pre-tokenizer's regex cuts (special tokens are not matched here).
    pub fn pre_tokenize<'a>(&self, text: &'a str) -> Result<Vec<&'a str>> {
        let mut pretokenized = PreTokenizedString::from(text);
        if let Some(pre) = self.inner.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pretokenized).map_err(|e| Error::Tokenizer(e.to_string()))?;
        }
        pretokenized
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (start, end), _)| {
                text.get(start..end).ok_or_else(|| Error::Tokenizer(format!("piece {start}..{end} is not text")))
            })
            .collect()
    }
}

fn byte_level_bpe(gguf: &Gguf, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let merges = string_array(gguf, "tokenizer.ggml.merges")?
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| Error::Tokenizer(format!("merge {m:?} is not two tokens separated by a space")))
        })
        .collect::<Result<_>>()?;
    let pre = gguf.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let (pre_tokenizer, ignore_merges) = byte_level_pre_tokenizer(pre)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab(tokens), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// The pre-tokenizer llama.cpp applies for a `tokenizer.ggml.pre` name, and whether a piece found
/// whole in the vocabulary skips the merges (llama.cpp's `ignore_merges`, as Llama 3's
/// tokenizer.json sets it).
fn byte_level_pre_tokenizer(name: &str) -> Result<(PreTokenizerWrapper, bool)> {
    let byte_level = |use_regex| PreTokenizerWrapper::from(ByteLevel::new(false, false, use_regex));
    let split = |regex: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Sequence::new(vec![split.into(), byte_level(false)]).into())
    };
    Ok(match name {
        "default" | "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" => (byte_level(true), false),
        // Every digit on its own, then GPT-2's split.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            (Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(), false)
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => (split(LLAMA3_SPLIT)?, true),
        "dbrx" | "smaug-bpe" => (split(LLAMA3_SPLIT)?, false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => (split(QWEN2_SPLIT)?, false),
        "gpt-4o" | "llama4" => (split(GPT4O_SPLIT)?, false),
        "tekken" => (split(TEKKEN_SPLIT)?, true),
        other => {
            return Err(Error::UnsupportedTokenizer(format!(
                "pre-tokenizer {other:?} (tokenizer.ggml.pre); supported: default, gpt2, smollm, starcoder, \
                 llama-bpe, qwen2, gpt-4o, tekken and the names llama.cpp gives the same rules"
            )))
        }
    })
}

/// SentencePiece as a BPE with byte fallback, the way transformers' GGUF converter rebuilds it.
fn sentencepiece_bpe(gguf: &Gguf, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let scores = scores(gguf, tokens.len())?;
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab(tokens), merges_from_scores(tokens, &scores)?)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = token_id(gguf, "tokenizer.ggml.unknown_token_id", tokens.len())? {
        bpe = bpe.unk_token(tokens[unk as usize].to_string());
    }
    let bpe = bpe.build().map_err(|e| Error::Tokenizer(e.to_string()))?;

    // llama.cpp's default is a space in front of the text (Llama 2); Gemma says false.
    let add_space_prefix = flag(gguf, "tokenizer.ggml.add_space_prefix", true)?;
    let prepend = if add_space_prefix { PrependScheme::First } else { PrependScheme::Never };
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Metaspace::new(SPACE, prepend, false)));

    // `▁` becomes a space before the byte tokens are joined: a `▁` spelled in bytes is text.
    let replace = Replace::new(SPACE.to_string(), " ").map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut decoders: Vec<DecoderWrapper> = vec![replace.into(), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// The merges a SentencePiece vocabulary implies. llama.cpp's SPM tokenizer repeatedly joins the
/// adjacent pair whose joined piece has the highest score; a BPE whose merges are every split of
/// every piece, ranked by that piece's score, does the same.
fn merges_from_scores(tokens: &[&str], scores: &[f32]) -> Result<Vec<(String, String)>> {
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    // Each merge holds its token's text once more; a real vocabulary's merges hold about twice
    // its text (Gemma 3: 4.6 MB for 2.3 MB of tokens), a crafted one (long tokens that split
    // anywhere) grows with the square of its token lengths: refuse it before building it.
    let token_bytes: usize = tokens.iter().map(|t| t.len()).sum();
    let budget = MERGE_BYTES_PER_TOKEN_BYTE * token_bytes + (1 << 20);
    let mut merge_bytes = 0usize;
    let mut ranked: Vec<(usize, usize, usize)> = Vec::new();
    for (joined, token) in tokens.iter().enumerate() {
        for (split, _) in token.char_indices().skip(1) {
            if let (Some(&left), Some(&right)) = (ids.get(&token[..split]), ids.get(&token[split..])) {
                ranked.push((joined, left, right));
                merge_bytes += token.len();
                if merge_bytes > budget {
                    return Err(Error::InvalidMetadata {
                        key: "tokenizer.ggml.tokens".into(),
                        value: format!("{} tokens of {token_bytes} bytes", tokens.len()),
                        reason: format!(
                            "its SentencePiece merges would take more than {budget} bytes ({MERGE_BYTES_PER_TOKEN_BYTE}x the tokens' text): long tokens that split at every position are no real vocabulary"
                        ),
                    });
                }
            }
        }
    }
    // Ties go to the lower id, then to the better-scored pieces, as the converter orders them
    // (the sort is stable, so the split position decides last).
    ranked.sort_by(|a, b| {
        (scores[b.0].total_cmp(&scores[a.0]))
            .then(a.0.cmp(&b.0))
            .then(scores[b.1].total_cmp(&scores[a.1]))
            .then(scores[b.2].total_cmp(&scores[a.2]))
    });
    Ok(ranked.into_iter().map(|(_, left, right)| (tokens[left].to_string(), tokens[right].to_string())).collect())
}

/// The most text the merges of a SentencePiece vocabulary may hold, per byte of its tokens.
const MERGE_BYTES_PER_TOKEN_BYTE: usize = 16;

fn vocab(tokens: &[&str]) -> tokenizers::models::bpe::Vocab {
    tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect()
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

/// One type per token (all normal when the file has none).
fn token_types(gguf: &Gguf, n_tokens: usize) -> Result<Vec<i64>> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(types) = gguf.get_array(KEY)? else {
        return Ok(vec![TOKEN_TYPE_NORMAL; n_tokens]);
    };
    check_len(KEY, types.len(), n_tokens)?;
    types
        .iter()
        .map(|v| match v.as_i64() {
            Some(ty @ 0..=6) => Ok(ty),
            _ => Err(Error::Tokenizer(format!("{KEY} holds {v:?}, which is not a token type (0 to 6)"))),
        })
        .collect()
}

fn scores(gguf: &Gguf, n_tokens: usize) -> Result<Vec<f32>> {
    const KEY: &str = "tokenizer.ggml.scores";
    let scores = gguf.get_array(KEY)?.ok_or_else(|| Error::MissingMetadata(KEY.into()))?;
    check_len(KEY, scores.len(), n_tokens)?;
    scores
        .iter()
        .map(|v| {
            v.as_f32()
                .ok_or_else(|| Error::Tokenizer(format!("{KEY} holds a {} where floats were expected", v.type_name())))
        })
        .collect()
}

fn check_len(key: &str, len: usize, n_tokens: usize) -> Result<()> {
    if len == n_tokens {
        Ok(())
    } else {
        Err(Error::Tokenizer(format!("{key} has {len} entries for {n_tokens} tokens (tokenizer.ggml.tokens)")))
    }
}

/// A token id from the metadata; ids outside the vocabulary count as absent, as llama.cpp treats them.
fn token_id(gguf: &Gguf, key: &str, n_tokens: usize) -> Result<Option<u32>> {
    Ok(gguf.get_u64(key)?.filter(|&v| (v as usize) < n_tokens).map(|v| v as u32))
}

/// A token as a text's bytes (`Tokenizer::token_bytes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    Special(String),
    Text(Vec<u8>),
}

/// The byte a byte-level BPE character stands for (GPT-2's table: the printable bytes
/// 33-126, 161-172 and 174-255 are their own character, the others 256 + their rank among
/// them).
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if c < 256 {
        return printable(c).then_some(c as u8);
    }
    (0..256u32).filter(|&b| !printable(b)).nth((c - 256) as usize).map(|b| b as u8)
}

fn flag(gguf: &Gguf, key: &str, default: bool) -> Result<bool> {
    match gguf.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(Error::Tokenizer(format!("{key} is a {} where a bool was expected", v.type_name()))),
    }
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
