//! API keys on the decode's own OpenAI port (`--api-key`, `--api-key-file`): `/v1/*` and
//! the router calls (`/tandem/*`: they tell what prompts are cached) need
//! `Authorization: Bearer <key>` when keys are set; everything else — `/health`,
//! `/ready`, `/metrics`, and calls with their own scheme like the in-place reset — is left
//! as it was. The check, the constant-time comparison and the 401 body are
//! `tandem_contract::api_keys`', the router's too, so both answer alike. A key is never
//! logged: the log line names the refusal's reason only.

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};

use super::{AppState, Body};

/// Paths that need a key when keys are set.
pub(super) fn gated(path: &str) -> bool {
    path.starts_with("/v1/") || path.starts_with("/tandem/")
}

/// The 401 to answer instead of serving `path`, if the request's key is refused.
pub(super) fn refuse(state: &AppState, path: &str, headers: &HeaderMap) -> Option<Response<Body>> {
    if state.api_keys.is_empty() || !gated(path) {
        return None;
    }
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let refusal = state.api_keys.check(auth).err()?;
    tracing::info!(%path, reason = refusal.code(), "request refused: no valid API key");
    state.metrics.rejected(refusal.code());
    let mut r = super::json_response(
        StatusCode::UNAUTHORIZED,
        &serde_json::from_str(&refusal.body()).unwrap_or_default(),
    );
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(tandem_contract::api_keys::WWW_AUTHENTICATE),
    );
    Some(r)
}
