//! Readiness probes of member processes: `GET /ready` with a timeout, as the kubelet's
//! HTTP probe does (`timeoutSeconds: 1`).
//!
//! Until a member has answered 200 once, it is probed every [`STARTUP_POLL`] — the local
//! counterpart of a startup probe with a short period — so a group comes up as soon as its
//! members do instead of a probe period later. From its first success on, it is probed at
//! the spec's `health.probePeriodSeconds`, and [`super::member::Readiness`] applies
//! `failureThreshold`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use tokio::sync::mpsc::UnboundedSender;

use super::input::Input;
use super::member::ProbeOutcome;
use crate::planner::ReadyDetail;
use crate::ready::{self, get};

/// Probe timeout (the kubelet's default `timeoutSeconds`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Probe period until the first success.
pub const STARTUP_POLL: Duration = Duration::from_millis(250);

/// Classify a `/ready` answer: a not-ready body's reason and message (format 1,
/// [`crate::ready`]) become the outcome's detail.
pub fn outcome(result: Result<(StatusCode, Bytes), String>) -> ProbeOutcome {
    match result {
        Ok((s, _)) if s == StatusCode::OK => ProbeOutcome::Ready,
        Ok(answer) => ProbeOutcome::NotReady(ready::detail(Ok(answer)).unwrap_or_else(|| {
            ReadyDetail::new(ready::MALFORMED, "no reason in a not-ready answer")
        })),
        Err(e) => ProbeOutcome::Unreachable(e),
    }
}

/// Probe `addr` until the runtime goes away (the task is aborted when the member exits).
pub async fn run(pod: String, addr: SocketAddr, period: Duration, tx: UnboundedSender<Input>) {
    let mut succeeded = false;
    loop {
        // Periods run from start to start, as the kubelet's: a probe that times out does
        // not push the next one a timeout later (a hung member would take
        // failureThreshold × (period + timeout) to turn not ready instead of about
        // (failureThreshold − 1) × period + timeout).
        let started = tokio::time::Instant::now();
        let result = outcome(get(addr, "/ready", PROBE_TIMEOUT).await);
        succeeded |= result == ProbeOutcome::Ready;
        if tx
            .send(Input::Probe {
                pod: pod.clone(),
                outcome: result,
            })
            .is_err()
        {
            return;
        }
        tokio::time::sleep_until(started + if succeeded { period } else { STARTUP_POLL }).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_ready(reason: &str, message: &str) -> ProbeOutcome {
        ProbeOutcome::NotReady(ReadyDetail::new(reason, message))
    }

    #[test]
    fn answers_are_classified_with_their_reason() {
        assert_eq!(
            outcome(Ok((StatusCode::OK, Bytes::new()))),
            ProbeOutcome::Ready
        );
        let body = br#"{"format":1,"ready":false,"role":"decode","reason":"probe_timeout","message":"probe 127.0.0.1:5: last PONG 3100 ms ago","checks":[{"name":"engine_heartbeat","ok":true,"reason":null,"detail":"fine"},{"name":"probe 127.0.0.1:5","ok":false,"reason":"probe_timeout","detail":"last PONG 3100 ms ago"}],"peers":[]}"#;
        assert_eq!(
            outcome(Ok((
                StatusCode::SERVICE_UNAVAILABLE,
                Bytes::from_static(body)
            ))),
            not_ready("probe_timeout", "probe 127.0.0.1:5: last PONG 3100 ms ago")
        );
        assert_eq!(
            outcome(Ok((StatusCode::NOT_FOUND, Bytes::from_static(b"nope")))),
            not_ready(
                "probe_malformed",
                "/ready body is not format-1 JSON: expected ident at line 1 column 2 (answered 404 Not Found)"
            )
        );
        assert_eq!(
            outcome(Err("connect: refused".into())),
            ProbeOutcome::Unreachable("connect: refused".into())
        );
    }
}
