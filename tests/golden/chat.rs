//! The GGUF chat template rendered with minijinja against transformers' renderings.

use crate::common;

use webgpu_llm::chat::{ChatTemplate, Message};
use webgpu_llm::tokenizer::Tokenizer;

#[test]
fn renders_every_golden_chat_prompt_exactly() {
    let golden = common::golden("chat.json");
    let gguf = common::model_gguf();
    assert_eq!(gguf.get_str("tokenizer.chat_template").unwrap(), golden["chat_template"].as_str());
    let template = ChatTemplate::from_gguf(gguf).unwrap().expect("the default model has a chat template");
    let tok = Tokenizer::from_gguf(gguf).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let text = template.render(&messages, case["add_generation_prompt"].as_bool().unwrap()).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "text of case {name}");
        assert_eq!(tok.encode(&text).unwrap(), common::ids(&case["ids"]), "ids of case {name}");
    }
}

#[test]
fn template_errors_are_reported_not_panicked() {
    let bad = ChatTemplate::new("{% for m in messages %}{{ m.content", String::new(), String::new());
    assert!(matches!(bad, Err(webgpu_llm::Error::ChatTemplate(_))));
    let raising =
        ChatTemplate::new("{{ raise_exception('roles must alternate') }}", String::new(), String::new()).unwrap();
    let err = raising.render(&[Message::new("user", "x")], true).unwrap_err().to_string();
    assert!(err.contains("roles must alternate"), "{err}");
}

#[test]
fn python_string_methods_work_in_templates() {
    let t = ChatTemplate::new("{{ messages[0].content.strip().upper() }}", String::new(), String::new()).unwrap();
    assert_eq!(t.render(&[Message::new("user", "  hi  ")], false).unwrap(), "HI");
}
