//! `POST /v1/chat/completions` and `POST /v1/completions`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::Value;
use tokio::sync::mpsc::Receiver;

use super::api_error::ApiError;
use super::fields::{self, Endpoint};
use super::output::{Kind, Shape, logprobs_json};
use super::params::{self, Common, Prompt};
use super::{AppState, Body, json_response};
use crate::pd::{PdRole, PdRun};
use crate::sampling::limits;
use crate::scheduler::{FailReason, GenEvent, GenerateRequest, KvImport, Transfer};

type R<T> = std::result::Result<T, ApiError>;

/// The request was still in flight at the drain deadline.
fn shutdown_error(state: &AppState) -> ApiError {
    state.metrics.fail("shutdown");
    tracing::warn!(reason = "shutdown", "request ended by the drain deadline");
    ApiError::server(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "shutdown",
        "the server is shutting down: the drain deadline passed before this request finished",
    )
}

/// The decode's KV channel this request began on was reset away (an in-place reset of the
/// group): the request ends with `reset` instead of going on for a group that restarted.
fn reset_error(state: &AppState, run: &PdRun) -> ApiError {
    state.metrics.fail("reset");
    tracing::warn!(
        reason = "reset",
        group_incarnation = run.group_incarnation,
        "request ended by an in-place reset"
    );
    ApiError::server(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "reset",
        format!(
            "this decode was reset in place from group incarnation {} (its group co-restarted) \
             while the request was in flight",
            run.group_incarnation
        ),
    )
}

/// Resolves when `run` (the decode's KV channel a request began on) is reset away; never
/// without one.
async fn reset_away(run: Option<&PdRun>) {
    match run {
        Some(r) => r.reset_away().await,
        None => std::future::pending().await,
    }
}

/// The next engine event, or `Err` when the drain deadline passes or the request's KV
/// channel is reset away first.
async fn next_event(
    state: &AppState,
    run: Option<&PdRun>,
    rx: &mut Receiver<GenEvent>,
) -> R<Option<GenEvent>> {
    tokio::select! {
        ev = rx.recv() => Ok(ev),
        _ = state.shutdown.deadline() => Err(shutdown_error(state)),
        _ = reset_away(run) => Err(reset_error(state, run.expect("only a run is reset away"))),
    }
}

pub async fn chat(state: Arc<AppState>, body: Bytes) -> R<http::Response<Body>> {
    let o = params::parse_object(&body)?;
    fields::check(&o, Endpoint::Chat)?;
    params::check_model(&o, &state.model_name)?;
    let messages = super::messages::parse(&o)?;
    let mut common = params::common(
        &o,
        &["max_tokens", "max_completion_tokens"],
        state.tokenizer.vocab_size(),
    )?;
    if params::opt_bool(&o, "logprobs")?.unwrap_or(false) {
        let n = params::opt_int(&o, "top_logprobs", 0)?.unwrap_or(0);
        if n > limits::MAX_LOGPROBS as i64 {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("'top_logprobs' must be at most {}", limits::MAX_LOGPROBS),
            ));
        }
        common.sampling.logprobs = Some(n as usize);
    }
    let ids = chat_prompt(&state, messages)?;
    generate(state, Kind::Chat, ids, common).await
}

/// The token ids of the prompt a chat request runs: its messages rendered with the chat
/// template and tokenized (also what `POST /tandem/prompt-keys` hashes, so that a
/// router's keys are exactly the engine's).
pub(super) fn chat_prompt(
    state: &AppState,
    messages: Vec<crate::chat::ChatMessage>,
) -> R<Vec<u32>> {
    let chat = state.chat.as_ref().ok_or_else(|| {
        ApiError::invalid(
            None,
            format!(
                "model '{}' has no chat template (the GGUF file has no tokenizer.chat_template,                  as base models do): use /v1/completions, or start the server with                  --chat-template FILE",
                state.model_name
            ),
        )
        .with_code("chat_template_missing")
    })?;
    // Content stays text: control-token texts in it are broken before the template sees
    // them (`Tokenizer::protect`) and restored as plain text when the rendered prompt is
    // tokenized.
    let messages: Vec<_> = messages
        .into_iter()
        .map(|mut m| {
            m.content = m.content.map(|c| state.tokenizer.protect(&c));
            m
        })
        .collect();
    let text = chat
        .render(&messages, true)
        .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
    // The template writes the special tokens itself (e.g. <|im_start|>), so they are parsed;
    // BOS is added only when the model asks for it and the template did not write it.
    let mut ids = state.tokenizer.encode_rendered(&text, false);
    if let Some(bos) = state.tokenizer.bos_id().filter(|_| state.add_bos)
        && ids.first() != Some(&bos)
    {
        ids.insert(0, bos);
    }
    Ok(ids)
}

