//! OpenAI response shapes for chat and text completions (whole and streamed chunks).

use serde_json::{Value, json};

use crate::sampling::TokenLogprob;
use crate::scheduler::{FinishReason, Usage};
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
}

/// Identity of one response: every chunk of a stream repeats it.
pub struct Shape {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Shape {
    pub fn new(kind: Kind, model: &str) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            kind,
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created,
            model: model.to_owned(),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choice: Value, usage: Option<Usage>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(u) = usage {
            v["usage"] = usage_json(u);
        }
        v
    }

    /// The non-streamed response.
    pub fn full(
        &self,
        text: &str,
        lps: Option<Value>,
        finish: FinishReason,
        usage: Usage,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": lps,
                "finish_reason": finish.as_str(),
            }),
            Kind::Text => {
                json!({"index": 0, "text": text, "logprobs": lps, "finish_reason": finish.as_str()})
            }
        };
        self.envelope(false, choice, Some(usage))
    }

    /// One streamed chunk. Chat's first chunk announces the role.
    pub fn chunk(
        &self,
        text: &str,
        role: bool,
        lps: Option<Value>,
        finish: Option<FinishReason>,
        usage: Option<Usage>,
    ) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if !text.is_empty() || role {
                    delta.insert("content".into(), text.into());
                }
                json!({"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish})
            }
            Kind::Text => {
                json!({"index": 0, "text": text, "logprobs": lps, "finish_reason": finish})
            }
        };
        self.envelope(true, choice, usage)
    }
}

impl Shape {
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.envelope(true, Value::Null, Some(usage));
        v["choices"] = json!([]);
        v
    }
}

pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        // As OpenAI reports it: prompt tokens whose KV was reused from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Log-probabilities in the endpoint's format; `text_offset` counts bytes of text so far.
pub fn logprobs_json(
    kind: Kind,
    tok: &Tokenizer,
    lps: &[TokenLogprob],
    text_offset: usize,
) -> Value {
    let text = |id: u32| tok.token_text(id).unwrap_or_default();
    match kind {
        Kind::Chat => {
            let entry = |id: u32, lp: f32| json!({"token": text(id), "logprob": lp, "bytes": text(id).into_bytes()});
            let content: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let mut e = entry(l.token, l.logprob);
                    e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                    e
                })
                .collect();
            json!({"content": content})
        }
        Kind::Text => {
            let mut offset = text_offset;
            let mut offsets = Vec::new();
            for l in lps {
                offsets.push(offset);
                offset += text(l.token).len();
            }
            json!({
                "tokens": lps.iter().map(|l| text(l.token)).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|l| {
                    l.top.iter().map(|&(id, lp)| (text(id), json!(lp))).collect::<serde_json::Map<_, _>>()
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}
