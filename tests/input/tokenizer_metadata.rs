//! Tokenizers built from small hand-made GGUF files: the byte-level pre-tokenizers against splits
//! computed independently (tests/data/tokenizer/gen_pre_tokenizer_splits.py), a SentencePiece
//! vocabulary small enough to check by hand, stop tokens, and malformed metadata.

use crate::common;

use std::collections::HashSet;
use std::path::PathBuf;
use webgpu_llm::gguf::{Array, Gguf, GgufWriter, Value};
use webgpu_llm::model::ModelConfig;
use webgpu_llm::tokenizer::{StreamDecoder, Tokenizer};
use webgpu_llm::Error;

fn strings(items: &[&str]) -> Value {
    Value::List(Array::from(items.to_vec()))
}

fn build(metadata: Vec<(&str, Value)>) -> webgpu_llm::error::Result<Tokenizer> {
    let mut w = GgufWriter::new(3);
    for (key, value) in metadata {
        w.metadata(key, value);
    }
    Tokenizer::from_gguf(&Gguf::parse(&w.to_bytes()).expect("a hand-made GGUF parses"))
}

fn byte_level(pre: &str, tokens: &[&str]) -> webgpu_llm::error::Result<Tokenizer> {
    build(vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", strings(tokens)),
        ("tokenizer.ggml.merges", strings(&[])),
    ])
}

#[test]
fn byte_level_pre_tokenizers_split_as_their_regexes() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/pre_tokenizer_splits.json");
    let data: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = data["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    for case in cases {
        let (pre, text) = (case["pre"].as_str().unwrap(), case["text"].as_str().unwrap());
        let expected: Vec<&str> = case["pieces"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let tok = byte_level(pre, &["a"]).unwrap();
        assert_eq!(tok.pre_tokenize(text).unwrap(), expected, "{pre} on {text:?}");
    }
}

#[test]
fn llama3_groups_digits_by_three_and_qwen2_splits_every_digit() {
    let llama3 = byte_level("llama-bpe", &["a"]).unwrap();
    assert_eq!(llama3.pre_tokenize("1234567").unwrap(), ["123", "456", "7"]);
    assert_eq!(llama3.pre_tokenize("I'LL").unwrap(), ["I", "'LL"]);
    assert_eq!(llama3.pre_tokenize("a\n\n b").unwrap(), ["a", "\n\n", " b"]);
    let qwen2 = byte_level("qwen2", &["a"]).unwrap();
    assert_eq!(qwen2.pre_tokenize("2024").unwrap(), ["2", "0", "2", "4"]);
    assert_eq!(qwen2.pre_tokenize("we're").unwrap(), ["we", "'re"]);
}

#[test]
fn unknown_pre_tokenizers_and_models_are_named_in_the_error() {
    match byte_level("klingon-bpe", &["a"]) {
        Err(Error::UnsupportedTokenizer(msg)) => assert!(msg.contains("klingon-bpe"), "{msg}"),
        other => panic!("expected UnsupportedTokenizer, got {:?}", other.err()),
    }
    let wordpiece =
        build(vec![("tokenizer.ggml.model", Value::String("bert".into())), ("tokenizer.ggml.tokens", strings(&["a"]))]);
    assert!(matches!(wordpiece, Err(Error::UnsupportedTokenizer(msg)) if msg.contains("bert")));
}

#[test]
fn end_of_turn_tokens_in_the_vocabulary_stop_generation() {
    let tok = build(vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"])),
        ("tokenizer.ggml.token_type", Value::List(Array::I32(vec![3, 3, 3, 1]))),
        ("tokenizer.ggml.merges", strings(&[])),
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
    ])
    .unwrap();
    assert_eq!(tok.stop_ids, [0, 2]);
}

/// A Llama-2-style SentencePiece vocabulary: unknown, BOS, EOS, the 256 byte tokens, then pieces.
fn sentencepiece(pieces: &[(&str, f32)], extra: Vec<(&str, Value)>) -> webgpu_llm::error::Result<Tokenizer> {
    let bytes: Vec<String> = (0..=255).map(|b| format!("<0x{b:02X}>")).collect();
    let mut tokens: Vec<&str> = vec!["<unk>", "<s>", "</s>"];
    tokens.extend(bytes.iter().map(String::as_str));
    tokens.extend(pieces.iter().map(|(p, _)| p));
    let mut scores = vec![0.0; 3 + 256];
    scores.extend(pieces.iter().map(|(_, s)| s));
    let mut types = vec![2, 3, 3];
    types.extend([6; 256]);
    types.extend(vec![1; pieces.len()]);
    let mut metadata = vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&tokens)),
        ("tokenizer.ggml.scores", Value::List(Array::F32(scores))),
        ("tokenizer.ggml.token_type", Value::List(Array::I32(types))),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ];
    // An extra value replaces the key's default (a GGUF holds each key once).
    metadata.retain(|(key, _)| !extra.iter().any(|(k, _)| k == key));
    metadata.extend(extra);
    build(metadata)
}

