//! Structured output when sampling, on the tiny random-weight chat model (every byte a token):
//! 50 seeds at temperature 0.8 in one batch on the GPU, each output checked by hand against its
//! constraint (parsed as JSON and every field checked against the schema; the regex's shape
//! checked character by character). A random model's choices are far from what the text should
//! be, so it tries the constraint everywhere. (Greedy outputs against Python llguidance:
//! tests/golden/constrained.rs.)

use crate::common::tiny;

use std::collections::HashMap;
use webgpu_llm::batcher::{BatchEvent, Batcher, RequestId};
use webgpu_llm::constraint::ConstraintSpec;
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, StopReason};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;

/// Runs `spec` sampled with seeds 0..`seeds` in one batch (plain, top-k and top-p samplers in
/// turn); the texts, each ended by the end of sequence (a complete output: only stop tokens may
/// follow).
fn sampled(engine: &mut Engine, spec: &ConstraintSpec, seeds: u64) -> Vec<String> {
    let mut b = Batcher::new(engine, 256);
    let prompt = Prompt::Tokens(tiny::chat_prompt(&[("user", "Describe a person as JSON.")]));
    let mut texts: HashMap<RequestId, (String, Option<StopReason>)> = HashMap::new();
    for seed in 0..seeds {
        // Each sampler's path in turn: the whole row masked on the host, and the GPU's masked
        // top-k and top-p selections.
        let (top_k, top_p) = [(0, 1.0), (40, 1.0), (0, 0.95)][seed as usize % 3];
        let sampling = SamplingParams { temperature: 0.8, top_k, top_p, min_p: 0.0, seed, ..Default::default() };
        let opts = GenerateOptions { max_tokens: 200, sampling, constraint: Some(spec.clone()), ..Default::default() };
        texts.insert(b.enqueue(Batcher::prepare(engine, &prompt, &opts).unwrap()), Default::default());
    }
    while !b.is_empty() {
        pollster::block_on(b.step(engine, &mut |_| true, &mut |id, ev| {
            let t = texts.get_mut(&id).unwrap();
            match ev {
                BatchEvent::Token(tok) => t.0.push_str(&tok.text),
                BatchEvent::Done(s) => t.1 = Some(s.stop_reason),
                BatchEvent::Failed(e) => panic!("request {id} failed: {e}"),
                BatchEvent::Beams(_) => unreachable!(),
            }
            true
        }))
        .unwrap();
    }
    texts
        .into_values()
        .map(|(text, stop)| {
            assert_eq!(stop, Some(StopReason::Eos), "{text:?} did not end with its grammar");
            text
        })
        .collect()
}

#[test]
fn sampled_constrained_outputs_always_follow_the_constraint() {
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(512), gpu: GpuOptions::default() };
    let mut engine = pollster::block_on(Engine::load(tiny::chat(), opts, &mut |_, _| {})).unwrap();
    // Compact JSON (no free whitespace: a random model would spend its tokens on it) with
    // bounded strings and numbers, so that every output completes within its tokens.
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
        },
        "required": ["name", "age", "color"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false}
    });
    let mut distinct = std::collections::HashSet::new();
    for text in sampled(&mut engine, &ConstraintSpec::JsonSchema(schema), 50) {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = v.as_object().unwrap_or_else(|| panic!("{text:?} is no object"));
        for key in o.keys() {
            assert!(["name", "age", "color", "tags"].contains(&key.as_str()), "{text:?}: {key}");
        }
        let name = o["name"].as_str().unwrap_or_else(|| panic!("{text:?}: name"));
        assert!((1..=8).contains(&name.chars().count()), "{text:?}: name length");
        let age = o["age"].as_i64().unwrap_or_else(|| panic!("{text:?}: age"));
        assert!((0..=150).contains(&age), "{text:?}: age");
        assert!(["red", "green", "blue"].contains(&o["color"].as_str().unwrap_or_default()), "{text:?}: color");
        if let Some(tags) = o.get("tags") {
            let tags = tags.as_array().unwrap_or_else(|| panic!("{text:?}: tags"));
            assert!(tags.len() <= 3 && tags.iter().all(|t| t.is_boolean()), "{text:?}: tags");
        }
        distinct.insert(text);
    }
    // Sampling, not one answer 50 times.
    assert!(distinct.len() > 10, "{} distinct outputs", distinct.len());

    // A regex: "(yes|no): " then 1 to 3 digits, a space and 2 to 6 lowercase letters.
    let regex = ConstraintSpec::Regex("(yes|no): [0-9]{1,3} [a-z]{2,6}".into());
    for text in sampled(&mut engine, &regex, 50) {
        let rest =
            text.strip_prefix("yes: ").or_else(|| text.strip_prefix("no: ")).unwrap_or_else(|| panic!("{text:?}"));
        let (digits, word) = rest.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
        assert!((1..=3).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
        assert!((2..=6).contains(&word.len()) && word.bytes().all(|b| b.is_ascii_lowercase()), "{text:?}");
    }
}

