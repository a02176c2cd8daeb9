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
