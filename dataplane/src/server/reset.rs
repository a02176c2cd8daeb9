//! `POST /admin/reset` (docs/in-place-reset.md): the operator asks a live prefill or decode
//! to end every room, forget its KV session state and serve at the next group incarnation
//! without exiting. This is the thin HTTP side: the body, the proof
//! (`pd::reset::check_authorization`), the reset itself (`pd::PdSlot::reset`, off the
//! async runtime), then the wait until `/ready` would say ready, and the answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};
use tandem_contract::reset::DEFAULT_TIMEOUT_MS;

use super::params::{self, Obj};
use super::{ApiError, AppState, Body, json_response, ready_checks};
use crate::pd::reset::{Outcome, ProofError, check_authorization};
use crate::pd::{PdSlot, ResetDone, ResetError};

type R<T> = std::result::Result<T, ApiError>;

/// Longest wait for readiness a call may ask for.
pub const MAX_TIMEOUT_MS: u64 = 60_000;
/// How often the wait looks at the checks.
const READY_POLL: Duration = Duration::from_millis(10);

/// What a reset call asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ResetAsk {
    pub(super) group_incarnation: u64,
    pub(super) timeout: Duration,
}

/// The call's body: `{"group_incarnation": N, "timeout_ms": T}` (`timeout_ms` optional,
/// 0..=60000). Anything else is refused with 400 naming the field: a misspelt field must
/// not pass for a default.
pub(super) fn parse_ask(body: &[u8]) -> R<ResetAsk> {
    let o: Obj = params::parse_object(body)?;
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "group_incarnation" | "timeout_ms"))
    {
        return Err(ApiError::invalid(
            Some(k.as_str()),
            format!("unknown field '{k}': a reset takes 'group_incarnation' and 'timeout_ms'"),
        )
        .with_code("unknown_field"));
    }
    let uint = |k: &str, v: &Value| {
        v.as_u64()
            .ok_or_else(|| params::wrong_type(k, "a non-negative integer", v))
    };
    let group_incarnation = match o.get("group_incarnation") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                Some("group_incarnation"),
                "'group_incarnation' is required: the group incarnation to reset to",
            )
            .with_code("missing_field"));
        }
        Some(v) => uint("group_incarnation", v)?,
    };
    let timeout_ms = match o.get("timeout_ms") {
        None | Some(Value::Null) => DEFAULT_TIMEOUT_MS,
        Some(v) => uint("timeout_ms", v)?,
    };
    if timeout_ms > MAX_TIMEOUT_MS {
        return Err(ApiError::invalid(
            Some("timeout_ms"),
            format!("'timeout_ms' must be at most {MAX_TIMEOUT_MS}, got {timeout_ms}"),
        )
        .with_code("out_of_range"));
    }
    Ok(ResetAsk {
        group_incarnation,
        timeout: Duration::from_millis(timeout_ms),
    })
}

fn refused(state: &AppState, outcome: Outcome, e: ApiError) -> ApiError {
    state.metrics.reset(outcome.label());
    e
}

fn unauthorized(state: &AppState, e: ProofError) -> ApiError {
    // The message says what was wrong, never the header's value.
    let e = ApiError {
        status: StatusCode::UNAUTHORIZED,
        kind: "authentication_error",
        ..ApiError::invalid(None, e.message()).with_code("reset_unauthorized")
    };
    refused(state, Outcome::Unauthorized, e)
}

fn draining(state: &AppState) -> ApiError {
    let e = ApiError::server(
        StatusCode::CONFLICT,
        "draining",
        "the member is shutting down (SIGTERM): it resets nothing",
    );
    refused(state, Outcome::Draining, e)
}

