//! Built-in chat templates for files without `tokenizer.chat_template`: the text each renders
//! against the official templates rendered by jinja2 (tests/data/tokenizer/gen_chat_builtin.py),
//! the family chosen from the vocabulary, and Gemma 3's file, which has no template.

use std::path::PathBuf;
use webgpu_llm::chat::{ChatFamily, ChatTemplate, Message};
use webgpu_llm::gguf::{Array, Gguf, GgufWriter, Value};
use webgpu_llm::tokenizer::Tokenizer;

fn family(name: &str) -> ChatFamily {
    match name {
        "Gemma" => ChatFamily::Gemma,
        "ChatMl" => ChatFamily::ChatMl,
        "Llama3" => ChatFamily::Llama3,
        "Phi3" => ChatFamily::Phi3,
        other => panic!("unknown family {other}"),
    }
}

#[test]
fn builtin_templates_render_what_the_official_ones_do() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/chat_builtin.json");
    let data: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = data["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 32);
    for case in cases {
        let name =
            format!("{} {} (generation prompt: {})", case["family"], case["name"], case["add_generation_prompt"]);
        let template = ChatTemplate::new(
            family(case["family"].as_str().unwrap()).template(),
            case["bos_token"].as_str().unwrap().into(),
            case["eos_token"].as_str().unwrap().into(),
        )
        .unwrap();
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let text = template.render(&messages, case["add_generation_prompt"].as_bool().unwrap()).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{name}");
    }
}

fn vocabulary_file(tokens: &[&str], chat_template: Option<&str>) -> Gguf {
    let mut w = GgufWriter::new(3);
    w.metadata("general.architecture", Value::String("llama".into()));
    w.metadata("tokenizer.ggml.tokens", Value::List(Array::from(tokens.to_vec())));
    w.metadata("tokenizer.ggml.bos_token_id", Value::U32(0));
    if let Some(source) = chat_template {
        w.metadata("tokenizer.chat_template", Value::String(source.into()));
    }
    Gguf::parse(&w.to_bytes()).unwrap()
}

#[test]
fn the_family_comes_from_the_vocabulary_when_the_file_has_no_template() {
    let cases: [(&[&str], Option<ChatFamily>); 6] = [
        (&["<bos>", "<start_of_turn>", "<end_of_turn>"], Some(ChatFamily::Gemma)),
        (&["<|endoftext|>", "<|im_start|>", "<|im_end|>"], Some(ChatFamily::ChatMl)),
        (&["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], Some(ChatFamily::Llama3)),
        (&["<s>", "<|user|>", "<|assistant|>", "<|end|>"], Some(ChatFamily::Phi3)),
        (&["<s>", "</s>", "[INST]"], None),
        (&["<|im_start|>"], None),
    ];
    for (tokens, expected) in cases {
        let template = ChatTemplate::from_gguf(&vocabulary_file(tokens, None)).unwrap();
        assert_eq!(template.as_ref().and_then(ChatTemplate::family), expected, "{tokens:?}");
        assert_eq!(template.is_some(), expected.is_some(), "{tokens:?}");
    }
    let own = ChatTemplate::from_gguf(&vocabulary_file(&["<|im_start|>", "<|im_end|>"], Some("{{ bos_token }}!")))
        .unwrap()
        .expect("the file's template");
    assert_eq!(own.family(), None);
    assert_eq!(own.render(&[], false).unwrap(), "<|im_start|>!");
}

fn gemma_gguf() -> Gguf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gemma-3-270m-q4_k_m.gguf");
    let bytes = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-model gemma3 first", path.display()));
    Gguf::parse(&bytes).expect("the Gemma 3 file parses")
}

#[test]
fn gemma3_without_a_template_chats_in_gemma_turns() {
    let gguf = gemma_gguf();
    assert_eq!(gguf.get_str("tokenizer.chat_template").unwrap(), None);
    let template = ChatTemplate::from_gguf(&gguf).unwrap().expect("a built-in template for Gemma");
    assert_eq!(template.family(), Some(ChatFamily::Gemma));
    let messages = [Message::new("system", "Be brief."), Message::new("user", "Hi")];
    let text = template.render(&messages, true).unwrap();
    assert_eq!(text, "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");

    // <bos> 2, <start_of_turn> 105, "user" 2364, "\n" 107, <end_of_turn> 106, "model" 4368.
    let ids = Tokenizer::from_gguf(&gguf).unwrap().encode(&text).unwrap();
    assert_eq!(ids[..4], [2, 105, 2364, 107]);
    assert_eq!(ids[ids.len() - 5..], [106, 107, 105, 4368, 107]);

    let err = template.render(&[Message::new("assistant", "x")], true).unwrap_err().to_string();
    assert!(err.contains("alternate"), "{err}");
}
