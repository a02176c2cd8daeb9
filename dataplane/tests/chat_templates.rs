//! Each model's own chat template, rendered by Tandem (minijinja) and by jinja2 as HF
//! transformers renders it (scripts/chat_template_reference.py): the same text, byte for
//! byte, for conversations that take every branch of the templates — Qwen2.5's default
//! system prompt, `tools` (schemas with nested objects and non-ASCII text), assistant turns
//! that only call tools, runs of tool results, a system message after the first turn — and
//! SmolLM2's. Only the GGUF header is read.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use tandem_dataplane::chat::{ChatMessage, ChatTemplate};
use tandem_dataplane::gguf::Gguf;
use tandem_dataplane::tokenizer::{self, Tokenizer};

fn python() -> String {
    std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| {
        let venv = common::repo_root().join(".venv/bin/python");
        if venv.is_file() {
            venv.display().to_string()
        } else {
            "python3".into()
        }
    })
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::text(role, content)
}

/// A tool call as OpenAI's API sends it: the arguments a JSON string.
fn call(name: &str, args: &str) -> Value {
    json!({"id": format!("call_{name}"), "type": "function", "function": {"name": name, "arguments": args}})
}

fn tool_result(id: &str, content: &str) -> ChatMessage {
    ChatMessage {
        tool_call_id: Some(id.into()),
        ..msg("tool", content)
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Météo d'une ville <à jour>",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "城市"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"]}}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    ])
}

/// (messages, tools, add_generation_prompt) cases.
fn cases() -> Vec<(Vec<ChatMessage>, Option<Value>, bool)> {
    let assistant_calls = ChatMessage {
        role: "assistant".into(),
        content: None,
        tool_calls: Some(json!([
            // Keys out of alphabetical order: they must stay in this order.
            call("get_weather", r#"{"unit": "celsius", "city": "Paris"}"#),
            call("now", "{}")
        ])),
        ..Default::default()
    };
    vec![
        (vec![msg("user", "Hi!")], None, true),
        (
            vec![msg("system", "Be terse."), msg("user", "Hi!")],
            None,
            true,
        ),
        (
            vec![
                msg("system", "Be terse."),
                msg("user", "  2+2?\n"),
                msg("assistant", "4"),
                msg("user", "And 日本語? 🙂 <|im_start|> \t tabs"),
            ],
            None,
            false,
        ),
        (vec![msg("user", "Weather in Paris?")], Some(tools()), true),
        (
            vec![
                msg("system", "You call tools."),
                msg("user", "Weather in Paris, and the time?"),
                assistant_calls,
                tool_result("call_get_weather", "{\"temp\": 21}"),
                tool_result("call_now", "12:00"),
                msg("assistant", "21°C at noon."),
                msg("user", "Thanks"),
            ],
            Some(tools()),
            true,
        ),
        (
            vec![
                msg("user", "a"),
                msg("system", "late system"),
                msg("user", "b"),
            ],
            None,
            true,
        ),
    ]
}

fn check(file: &str) {
    let g = Gguf::open(&common::model_file(file)).unwrap();
    let source = tokenizer::chat_template(&g)
        .unwrap()
        .expect("a chat template");
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default();
    let (bos, eos) = (text(tok.bos_id()), text(tok.eos_id()));
    let t = ChatTemplate::new(&source, &bos, &eos).unwrap();
    let cases = cases();
    let req = json!({
        "template": source,
        // The reference parses tool-call arguments into objects (Python keeps their order),
        // as vLLM and llama.cpp do before rendering.
        "parse_tool_arguments": true,
        "cases": cases.iter().map(|(m, tools, add_gen)| json!({
            "messages": m, "tools": tools, "add_generation_prompt": add_gen,
            "bos_token": bos, "eos_token": eos,
        })).collect::<Vec<_>>(),
    });
    let mut child = Command::new(python())
        .arg(common::repo_root().join("scripts/chat_template_reference.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python (run `make pyenv`)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(req.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "reference failed (run `make pyenv` for jinja2): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    for (i, ((m, tools, add_gen), w)) in cases.iter().zip(&want).enumerate() {
        let got = t.render_with_tools(m, tools.as_ref(), *add_gen);
        match (w["text"].as_str(), got) {
            (Some(w), Ok(g)) => assert_eq!(g, w, "{file} case {i}"),
            (None, Err(e)) => eprintln!("{file} case {i}: both refuse ({e})"),
            (w, g) => panic!("{file} case {i}: HF {w:?} vs Tandem {g:?}"),
        }
    }
    eprintln!("{file}: {} renderings equal HF's", cases.len());
}

#[test]
fn qwen2_5_template_renders_as_hf() {
    check("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

#[test]
fn smollm2_template_renders_as_hf() {
    check("SmolLM2-135M-Instruct.Q4_1.gguf");
}
