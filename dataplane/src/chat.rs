//! Chat prompt rendering with the model's own Jinja template (`tokenizer.chat_template`).

use minijinja::{Environment, ErrorKind, Value, context};
use serde::Serialize;

use crate::{Error, Result};

const TEMPLATE_NAME: &str = "chat";

/// One message as the template sees it (validated by `server::messages`): absent fields
/// are left out, so a template's `message.tool_calls is defined` tests work as with HF.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` only on an assistant turn that carries tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn text(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            ..Self::default()
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compile `source`; syntax errors are reported here, not at the first request.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        // HF renders chat templates with these two options; templates rely on them for
        // their whitespace.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Python string/dict methods (`.strip()`, `.items()`, ...) are common in HF templates.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| template_error("invalid template", &e))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Render as HF's `apply_chat_template` does: `messages`, `tools` (none when absent,
    /// so `{% if tools %}` is false), `add_generation_prompt`, `bos_token`, `eos_token`.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error("template missing", &e))?;
        let messages: Vec<Value> = messages.iter().map(template_message).collect();
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| template_error("rendering failed", &e))
    }
}

/// A message as the template sees it. Tool-call arguments, a JSON string in OpenAI's API,
/// become the object they encode, with the client's key order (as vLLM and llama.cpp give
/// them to templates such as Qwen's, which write `arguments | tojson`); a string that is
/// not JSON stays a string.
fn template_message(m: &ChatMessage) -> Value {
    #[derive(Serialize)]
    struct Message<'a> {
        role: &'a str,
        content: &'a Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        tool_calls: Option<Vec<Value>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        tool_call_id: &'a Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        name: &'a Option<String>,
    }
    let call = |c: &serde_json::Value| -> Value {
        let args = c["function"]["arguments"]
            .as_str()
            .and_then(|a| serde_json::from_str::<Value>(a).ok());
        let Some(args) = args else {
            return Value::from_serialize(c);
        };
        let mut function: Vec<(String, Value)> = c["function"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        for (k, v) in &mut function {
            if k == "arguments" {
                *v = args.clone();
            }
        }
        let fields = c.as_object().into_iter().flatten().map(|(k, v)| {
            let v = if k == "function" {
                Value::from_iter(function.clone())
            } else {
                Value::from_serialize(v)
            };
            (k.clone(), v)
        });
        Value::from_iter(fields)
    };
    Value::from_serialize(Message {
        role: &m.role,
        content: &m.content,
        tool_calls: m
            .tool_calls
            .as_ref()
            .and_then(|c| c.as_array())
            .map(|calls| calls.iter().map(call).collect()),
        tool_call_id: &m.tool_call_id,
        name: &m.name,
    })
}

/// A `--chat-template` file: readable, UTF-8, and a template that compiles.
pub fn read_template_file(path: &std::path::Path) -> Result<String> {
    let src = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    ChatTemplate::new(&src, "", "")
        .map_err(|e| Error::config(format!("--chat-template {}", path.display()), e.to_string()))?;
    Ok(src)
}

/// HF's `tojson`: Python's `json.dumps(value, ensure_ascii=False)` — `", "` and `": "`
/// between items (`","` with `indent`), non-ASCII as is, keys in their order — where
/// minijinja's own filter writes compact, HTML-escaped JSON.
fn tojson(
    value: &Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Walks minijinja's own values, so that maps keep their order (serde_json's would sort).
fn py_json(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind as K;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        K::Seq | K::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                py_json(x, indent, sort, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        K::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if sort {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.to_string()).to_string());
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, sort, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        K::Undefined | K::None => out.push_str("null"),
        // Strings escape as Python's do (quotes, backslashes, control characters);
        // numbers and literals are the same text.
        _ => {
            let j = serde_json::to_value(v).map_err(|e| {
                minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}"))
            })?;
            out.push_str(&j.to_string());
        }
    }
    Ok(())
}

fn template_error(what: &str, e: &minijinja::Error) -> Error {
    // The detail carries the raise_exception message or the failing expression.
    let mut msg = format!("{what}: {e}");
    if let Some(detail) = e.detail().filter(|d| !msg.contains(d)) {
        msg.push_str(&format!(" ({detail})"));
    }
    if let Some(line) = e.line() {
        msg.push_str(&format!(" at line {line}"));
    }
    Error::ChatTemplate(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs.iter().map(|(r, c)| ChatMessage::text(r, c)).collect()
    }

    const CHATML: &str = "{{ bos_token }}{% for m in messages %}\n<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}\n{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn renders_messages_generation_prompt_and_special_tokens() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        let m = msgs(&[("system", "Be brief."), ("user", "  Hi! ")]);
        assert_eq!(
            t.render(&m, true).unwrap(),
            "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(!t.render(&m, false).unwrap().ends_with("assistant\n"));
    }

    #[test]
    fn python_methods_and_eos_work() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m['content'].strip().upper() }}{{ eos_token }}{% endfor %}",
            "",
            "</s>",
        )
        .unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", " a "), ("assistant", "b")]), false)
                .unwrap(),
            "A</s>B</s>"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_clear() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&msgs(&[("user", "x")]), true).unwrap(), "ok");
        let e = t
            .render(&msgs(&[("assistant", "x")]), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Conversation must start with user"), "{e}");
        let e = ChatTemplate::new("{% for m in messages %}", "", "")
            .err()
            .unwrap()
            .to_string();
        assert!(e.starts_with("chat template: invalid template"), "{e}");
    }
}
