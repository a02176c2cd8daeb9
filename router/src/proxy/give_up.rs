//! When the router gives up on an attempt before the first byte of its answer, and how the
//! attempt failed ([`Failure`]): the decode failed it (refused, closed, a 5xx), or the
//! router took it back — the decode went silent, its engine stalled, or its group left
//! Ready (docs/routing.md item 7).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Response, StatusCode, header};
use tokio::sync::watch;

use super::{Body, error, full, strip_hop_by_hop};
use crate::fleet::{Hung, Target, TargetState, Targets};

/// How one attempt failed before the first byte of its answer.
pub(super) enum Failure {
    Connect(String),
    Closed(String),
    BodyBeforeFirstByte(String),
    /// Taken back before its first byte: the decode's engine stopped stepping.
    EngineStalled(String),
    /// Taken back before its first byte: the decode stopped answering report calls.
    Unresponsive(String),
    /// Taken back before its first byte: the decode's group left Ready (the operator saw
    /// the group fail) and stayed out for the limit.
    GroupNotReady(String),
    Status {
        parts: http::response::Parts,
        body: Bytes,
    },
}

impl Failure {
    pub(super) fn reason(&self) -> &'static str {
        match self {
            Self::Connect(_) => "connect_failed",
            Self::Closed(_) => "closed_before_response",
            Self::BodyBeforeFirstByte(_) => "closed_before_first_byte",
            Self::EngineStalled(_) => "engine_stalled",
            Self::Unresponsive(_) => "decode_unresponsive",
            Self::GroupNotReady(_) => "group_not_ready",
            Self::Status { parts, .. } => match parts.status.as_u16() {
                500 => "status_500",
                502 => "status_502",
                503 => "status_503",
                504 => "status_504",
                _ => "status_5xx",
            },
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Self::Connect(w)
            | Self::Closed(w)
            | Self::BodyBeforeFirstByte(w)
            | Self::EngineStalled(w)
            | Self::Unresponsive(w)
            | Self::GroupNotReady(w) => w.clone(),
            Self::Status { parts, body } => format!(
                "answered {}: {}",
                parts.status.as_u16(),
                String::from_utf8_lossy(&body[..body.len().min(300)])
            ),
        }
    }

    /// The answer the client gets when this was the last attempt: a decode's own error
    /// answer as it gave it, 503 `decode_unresponsive` when the decode went silent, else
    /// 503 when no decode could be reached, else 502.
    pub(super) fn into_response(self, all_unreachable: bool) -> Response<Body> {
        match self {
            Self::Status { mut parts, body } => {
                strip_hop_by_hop(&mut parts.headers);
                parts.headers.remove(header::CONTENT_LENGTH);
                Response::from_parts(parts, full(body))
            }
            Self::Unresponsive(w) => {
                error(StatusCode::SERVICE_UNAVAILABLE, "decode_unresponsive", &w)
            }
            f if all_unreachable => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "upstream_unreachable",
                &f.describe(),
            ),
            f => error(StatusCode::BAD_GATEWAY, "upstream_failed", &f.describe()),
        }
    }
}

/// Resolves once `state` has been hung for `limit` — the decode silent, or (when
/// `engine_too`: the request can move elsewhere) its engine stalled; checked each poll
/// period — with how; never while it steps and answers. A stalled engine with nowhere
/// better to go keeps the request (the stall may pass); a silent decode answers nothing at
/// all, so waiting on it only delays the client's own retry.
pub(super) async fn hung_past(state: &TargetState, limit: Duration, engine_too: bool) -> Hung {
    loop {
        if let Some(d) = state.silent_for().filter(|d| *d >= limit) {
            return Hung::Silent(d);
        }
        if let Some(h @ Hung::EngineStalled(_)) = state.hung(limit).filter(|_| engine_too) {
            return h;
        }
        tokio::time::sleep(crate::fleet::POLL_PERIOD).await;
    }
}

/// Resolves once `t` has been out of the eligible targets — its group left Ready (the
/// operator saw a member fail its probes), or the decode was replaced — for `limit`
/// without coming back, with how long. A group that turns Ready again within the limit
/// (a probe that failed once) keeps the request.
pub(super) async fn out_of_ready_past(
    targets: &watch::Receiver<Arc<Targets>>,
    t: &Target,
    limit: Duration,
) -> Duration {
    let mut rx = targets.clone();
    let mut since: Option<Instant> = None;
    loop {
        let eligible = rx.borrow_and_update().targets.iter().any(|x| {
            x.pod == t.pod && x.incarnation == t.incarnation && x.addr == t.addr && x.eligible()
        });
        since = match (eligible, since) {
            (true, _) => None,
            (false, None) => Some(Instant::now()),
            (false, Some(s)) if s.elapsed() >= limit => return s.elapsed(),
            (false, s) => s,
        };
        let wake = since.map_or(Duration::from_secs(3600), |s| {
            limit.saturating_sub(s.elapsed())
        });
        tokio::select! {
            Ok(()) = rx.changed() => {}
            _ = tokio::time::sleep(wake) => {}
        }
    }
}