/// A required tool call, sampled (20 seeds) in each call format the template may ask for
/// (Hermes, Mistral, Llama 3's JSON, Gemma's Python calls):
/// every output is calls of the request's functions only (`parse_calls` finds them, with no text
/// beside them), each with arguments its schema holds, checked by hand; Llama 3's format one call.
#[test]
fn sampled_required_tool_calls_are_calls_in_the_models_format() {
    use webgpu_llm::tools::{parse_calls, ToolFormat, Tools};
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false}}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false}}}}
    ]);
    let tools = std::sync::Arc::new(
        Tools::from_request(Some(&tools), Some(&serde_json::json!("required")), None).unwrap().unwrap(),
    );
    // Templates that only name their format (the prompt is given as tokens).
    let templates = [
        (None, ToolFormat::Hermes),
        (Some("{{ tools }}[TOOL_CALLS]"), ToolFormat::Mistral),
        (Some("<|start_header_id|>{{ tools }}"), ToolFormat::Llama3Json),
        (Some("<start_of_turn>{{ messages }}"), ToolFormat::Pythonic),
    ];
    for (template, format) in templates {
        let bytes = match template {
            None => tiny::chat().to_vec(),
            Some(t) => {
                tiny::with_metadata(tiny::chat(), "tokenizer.chat_template", webgpu_llm::gguf::Value::String(t.into()))
            }
        };
        let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(512), gpu: GpuOptions::default() };
        let mut engine = pollster::block_on(Engine::load(&bytes[..], opts, &mut |_, _| {})).unwrap();
        let mut counts = Vec::new();
        for text in sampled(&mut engine, &ConstraintSpec::Tools(tools.clone()), 20) {
            let (content, calls) = parse_calls(&text, &tools, "c").unwrap_or_else(|| panic!("{format:?}: {text:?}"));
            assert_eq!(content, "", "{format:?}: {text:?}");
            match format {
                ToolFormat::Hermes => assert!(text.starts_with("<tool_call>\n{\"name\": "), "{text:?}"),
                ToolFormat::Mistral => assert!(text.starts_with("[TOOL_CALLS][{\"name\": "), "{text:?}"),
                ToolFormat::Llama3Json => {
                    assert!(text.starts_with("{\"name\": ") && text.contains("\"parameters\": "), "{text:?}");
                    assert_eq!(calls.len(), 1, "{text:?}");
                }
                ToolFormat::Pythonic => {
                    let named = ["[get_weather(city=", "[get_time(zone="];
                    assert!(named.iter().any(|n| text.starts_with(n)) && text.ends_with(")]"), "{text:?}")
                }
            }
            for call in &calls {
                let args: serde_json::Value = serde_json::from_str(&call.arguments).unwrap();
                let o = args.as_object().unwrap();
                match call.name.as_str() {
                    "get_weather" => {
                        assert_eq!(o.len(), 2, "{text:?}");
                        assert!((1..=12).contains(&o["city"].as_str().unwrap().chars().count()), "{text:?}");
                        assert!((1..=7).contains(&o["days"].as_i64().unwrap()), "{text:?}");
                    }
                    "get_time" => {
                        assert_eq!(o.len(), 1, "{text:?}");
                        assert!(["UTC", "CET"].contains(&o["zone"].as_str().unwrap()), "{text:?}");
                    }
                    other => panic!("{other}"),
                }
            }
            counts.push(calls.len());
        }
        eprintln!("{format:?}: calls per answer {counts:?}");
    }
}

/// llama.cpp's GBNF in `grammar` (converted to Lark): sampled outputs are those of the same
/// grammar written in Lark by hand (the same masks at every step, so each seed draws the same
/// text), and each is checked by hand.
#[test]
fn a_gbnf_grammar_constrains_as_the_same_grammar_in_lark() {
    let opts = LoadOptions { backend: BackendKind::Gpu, context_length: Some(512), gpu: GpuOptions::default() };
    let mut engine = pollster::block_on(Engine::load(tiny::chat(), opts, &mut |_, _| {})).unwrap();
    let gbnf = "root ::= \"[\" item (\",\" item){0,3} \"]\"  # a short list\nitem ::= [a-c]+ |\n  \"\\\"\" [0-9]{1,2} \"\\\"\"\n";
    let lark = "start: \"[\" item (\",\" item){0,3} \"]\"\nitem: /[a-c]/+ | \"\\\"\" /[0-9]/{1,2} \"\\\"\"\n";
    let converted = webgpu_llm::constraint::gbnf_to_lark(gbnf).unwrap();
    let mut from_gbnf = sampled(&mut engine, &ConstraintSpec::Lark(converted), 20);
    let mut from_lark = sampled(&mut engine, &ConstraintSpec::Lark(lark.into()), 20);
    from_gbnf.sort();
    from_lark.sort();
    assert_eq!(from_gbnf, from_lark);
    for text in &from_gbnf {
        let inner = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')).unwrap_or_else(|| panic!("{text:?}"));
        let items: Vec<&str> = inner.split(',').collect();
        assert!((1..=4).contains(&items.len()), "{text:?}");
        for item in items {
            let letters = !item.is_empty() && item.bytes().all(|b| (b'a'..=b'c').contains(&b));
            let digits = item.len() >= 3
                && item.starts_with('"')
                && item.ends_with('"')
                && item.len() <= 4
                && item[1..item.len() - 1].bytes().all(|b| b.is_ascii_digit());
            assert!(letters || digits, "{text:?}: {item:?}");
        }
    }
}
