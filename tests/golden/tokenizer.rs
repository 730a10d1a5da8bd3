//! The tokenizer built from GGUF metadata against transformers' outputs in the golden data, and
//! the streaming detokenizer against full decodes.

use crate::common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;
use webgpu_llm::gguf::Gguf;
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

/// Streams `ids` one by one; checks no piece has a replacement character (unless the text itself
/// has one) and that the pieces add up to the full decode. Returns how many tokens produced no
/// text (held back).
fn stream_and_check(tok: &Tokenizer, ids: &[u32]) -> usize {
    let full = tok.decode(ids).unwrap();
    let mut stream = StreamDecoder::new();
    let mut text = String::new();
    let mut held = 0;
    for &id in ids {
        let piece = stream.push(tok, id).unwrap();
        assert!(
            full.contains('\u{FFFD}') || !piece.contains('\u{FFFD}'),
            "piece {piece:?} has a replacement character"
        );
        held += piece.is_empty() as usize;
        text.push_str(&piece);
    }
    text.push_str(&stream.finish(tok).unwrap());
    assert_eq!(text, full);
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

// Gemma 3: a SentencePiece vocabulary (tokenizer.ggml.model = "llama") of 262144 pieces, no merges.

/// The Gemma 3 file's header (scripts/fetch-model gemma3 puts the file there).
fn gemma_gguf() -> &'static Gguf {
    static GGUF: OnceLock<Gguf> = OnceLock::new();
    GGUF.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gemma-3-270m-q4_k_m.gguf");
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-model gemma3 first", path.display()));
        Gguf::parse(&bytes).expect("the Gemma 3 file parses")
    })
}

fn gemma_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let start = Instant::now();
        let tok = Tokenizer::from_gguf(gemma_gguf()).expect("the Gemma tokenizer builds from the GGUF");
        eprintln!("Gemma 3 tokenizer built in {:.2} s", start.elapsed().as_secs_f64());
        tok
    })
}

#[test]
fn gemma_encodes_and_decodes_every_golden_case_exactly() {
    let tok = gemma_tokenizer();
    let golden = common::golden("gemma3-270m/tokenizer.json");
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 39);
    let mut failed = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let expected = common::ids(&case["ids"]);
        let ids = tok.encode(case["text"].as_str().unwrap()).unwrap();
        let decoded = tok.decode(&expected).unwrap();
        if ids != expected || decoded != case["decoded"].as_str().unwrap() {
            failed.push(format!("{name}: ids {ids:?}, expected {expected:?}; decoded {decoded:?}"));
        }
    }
    assert!(failed.is_empty(), "{} of {} cases differ:\n{}", failed.len(), cases.len(), failed.join("\n"));
}

#[test]
fn gemma_special_tokens_and_stop_ids_come_from_the_gguf() {
    let tok = gemma_tokenizer();
    let vocab = &common::golden("gemma3-270m/tokenizer.json")["vocab"];
    assert_eq!(tok.vocab_size(), 262144);
    assert_eq!(tok.bos_id, Some(vocab["bos_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.eos_id, Some(vocab["eos_id"].as_u64().unwrap() as u32));
    assert!(tok.add_bos);
    let end_of_turn = vocab["end_of_turn_id"].as_u64().unwrap() as u32;
    assert!(tok.stop_ids.contains(&1) && tok.stop_ids.contains(&end_of_turn), "stop ids {:?}", tok.stop_ids);
    assert_eq!(tok.encode("<start_of_turn>").unwrap(), [vocab["start_of_turn_id"].as_u64().unwrap() as u32]);
}

#[test]
fn gemma_tokenizer_builds_quickly() {
    let gguf = gemma_gguf();
    let start = common::thread_cpu_time();
    Tokenizer::from_gguf(gguf).unwrap();
    let seconds = (common::thread_cpu_time() - start).as_secs_f64();
    eprintln!("Gemma 3 tokenizer (262144 pieces) built in {seconds:.2} s of CPU time");
    // Generous: the target is under 2 s in release; debug builds and slow machines are slower.
    // CPU time, so that other work on the machine does not count.
    let limit = if cfg!(debug_assertions) { 60.0 } else { 10.0 };
    assert!(seconds < limit, "building the tokenizer took {seconds:.1} s");
}

#[test]
fn gemma_streaming_holds_byte_fallback_pieces_until_the_character_is_whole() {
    let tok = gemma_tokenizer();
    // 𐍈 is not in the vocabulary: four byte tokens, of which only the last completes it.
    let ids = tok.encode("a 𐍈 b").unwrap();
    let bytes: Vec<u32> = ids.iter().copied().filter(|&id| tok.token_str(id).unwrap().starts_with("<0x")).collect();
    assert_eq!(bytes.len(), 4, "{ids:?}");
    assert_eq!(stream_and_check(tok, &ids), 3);
    for case in common::golden("gemma3-270m/tokenizer.json")["cases"].as_array().unwrap() {
        stream_and_check(tok, &common::ids(&case["ids"]));
    }
    let text = "Hi 👋🏽 ça va? 日本語のテキスト、中文字符 🤖🧠🦀 — ünïcödé ½ 𝔘𝔫𝔦";
    stream_and_check(tok, &tok.encode(text).unwrap());
}

#[test]
fn gemma_decode_keeps_leading_spaces() {
    // Gemma adds no space prefix, so none is stripped on decode (unlike Llama 2).
    let tok = gemma_tokenizer();
    let ids = tok.encode(" Paris").unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), " Paris");
    let first = StreamDecoder::new().push(tok, ids[0]).unwrap();
    assert!(first.starts_with(' '), "{first:?}");
}
