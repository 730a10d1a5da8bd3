//! The tokenizer built from GGUF metadata against transformers' outputs in the golden data, and
//! the streaming detokenizer against full decodes.

mod common;

use webgpu_llm::tokenizer::{StreamDecoder, Tokenizer};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(common::model_gguf()).expect("tokenizer builds from the GGUF")
}

#[test]
fn encodes_and_decodes_every_golden_case_exactly() {
    let tok = tokenizer();
    let golden = common::golden("tokenizer.json");
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 38);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let expected = common::ids(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), expected, "ids of case {name}");
        assert_eq!(tok.decode(&expected).unwrap(), case["decoded"].as_str().unwrap(), "decoded text of case {name}");
    }
}

#[test]
fn special_tokens_and_ids_come_from_the_gguf() {
    let tok = tokenizer();
    let vocab = &common::golden("tokenizer.json")["vocab"];
    assert_eq!(tok.vocab_size(), vocab["n_tokens"].as_u64().unwrap() as usize);
    assert_eq!(tok.bos_id, Some(vocab["bos_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.eos_id, Some(vocab["eos_id"].as_u64().unwrap() as u32));
    assert!(!tok.add_bos);
    for special in vocab["special_tokens"].as_array().unwrap() {
        let content = special["content"].as_str().unwrap();
        let id = special["id"].as_u64().unwrap() as u32;
        assert_eq!(tok.encode(&format!("a{content}b")).unwrap()[1..2], [id], "{content} is one token inside text");
    }
}

/// Streams `ids` one by one; checks no piece has a replacement character and that the pieces
/// add up to the full decode. Returns how many tokens produced no text (held back).
fn stream_and_check(tok: &Tokenizer, ids: &[u32]) -> usize {
    let mut stream = StreamDecoder::new();
    let mut text = String::new();
    let mut held = 0;
    for &id in ids {
        let piece = stream.push(tok, id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "piece {piece:?} has a replacement character");
        held += piece.is_empty() as usize;
        text.push_str(&piece);
    }
    text.push_str(&stream.finish(tok).unwrap());
    assert_eq!(text, tok.decode(ids).unwrap());
    held
}

#[test]
fn streaming_never_splits_emoji_or_cjk_characters() {
    let tok = tokenizer();
    let text = "Hi 👋🏽 ça va? 日本語のテキスト、中文字符 🤖🧠🦀 — ünïcödé ½ 𝔘𝔫𝔦";
    let ids = tok.encode(text).unwrap();
    // The case is only meaningful if some character's bytes are spread over several tokens.
    let split = ids.iter().filter(|&&id| tok.decode(&[id]).unwrap().contains('\u{FFFD}')).count();
    assert!(split >= 3, "expected tokens holding partial characters, found {split}");
    let held = stream_and_check(&tok, &ids);
    assert!(held >= split / 2, "partial characters must be held back");
    assert_eq!(tok.decode(&ids).unwrap(), text);
}

#[test]
fn streaming_matches_full_decode_on_every_golden_case() {
    let tok = tokenizer();
    for case in common::golden("tokenizer.json")["cases"].as_array().unwrap() {
        stream_and_check(&tok, &common::ids(&case["ids"]));
    }
}