pub(super) async fn reset(state: Arc<AppState>, req: Request<Incoming>) -> R<Response<Body>> {
    let arrived = Instant::now();
    let Some(pd) = state.pd.as_ref() else {
        // Routed only for the PD roles.
        return Err(ApiError::not_found("no route for POST /admin/reset"));
    };
    let auth = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes().to_vec());
    if auth.is_none() {
        return Err(unauthorized(&state, ProofError::Missing));
    }
    let body = super::request_body::body(req, state.limits.max_body_bytes).await?;
    let ask = parse_ask(&body)?;
    check_authorization(auth.as_deref(), pd.key(), pd.role(), ask.group_incarnation)
        .map_err(|e| unauthorized(&state, e))?;
    if state.shutdown.is_draining() {
        return Err(draining(&state));
    }
    // Stopping the loops and starting new ones blocks (bounded joins, a bind retry).
    let st = state.clone();
    let to = ask.group_incarnation;
    let done = tokio::task::spawn_blocking(move || match st.pd.as_ref() {
        Some(pd) => pd.reset(to),
        None => Err(ResetError::Failed("no KV channel".into())),
    })
    .await
    .unwrap_or_else(|e| Err(ResetError::Failed(format!("the reset task failed: {e}"))));
    let done = match done {
        Ok(d) => d,
        Err(ResetError::Draining) => return Err(draining(&state)),
        Err(ResetError::Stale {
            current,
            incarnation,
        }) => {
            state.metrics.reset(Outcome::Stale.label());
            let e = ApiError::server(
                StatusCode::CONFLICT,
                "stale_incarnation",
                format!(
                    "asked to reset to group incarnation {to}, older than this member's {current}"
                ),
            );
            let mut body = e.body();
            body["group_incarnation"] = json!(current);
            body["incarnation"] = json!(format!("{incarnation:016x}"));
            tracing::info!(
                group_incarnation = current,
                asked = to,
                status = 409,
                "reset call refused: stale incarnation"
            );
            return Ok(json_response(StatusCode::CONFLICT, &body));
        }
        Err(ResetError::Failed(why)) => {
            return Err(refused(
                &state,
                Outcome::Failed,
                ApiError::server(StatusCode::INTERNAL_SERVER_ERROR, "reset_failed", why),
            ));
        }
    };
    let ready = wait_ready(&state, pd, arrived + ask.timeout).await;
    Ok(answer(&state, &done, ready, arrived.elapsed()))
}

/// Wait until every `/ready` check passes (the channel at the new incarnation included)
/// or `until`; whether it did, and the first failing check at the end when not.
async fn wait_ready(state: &AppState, pd: &PdSlot, until: Instant) -> Result<(), String> {
    loop {
        let checks = ready_checks(state);
        let failing = checks.iter().find(|c| !c.ok);
        match failing {
            None => return Ok(()),
            Some(c) if Instant::now() >= until => {
                return Err(format!(
                    "not ready at group incarnation {}: {} ({}): {}",
                    pd.group_incarnation(),
                    c.name,
                    c.reason.as_deref().unwrap_or(""),
                    c.detail
                ));
            }
            Some(_) => tokio::time::sleep(READY_POLL).await,
        }
    }
}

fn answer(
    state: &AppState,
    done: &ResetDone,
    ready: Result<(), String>,
    took: Duration,
) -> Response<Body> {
    let took_ms = took.as_millis() as u64;
    let mut body = json!({
        "group_incarnation": done.group_incarnation,
        "incarnation": format!("{:016x}", done.incarnation),
        "reset": done.reset,
        "ready": ready.is_ok(),
        "took_ms": took_ms,
        "rooms_ended": done.rooms_ended,
    });
    match ready {
        Ok(()) => {
            state.metrics.reset(
                if done.reset {
                    Outcome::Done
                } else {
                    Outcome::Noop
                }
                .label(),
            );
            if !done.reset {
                tracing::info!(
                    group_incarnation = done.group_incarnation,
                    took_ms,
                    "reset call: already at the group incarnation, and ready"
                );
            }
            json_response(StatusCode::OK, &body)
        }
        Err(why) => {
            state.metrics.reset(Outcome::Incomplete.label());
            tracing::warn!(
                group_incarnation = done.group_incarnation,
                reset = done.reset,
                took_ms,
                reason = "reset_incomplete",
                %why,
                "reset call: not ready within its timeout (the reset stays done; the channel keeps trying)"
            );
            let e = ApiError::server(StatusCode::GATEWAY_TIMEOUT, "reset_incomplete", why);
            body["error"] = e.body()["error"].clone();
            json_response(StatusCode::GATEWAY_TIMEOUT, &body)
        }
    }
}

#[cfg(test)]
mod tests;
