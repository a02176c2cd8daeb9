//! The two calls a router makes to a decode (`tandem_contract::routing`, docs/routing.md):
//!
//! - `GET /tandem/report[?since=V]`: load (queued, running, KV use) and the keys of the
//!   blocks the prefix cache holds; the keys are left out when the cache's version is
//!   still `V`. The first call turns the engine's copying of the keys on
//!   (`prefix_report`).
//! - `POST /tandem/prompt-keys?api=chat|completions`: the chained keys of the whole KV
//!   blocks of the prompt an OpenAI request would run — rendered and tokenized by the
//!   same code the request itself goes through, hashed as the prefix cache hashes — so the
//!   router matches prompts in the engine's own blocks without a tokenizer of its own.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::json;

use super::{ApiError, AppState, Body, completions, json_response, params};
use crate::model::prefix_cache::chain_keys;

fn query_param<'a>(query: Option<&'a str>, key: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

fn hex_keys(keys: &[u64]) -> Vec<String> {
    keys.iter().map(|k| format!("{k:016x}")).collect()
}

pub(super) fn report(state: &AppState, query: Option<&str>) -> Response<Body> {
    let m = &state.metrics;
    m.prefix_report.want();
    let (version, keys) = m.prefix_report.snapshot();
    let used = m.kv_blocks_used.get().max(0) as u64;
    let total = used + m.kv_blocks_free.get().max(0) as u64;
    let mut body = json!({
        "blockTokens": state.kv_block_tokens,
        "waiting": m.waiting.get().max(0),
        "running": m.running.get().max(0),
        "kvBlocksUsed": used,
        "kvBlocksTotal": total,
        "kvCacheUsage": m.kv_cache_usage.get(),
        "prefixVersion": version,
        "engineStalledMs": state.engine.health().progress().stalled_for().as_millis() as u64,
    });
    let since = query_param(query, "since").and_then(|v| v.parse::<u64>().ok());
    if since != Some(version) {
        body["keys"] = json!(hex_keys(&keys));
    }
    json_response(StatusCode::OK, &body)
}

pub(super) fn prompt_keys(
    state: &Arc<AppState>,
    query: Option<&str>,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    let o = params::parse_object(body)?;
    let ids = match query_param(query, "api") {
        Some("chat") => completions::chat_prompt(state, super::messages::parse(&o)?)?,
        Some("completions") => {
            completions::completion_prompt(state, params::prompt(&o, state.tokenizer.vocab_size())?)
        }
        _ => {
            return Err(ApiError::invalid(
                Some("api"),
                "the query must name the API: ?api=chat or ?api=completions",
            ));
        }
    };
    let keys = chain_keys(&ids, state.kv_block_tokens.max(1));
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "blockTokens": state.kv_block_tokens,
            "promptTokens": ids.len(),
            "keys": hex_keys(&keys),
        }),
    ))
}
