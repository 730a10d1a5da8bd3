//! A chat template is code from the model file: one that loops, recurses or writes without end
//! must stop quickly with an error naming the limit it hit, and the template must still render
//! after it.

use crate::common;

use std::time::Duration;
use webgpu_llm::chat::{
    ChatTemplate, Message, MAX_TEMPLATE_INSTRUCTIONS, MAX_TEMPLATE_OUTPUT_BYTES, MAX_TEMPLATE_RECURSION,
};
use webgpu_llm::Error;

/// CPU time, generous for a slow machine: each case stops in well under a second on a fast one.
const PATIENCE: Duration = Duration::from_secs(5);

/// A template that runs `hostile` when the first message says "attack" and echoes the message
/// otherwise, so one template shows both the error and a normal render after it.
fn template(hostile: &str) -> ChatTemplate {
    let source = format!(
        "{{% if messages[0].content == 'attack' %}}{hostile}{{% else %}}[{{{{ messages[0].content }}}}]{{% endif %}}"
    );
    ChatTemplate::new(&source, String::new(), String::new()).unwrap()
}

/// Renders the hostile branch, checks it fails in time with a message naming `limit`, then
/// renders a normal chat with the same template.
fn assert_stopped(hostile: &str, limit: &str) {
    let t = template(hostile);
    let start = common::thread_cpu_time();
    let err = t.render(&[Message::new("user", "attack")], true).unwrap_err();
    let elapsed = common::thread_cpu_time() - start;
    eprintln!("{limit} limit: {elapsed:?} for {}", hostile.get(..80).unwrap_or(hostile));
    let msg = err.to_string();
    assert!(matches!(err, Error::ChatTemplate(_)), "{msg}");
    assert!(msg.contains("tokenizer.chat_template"), "{msg}");
    assert!(msg.contains(&format!("{limit} limit")), "expected the {limit} limit: {msg}");
    let quoted = match limit {
        "instruction" => format!("{MAX_TEMPLATE_INSTRUCTIONS} instructions"),
        "output" => format!("{} MiB", MAX_TEMPLATE_OUTPUT_BYTES >> 20),
        _ => format!("{MAX_TEMPLATE_RECURSION} levels"),
    };
    assert!(msg.contains(&quoted), "the message quotes the limit ({quoted}): {msg}");
    assert!(elapsed < PATIENCE, "stopping took {elapsed:?}");
    assert_eq!(t.render(&[Message::new("user", "hello")], true).unwrap(), "[hello]");
}

#[test]
fn nested_loops_stop_at_the_instruction_limit() {
    assert_stopped("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "instruction");
    // No output at all: only the instruction count can stop it.
    assert_stopped("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "instruction");
}

#[test]
fn recursive_macros_stop_at_the_instruction_or_recursion_limit() {
    // 2^30 calls, never deeper than 30.
    assert_stopped(
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(30) }}",
        "instruction",
    );
    // Deeper without end.
    assert_stopped("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion");
}

#[test]
fn huge_output_stops_at_the_output_limit() {
    // One expression of 100 MB (not a constant, which minijinja would fold when compiling).
    assert_stopped("{{ 'x' * (100000000 * messages | length) }}", "output");
    // A loop of expressions, and a loop of the template's own text (10^5 x 1000 bytes each).
    assert_stopped("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output");
    let literal = "z".repeat(1000);
    assert_stopped(&format!("{{% for i in range(100000) %}}{literal}{{% endfor %}}"), "output");
    // Text built out of sight of the prompt: in a `set` block, and doubled by a macro.
    assert_stopped(
        "{% set s %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}{{ s | length }}",
        "output",
    );
    assert_stopped(
        &format!("{{% macro f(n) %}}{{% if n > 0 %}}{{{{ f(n - 1) }}}}{{{{ f(n - 1) }}}}{{% else %}}{literal}{{% endif %}}{{% endmacro %}}{{{{ f(40) | length }}}}"),
        "output",
    );
}

#[test]
fn the_limits_leave_real_templates_wide_room() {
    let golden = common::golden("chat.json");
    let t = ChatTemplate::new(golden["chat_template"].as_str().unwrap(), String::new(), String::new()).unwrap();
    // A chat of 20 000 turns (far more than a context window holds) renders whole.
    let chat: Vec<Message> =
        (0..20_000).map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, format!("turn {i}"))).collect();
    let text = t.render(&chat, true).unwrap();
    assert!(text.ends_with(
        "<|im_start|>user\nturn 19998<|im_end|>\n<|im_start|>assistant\nturn 19999<|im_end|>\n<|im_start|>assistant\n"
    ));
    // As does a message of 4 MB, about a million tokens.
    let long = "word ".repeat(800_000);
    let text = t.render(&[Message::new("user", long.clone())], true).unwrap();
    assert!(text.len() > long.len() && text.contains(&long));
    // A recursive macro 30 levels deep (a nested tool schema) is within the recursion limit.
    let nested = ChatTemplate::new(
        "{% macro f(n) %}{% for i in [n] %}{% if n > 0 %}({{ f(n - 1) }}){% endif %}{% endfor %}{% endmacro %}{{ f(30) }}",
        String::new(),
        String::new(),
    )
    .unwrap();
    assert_eq!(nested.render(&[], false).unwrap(), format!("{}{}", "(".repeat(30), ")".repeat(30)));
}