const PIECE0: u32 = 3 + 256;

#[test]
fn sentencepiece_joins_the_best_scored_pair_first() {
    let pieces = [("▁", -10.0), ("a", -11.0), ("b", -12.0), ("c", -13.0), ("ab", -2.0), ("bc", -1.0)];
    let tok = sentencepiece(&pieces, vec![]).unwrap();
    // "bc" scores higher than "ab", so "abc" is a + bc; with the scores swapped it is ab + c.
    let (space, a, c, ab, bc) = (PIECE0, PIECE0 + 1, PIECE0 + 3, PIECE0 + 4, PIECE0 + 5);
    assert_eq!(tok.encode("abc").unwrap(), [space, a, bc]);
    let swapped = [("▁", -10.0), ("a", -11.0), ("b", -12.0), ("c", -13.0), ("ab", -1.0), ("bc", -2.0)];
    assert_eq!(sentencepiece(&swapped, vec![]).unwrap().encode("abc").unwrap(), [space, ab, c]);
}

#[test]
fn sentencepiece_prefixes_a_space_and_strips_it_on_decode() {
    let pieces = [("▁", -10.0), ("H", -11.0), ("i", -12.0), ("▁H", -1.0), ("▁Hi", -2.0)];
    let tok = sentencepiece(&pieces, vec![]).unwrap();
    let hi = PIECE0 + 4;
    assert_eq!(tok.encode("Hi Hi").unwrap(), [hi, hi]);
    assert_eq!(tok.decode(&[hi, hi]).unwrap(), "Hi Hi");
    // Only the start of the text gets the space, not text after a special token.
    assert_eq!(tok.encode("<s>Hi").unwrap(), [1, PIECE0 + 1, PIECE0 + 2]);
    let mut stream = StreamDecoder::new();
    assert_eq!(stream.push(&tok, hi).unwrap(), "Hi");
    assert_eq!(stream.push(&tok, hi).unwrap(), " Hi");

    let no_prefix = sentencepiece(&pieces, vec![("tokenizer.ggml.add_space_prefix", Value::Bool(false))]).unwrap();
    assert_eq!(no_prefix.encode("Hi").unwrap(), [PIECE0 + 1, PIECE0 + 2]);
    assert_eq!(no_prefix.decode(&[hi]).unwrap(), " Hi");
}

#[test]
fn sentencepiece_falls_back_to_bytes_and_streams_whole_characters() {
    let tok = sentencepiece(&[("▁", -1.0), ("a", -2.0)], vec![]).unwrap();
    let byte = |b: u32| 3 + b;
    let ids = tok.encode("aé").unwrap();
    assert_eq!(ids, [PIECE0, PIECE0 + 1, byte(0xC3), byte(0xA9)]);
    assert_eq!(tok.decode(&ids).unwrap(), "aé");
    let mut stream = StreamDecoder::new();
    let pieces: Vec<String> = ids.iter().map(|&id| stream.push(&tok, id).unwrap()).collect();
    assert_eq!(pieces, ["", "a", "", "é"]);
}

