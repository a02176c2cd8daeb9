//! `/ready`: every check of this process (the engine, the drain, the PD channel) and the
//! body whose format docs/readiness.md documents. Each turn of the answer — ready to not
//! ready, one reason to another, back to ready — is logged once with its reason and
//! counted (`tandem_not_ready_total{reason}`), so a member that a probe took out of its
//! Service says why in its own log, also when the spell lasted a second.

use std::sync::Mutex;
use std::time::Instant;

use http::{Response, StatusCode};
use serde_json::{Value, json};

use super::{AppState, Body, json_response};
use crate::metrics::{Metrics, ReasonLabels};

/// Version of the `/ready` body's format (docs/readiness.md); bumped on any change that
/// could break a reader.
pub const READY_FORMAT: u32 = 1;

/// Every `/ready` check of this process: the engine, the drain, and the PD channel.
pub fn ready_checks(state: &AppState) -> Vec<crate::pd::Check> {
    use crate::pd::Check;
    let health = state.engine.health();
    let age = health.heartbeat_age();
    let engine = if health.stopped() {
        Check::new(
            "engine_heartbeat",
            false,
            "engine_stopped",
            "engine thread stopped".into(),
        )
    } else {
        Check::new(
            "engine_heartbeat",
            age <= state.max_heartbeat_age,
            "engine_stalled",
            format!(
                "engine loop last went round {} ms ago (limit {} ms)",
                age.as_millis(),
                state.max_heartbeat_age.as_millis()
            ),
        )
    };
    let draining = state.shutdown.is_draining();
    let mut checks = vec![
        engine,
        Check::new(
            "not_draining",
            !draining,
            "draining",
            if draining {
                "shutting down: not accepting new requests".into()
            } else {
                "accepting requests".into()
            },
        ),
        state
            .progress
            .check(health, &state.metrics, state.no_progress),
    ];
    if let Some(pd) = &state.pd {
        checks.extend(pd.checks());
    }
    checks
}

/// The `/ready` body (format in docs/readiness.md): `ready`, and when not, the first
/// failing check's `reason`, `message` and `stalled`; the group incarnation; every check; every KV
/// peer with its state and last refusal and failure.
pub fn ready_body(state: &AppState) -> Value {
    let checks = ready_checks(state);
    let failing = checks.iter().find(|c| !c.ok);
    let peers: Vec<Value> = state
        .pd
        .as_ref()
        .map(|pd| pd.peers().iter().map(|p| p.to_json()).collect())
        .unwrap_or_default();
    json!({
        "format": READY_FORMAT,
        "ready": failing.is_none(),
        "role": state.role,
        // The group incarnation the KV channel is at (an in-place reset moves it; `null`
        // for `both`, which has no group).
        "group_incarnation": state.pd.as_ref().map(|pd| pd.group_incarnation()),
        "reason": failing.map(|c| c.reason.clone()),
        "message": failing.map(|c| format!("{}: {}", c.name, c.detail)),
        // What stalled, when the first failing check says (`no_progress`: `engine` or
        // `kv_transfer`); the operator reads it to choose between a reset and new pods.
        "stalled": failing.and_then(|c| c.stalled),
        "checks": checks
            .iter()
            .map(|c| {
                let mut v = json!({"name": c.name, "ok": c.ok, "reason": c.reason, "detail": c.detail});
                if let Some(part) = c.stalled {
                    v["stalled"] = part.into();
                }
                v
            })
            .collect::<Vec<_>>(),
        "peers": peers,
    })
}

/// The last answer of `/ready` (None: ready), kept between probes to see its turns.
#[derive(Debug, Default)]
pub struct ReadinessWatch(Mutex<Option<NotReady>>);

#[derive(Debug)]
struct NotReady {
    reason: String,
    since: Instant,
}

impl ReadinessWatch {
    /// Log and count the turn `body` makes from the previous answer, if any.
    fn observe(&self, body: &Value, metrics: &Metrics) {
        let Ok(mut last) = self.0.lock() else { return };
        let incarnation = &body["group_incarnation"];
        match (body["reason"].as_str(), last.as_ref()) {
            (Some(reason), prev) if prev.is_none_or(|p| p.reason != reason) => {
                metrics
                    .not_ready
                    .get_or_create(&ReasonLabels {
                        reason: reason.into(),
                    })
                    .inc();
                let message = body["message"].as_str().unwrap_or_default();
                let was = prev.map(|p| p.reason.as_str()).unwrap_or("ready");
                // A drain is the process's own decision, announced where it starts.
                if reason == "draining" {
                    tracing::info!(reason, %incarnation, was, %message, "not ready");
                } else {
                    tracing::warn!(reason, %incarnation, was, %message, "not ready");
                }
                *last = Some(NotReady {
                    reason: reason.into(),
                    since: prev.map(|p| p.since).unwrap_or_else(Instant::now),
                });
            }
            (None, Some(prev)) => {
                tracing::info!(
                    was = %prev.reason,
                    not_ready_ms = prev.since.elapsed().as_millis() as u64,
                    %incarnation,
                    "ready again"
                );
                *last = None;
            }
            _ => {}
        }
    }
}

pub(super) fn ready(state: &AppState) -> Response<Body> {
    let body = ready_body(state);
    state.readiness.observe(&body, &state.metrics);
    let status = if body["ready"] == true {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, &body)
}