pub async fn completions(state: Arc<AppState>, body: Bytes) -> R<http::Response<Body>> {
    let o = params::parse_object(&body)?;
    fields::check(&o, Endpoint::Completions)?;
    params::check_model(&o, &state.model_name)?;
    let prompt = params::prompt(&o, state.tokenizer.vocab_size())?;
    let mut common = params::common(&o, &["max_tokens"], state.tokenizer.vocab_size())?;
    if let Some(n) = params::opt_int(&o, "logprobs", 0)? {
        if n > limits::MAX_LOGPROBS as i64 {
            return Err(ApiError::invalid(
                Some("logprobs"),
                format!("'logprobs' must be at most {}", limits::MAX_LOGPROBS),
            ));
        }
        common.sampling.logprobs = Some(n as usize);
    }
    let ids = completion_prompt(&state, prompt);
    generate(state, Kind::Text, ids, common).await
}

/// The token ids of a completion request's prompt.
pub(super) fn completion_prompt(state: &AppState, prompt: Prompt) -> Vec<u32> {
    match prompt {
        Prompt::Text(t) => state.tokenizer.encode(&t, true, true),
        Prompt::Tokens(ids) => ids,
    }
}

async fn generate(
    state: Arc<AppState>,
    kind: Kind,
    prompt: Vec<u32>,
    mut c: Common,
) -> R<http::Response<Body>> {
    let ctx = state.context_length;
    if prompt.is_empty() {
        return Err(ApiError::invalid(Some("prompt"), "the prompt is empty"));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(
            Some("messages"),
            format!(
                "the prompt has {} tokens; the context length is {ctx}",
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = ctx - prompt.len();
    let max_tokens = match c.max_tokens {
        Some(n) if n > room => {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                format!(
                    "prompt ({} tokens) + max_tokens ({n}) exceeds the context length {ctx}",
                    prompt.len()
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Some(n) => n,
        // Without max_tokens, a min_tokens above the default raises it (up to the room).
        None => state.default_max_tokens.max(c.min_tokens).min(room),
    };
    if c.min_tokens > max_tokens {
        let why = match c.max_tokens {
            Some(_) => format!(
                "'min_tokens' ({}) is more than 'max_tokens' ({max_tokens})",
                c.min_tokens
            ),
            None => format!(
                "'min_tokens' ({}) does not fit: prompt ({} tokens) + min_tokens exceeds the context length {ctx}",
                c.min_tokens,
                prompt.len()
            ),
        };
        return Err(ApiError::invalid(Some("min_tokens"), why));
    }
    // What ends generation: the model's end-of-generation tokens (unless ignore_eos) and
    // the request's stop_token_ids. min_tokens masks them until it is reached; the
    // sampling parameters carry the list so that a prefill masks the first token too.
    let mut stop_token_ids = if c.ignore_eos {
        Vec::new()
    } else {
        state.tokenizer.end_of_generation().to_vec()
    };
    for id in std::mem::take(&mut c.stop_token_ids) {
        if !stop_token_ids.contains(&id) {
            stop_token_ids.push(id);
        }
    }
    if c.min_tokens > 0 {
        c.sampling.min_tokens = c.min_tokens;
        c.sampling.min_tokens_masked = stop_token_ids.clone();
    }
    // The one check of every limit (the parsing above names the request's own fields).
    c.sampling
        .validate()
        .map_err(|e| ApiError::invalid(Some(e.field), e.to_string()))?;
    // Decode role: the engine reserves the sequence's KV blocks first (queueing for
    // them, or refusing a request that can never fit); only then does a room open on a
    // prefill, whose KV and first token go straight into the reserved sequence. Dropping
    // this future (client gone) aborts the room; the room frees the blocks when it ends.
    // The run of the KV channel this request begins on: an in-place reset replaces it, and
    // the request then ends with `reset`.
    let run = state
        .pd
        .as_ref()
        .map(|pd| pd.current())
        .filter(|r| matches!(r.role, PdRole::Decode(_)));
    let decode = match run.as_deref() {
        Some(PdRun {
            role: PdRole::Decode(d),
            ..
        }) => Some(d),
        _ => None,
    };
    let (transfer, kv_tx) = match decode {
        Some(_) => {
            let (tx, slot) = KvImport::channel();
            (Transfer::Import(Arc::new(slot)), Some(tx))
        }
        None => (Transfer::None, None),
    };
    let pd_prompt = decode.map(|_| (prompt.clone(), c.sampling.clone()));
    let req = GenerateRequest {
        prompt,
        max_tokens,
        sampling: c.sampling,
        stop: c.stop,
        stop_token_ids,
        transfer,
    };
    let mut rx = state.engine.submit(req).map_err(ApiError::from_submit)?;
    // Wait for the first event before answering, so that failures before the first token
    // (queue timeout, request too large) get a proper HTTP status even when streaming.
    let mut first = next_event(&state, run.as_deref(), &mut rx).await?;
    if let (Some(d), Some(kv_tx), Some((prompt, sampling))) = (decode, kv_tx, pd_prompt) {
        let cached = match first {
            Some(GenEvent::KvReserved { cached }) => cached,
            Some(GenEvent::Failed { reason, message }) => {
                return Err(ApiError::from_failure(reason, message));
            }
            _ => {
                return Err(ApiError::server(
                    http::StatusCode::INTERNAL_SERVER_ERROR,
                    "engine_stopped",
                    "the engine ended the request without reserving KV",
                ));
            }
        };
        let room = tokio::select! {
            r = d.prefill(&prompt, cached, &sampling, kv_tx) => r,
            _ = state.shutdown.deadline() => return Err(shutdown_error(&state)),
            // The reset ends the room itself (with `reset`, pushed to the prefill) before it
            // marks the run: this only ends a room whose loop did not stop in time.
            _ = reset_away(run.as_deref()) => {
                return Err(reset_error(&state, run.as_deref().expect("reset away")))
            }
        };
        if let Err(f) = room {
            state.metrics.fail(FailReason::KvTransfer.label());
            return Err(ApiError::server(
                http::StatusCode::SERVICE_UNAVAILABLE,
                f.code.label(),
                f.message,
            ));
        }
        first = next_event(&state, run.as_deref(), &mut rx).await?;
    }
    if let Some(GenEvent::Failed { reason, message }) = first {
        return Err(ApiError::from_failure(reason, message));
    }
    let shape = Shape::new(kind, &state.model_name);
    if c.stream {
        let include_usage = c.include_usage;
        Ok(sse_response(Sse {
            state,
            run,
            shape,
            rx,
            first,
            include_usage,
            role_sent: false,
            done: false,
            text_len: 0,
        }))
    } else {
        whole(state, run, shape, rx, first).await
    }
}

async fn whole(
    state: Arc<AppState>,
    run: Option<Arc<PdRun>>,
    shape: Shape,
    mut rx: Receiver<GenEvent>,
    first: Option<GenEvent>,
) -> R<http::Response<Body>> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut ev = first;
    loop {
        match ev {
            Some(GenEvent::Token {
                text: t, logprob, ..
            }) => {
                text.push_str(&t);
                lps.extend(logprob);
            }
            Some(GenEvent::Done {
                reason,
                text: t,
                usage,
            }) => {
                text.push_str(&t);
                let lp =
                    (!lps.is_empty()).then(|| logprobs_json(shape.kind, &state.tokenizer, &lps, 0));
                return Ok(json_response(
                    http::StatusCode::OK,
                    &shape.full(&text, lp, reason, usage),
                ));
            }
            Some(GenEvent::Failed { reason, message }) => {
                return Err(ApiError::from_failure(reason, message));
            }
            // Only prefill-role requests export KV; nothing to show here.
            Some(
                GenEvent::KvExported(_) | GenEvent::KvReserved { .. } | GenEvent::Progress { .. },
            ) => {}
            None => {
                return Err(ApiError::server(
                    http::StatusCode::INTERNAL_SERVER_ERROR,
                    "engine_stopped",
                    "the engine ended the request without a result",
                ));
            }
        }
        ev = next_event(&state, run.as_deref(), &mut rx).await?;
    }
}

/// State of one SSE response. Dropping it (client gone) drops the engine receiver, which
/// the engine sees as an abort.
struct Sse {
    state: Arc<AppState>,
    /// A decode's KV channel the request began on (it ends with `reset` when that is reset).
    run: Option<Arc<PdRun>>,
    shape: Shape,
    rx: Receiver<GenEvent>,
    first: Option<GenEvent>,
    /// `stream_options.include_usage`: one more chunk with empty `choices` and the usage,
    /// as OpenAI sends it. (The finishing chunk always carries `usage` too.)
    include_usage: bool,
    role_sent: bool,
    done: bool,
    /// Bytes of text sent so far (completions' `text_offset`).
    text_len: usize,
}

impl Sse {
    /// SSE bytes for the next event; empty when it carried nothing to show.
    fn render(&mut self, ev: Option<GenEvent>) -> Vec<u8> {
        let mut out = Vec::new();
        let mut push = |v: &Value| {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(v.to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        };
        let role = self.shape.kind == Kind::Chat && !self.role_sent;
        match ev {
            Some(GenEvent::Token { text, logprob, .. }) => {
                if text.is_empty() && logprob.is_none() && !role {
                    return out;
                }
                let lps: Vec<_> = logprob.into_iter().collect();
                let lp = (!lps.is_empty()).then(|| {
                    logprobs_json(self.shape.kind, &self.state.tokenizer, &lps, self.text_len)
                });
                self.text_len += text.len();
                push(&self.shape.chunk(&text, role, lp, None, None));
                self.role_sent = true;
            }
            Some(GenEvent::Done {
                reason,
                text,
                usage,
            }) => {
                push(
                    &self
                        .shape
                        .chunk(&text, role, None, Some(reason), Some(usage)),
                );
                if self.include_usage {
                    push(&self.shape.usage_chunk(usage));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Some(
                GenEvent::KvExported(_) | GenEvent::KvReserved { .. } | GenEvent::Progress { .. },
            ) => {
                return out;
            }
            Some(GenEvent::Failed { reason, message }) => {
                push(&ApiError::from_failure(reason, message).body());
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            None => {
                let e = ApiError::server(
                    http::StatusCode::INTERNAL_SERVER_ERROR,
                    "engine_stopped",
                    "the engine ended the request without a result",
                );
                push(&e.body());
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
        }
        out
    }
}

fn sse_response(sse: Sse) -> http::Response<Body> {
    let stream = futures::stream::unfold(sse, |mut s| async move {
        loop {
            if s.done {
                return None;
            }
            let ev = match s.first.take() {
                Some(e) => Ok(Some(e)),
                None => next_event(&s.state, s.run.as_deref(), &mut s.rx).await,
            };
            let bytes = match ev {
                Ok(ev) => s.render(ev),
                Err(e) => {
                    // The drain deadline or a reset: end the stream with the reason, then
                    // [DONE].
                    s.done = true;
                    format!("data: {}\n\ndata: [DONE]\n\n", e.body()).into_bytes()
                }
            };
            if !bytes.is_empty() {
                return Some((Ok::<_, Infallible>(Frame::data(Bytes::from(bytes))), s));
            }
        }
    });
    http::Response::builder()
        .status(http::StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "text/event-stream")
        .header(http::header::CACHE_CONTROL, "no-cache")
        .body(StreamBody::new(stream).boxed_unsync())
        .unwrap_or_else(|_| http::Response::new(Full::new(Bytes::new()).boxed_unsync()))
}
