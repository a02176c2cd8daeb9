//! What `/ready` says about the KV channel beyond pass or fail: per peer its state, and the
//! last refusal and the last failure with their reason label and time. The JSON these
//! render to is a stable format documented in `docs/readiness.md`; the operator and the
//! local runtime copy `reason` into the group's `BootstrapHealthy` condition.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use super::supervise::LoopHealth;

/// One `/ready` check. `reason` is a stable snake_case label when the check fails
/// (docs/readiness.md lists them), `None` when it passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub reason: Option<String>,
    pub detail: String,
    /// What stalled, for a failing check that tells (`engine_progress`: `engine` or
    /// `kv_transfer`), so that a reader need not parse `detail`.
    pub stalled: Option<&'static str>,
}

impl Check {
    pub fn new(name: impl Into<String>, ok: bool, fail_reason: &str, detail: String) -> Self {
        Self {
            name: name.into(),
            ok,
            reason: (!ok).then(|| fail_reason.to_owned()),
            detail,
            stalled: None,
        }
    }

    /// This failing check says `part` stalled.
    pub fn with_stalled(mut self, part: &'static str) -> Self {
        self.stalled = (!self.ok).then_some(part);
        self
    }
}

/// How long a loop may go without a heartbeat before `/ready` calls it stuck.
pub(super) fn loop_stale_after(probe_period: Duration) -> Duration {
    probe_period.max(Duration::from_millis(500))
}

/// The `/ready` check of one loop's heartbeat.
pub(super) fn loop_check(health: &LoopHealth, stale_after: Duration) -> Check {
    let age = health.age();
    Check::new(
        format!("loop_{}", health.name),
        age <= stale_after,
        "loop_stalled",
        format!(
            "heartbeat {} ms ago (limit {} ms), {} restarts",
            age.as_millis(),
            stale_after.as_millis(),
            health.restarts()
        ),
    )
}

/// One refusal or failure: a reason label (snake_case, the same as the metric label), a
/// sentence for people, and when it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub reason: String,
    pub message: String,
    pub at: SystemTime,
}

impl Problem {
    pub fn new(reason: &str, message: impl Into<String>) -> Self {
        Self {
            reason: reason.to_owned(),
            message: message.into(),
            at: SystemTime::now(),
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "reason": self.reason,
            "message": self.message,
            "at": rfc3339(self.at),
            "age_ms": self.at.elapsed().map(|d| d.as_millis() as u64).unwrap_or(0),
        })
    }
}

/// RFC 3339 UTC with milliseconds, e.g. `2025-01-31T12:00:00.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    match jiff::Timestamp::try_from(t) {
        Ok(ts) => ts.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
        Err(_) => "1970-01-01T00:00:00.000Z".into(),
    }
}

/// Written by a loop, read by `/ready`; the lock is never held across I/O.
#[derive(Debug, Default)]
pub struct ProblemSlot(Mutex<Option<Problem>>);

impl ProblemSlot {
    pub fn set(&self, p: Problem) {
        if let Ok(mut s) = self.0.lock() {
            *s = Some(p);
        }
    }

    pub fn get(&self) -> Option<Problem> {
        self.0.lock().ok().and_then(|s| s.clone())
    }
}

/// One KV peer as `/ready` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerReport {
    /// Decode: the prefill's `host:port`. Prefill: the decode's ZeroMQ routing id (hex).
    pub address: String,
    /// `established`, `handshaking`, `peer_draining` or `idle` (see docs/readiness.md).
    pub state: &'static str,
    pub incarnation: Option<u64>,
    /// Rooms open with this peer.
    pub rooms: usize,
    /// Decode: ms since the last PONG; prefill: ms since the decode's last message.
    pub last_contact_ms: Option<u64>,
    /// Bytes of KV sent to this peer and not yet acknowledged (prefill only).
    pub bytes_in_flight: Option<u64>,
    /// Why the channel is not (or was not) established: the last handshake refusal, in
    /// either direction, a handshake timeout, an unreachable peer, a restart, a shutdown.
    pub last_refusal: Option<Problem>,
    /// The last room that failed with this peer.
    pub last_failure: Option<Problem>,
}

impl PeerReport {
    pub fn to_json(&self) -> Value {
        json!({
            "address": self.address,
            "state": self.state,
            "incarnation": self.incarnation.map(|i| format!("{i:016x}")),
            "rooms": self.rooms,
            "last_contact_ms": self.last_contact_ms,
            "bytes_in_flight": self.bytes_in_flight,
            "last_refusal": self.last_refusal.as_ref().map(Problem::to_json),
            "last_failure": self.last_failure.as_ref().map(Problem::to_json),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        let t = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.123Z");
        let p = Problem {
            at: t,
            ..Problem::new("auth_failed", "wrong key")
        };
        let v = p.to_json();
        assert_eq!(v["reason"], "auth_failed");
        assert_eq!(v["at"], "2023-11-14T22:13:20.123Z");
        assert!(v["age_ms"].as_u64().unwrap() > 1_000_000);
    }
}