#[test]
fn malformed_tokenizer_metadata_is_an_error_not_a_panic() {
    let pieces = [("▁", -1.0), ("a", -2.0)];
    let n = 3 + 256 + pieces.len();
    let bad: Vec<(&str, Value)> = vec![
        ("tokenizer.ggml.scores", Value::List(Array::F32(vec![0.0; n - 1]))),
        ("tokenizer.ggml.scores", Value::List(Array::from(vec!["x"; n]))),
        ("tokenizer.ggml.token_type", Value::List(Array::I32(vec![1; n + 1]))),
        ("tokenizer.ggml.token_type", Value::List(Array::I32(vec![9; n]))),
        ("tokenizer.ggml.token_type", Value::List(Array::from(vec!["normal"; n]))),
        ("tokenizer.ggml.add_space_prefix", Value::U8(1)),
    ];
    for (key, value) in bad {
        let described: String = format!("{key} = {value:?}").chars().take(80).collect();
        match sentencepiece(&pieces, vec![(key, value)]) {
            Err(Error::Tokenizer(msg)) => assert!(msg.contains(key), "{described}: {msg}"),
            other => panic!("{described}: expected Error::Tokenizer, got {:?}", other.err()),
        }
    }

    let non_string = build(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::List(Array::U32(vec![7, 8]))),
    ]);
    assert!(matches!(non_string, Err(Error::Tokenizer(msg)) if msg.contains("tokenizer.ggml.tokens")));
    let bad_merge = build(vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&["a", "b", "ab"])),
        ("tokenizer.ggml.merges", strings(&["a b", "ab"])),
    ]);
    assert!(matches!(bad_merge, Err(Error::Tokenizer(_))));
    let empty = build(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&[])),
        ("tokenizer.ggml.scores", Value::List(Array::U8(vec![]))),
    ]);
    assert!(matches!(empty, Err(Error::Tokenizer(msg)) if msg.contains("no tokens")));
}

/// The default model with its token list cut to `keep` tokens (token types and merges cut to
/// match, so the tokenizer itself still builds), weights unchanged.
fn default_model_with_tokens(keep: usize) -> Gguf {
    let bytes = common::model_bytes();
    let g = common::model_gguf();
    let list = |key: &str| -> Vec<String> {
        g.get_array(key).unwrap().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
    };
    let tokens: Vec<String> = list("tokenizer.ggml.tokens").into_iter().take(keep).collect();
    let kept: HashSet<&str> = tokens.iter().map(String::as_str).collect();
    let merges: Vec<String> = list("tokenizer.ggml.merges")
        .into_iter()
        .filter(|m| {
            let (a, b) = m.split_once(' ').unwrap();
            kept.contains(a) && kept.contains(b) && kept.contains(format!("{a}{b}").as_str())
        })
        .collect();
    let types: Vec<i32> = g
        .get_array("tokenizer.ggml.token_type")
        .unwrap()
        .unwrap()
        .iter()
        .take(keep)
        .map(|v| v.as_i64().unwrap() as i32)
        .collect();
    let mut w = GgufWriter::new(3);
    let mut cut = vec![
        ("tokenizer.ggml.tokens", Value::List(Array::from(tokens))),
        ("tokenizer.ggml.merges", Value::List(Array::from(merges))),
        ("tokenizer.ggml.token_type", Value::List(Array::I32(types))),
    ];
    let mut keys: Vec<_> = g.metadata.iter().collect();
    keys.sort_by_key(|(k, _)| k.as_str());
    for (k, v) in keys {
        match cut.iter().position(|(key, _)| key == k) {
            Some(i) => w.metadata(k, cut.swap_remove(i).1),
            None => w.metadata(k, v.clone()),
        };
    }
    assert!(cut.is_empty(), "the default model has tokens, merges and token types");
    for t in &g.tensors {
        w.tensor(&t.name, &t.shape, t.ty, t.data(bytes).to_vec());
    }
    Gguf::parse(&w.to_bytes()).unwrap()
}

#[test]
fn a_token_list_shorter_than_the_model_vocabulary_is_refused() {
    let full = common::model_gguf();
    let rows = ModelConfig::from_gguf(full).unwrap().vocab_size;
    let tok = Tokenizer::from_gguf(full).unwrap();
    assert_eq!(tok.vocab_size(), rows, "the default model's list covers its rows");
    tok.check_vocab(rows).unwrap();
    // A list longer than the rows passes this check: every id the model can produce has text.
    tok.check_vocab(rows - 1).unwrap();

    let keep = rows - 100;
    let truncated = default_model_with_tokens(keep);
    let tok = Tokenizer::from_gguf(&truncated).expect("the cut list is itself a valid tokenizer");
    assert_eq!(tok.vocab_size(), keep);
    let names_both_counts = |err: Error| {
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidMetadata { .. }), "{msg}");
        for needed in ["tokenizer.ggml.tokens", &format!("{keep} tokens"), &format!("{rows} rows")] {
            assert!(msg.contains(needed), "the message names {needed}: {msg}");
        }
    };
    names_both_counts(tok.check_vocab(rows).unwrap_err());
    // Loading the file refuses it, whether the model's config or the tokenizer's check sees it first.
    names_both_counts(ModelConfig::from_gguf(&truncated).and_then(|c| tok.check_vocab(c.vocab_size)).unwrap_err());
}
