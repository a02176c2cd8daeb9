//! Readiness from forward progress: a member with work that makes none is not ready
//! (`no_progress`), however regularly its loops beat.
//!
//! The loops' heartbeats say a thread goes round; they do not say it gets anywhere. An
//! engine whose every step fails, or that holds queued requests it never steps, beats and
//! would stay ready. So the engine records, with one relaxed store per step, when it last
//! stepped successfully, when its current spell of work began and its current streak of
//! failed steps ([`crate::scheduler::EngineHealth`]); `/ready` samples the KV byte counters;
//! and [`judge`] — pure, no clock of its own — turns those times into a verdict:
//!
//! - engine: with requests queued or running, no successful step for the limit (counted
//!   from the later of the last success and the start of the work, so work arriving after
//!   a long idle spell starts a fresh clock). A failed step is no progress: it does not
//!   move the clock, and a streak of failures (no success between, none more than the
//!   limit apart) counts as work even when the requests it failed are gone, so an engine
//!   that fails each request of a sparse stream is caught too;
//! - KV: with transfers pending (bytes sent and not yet acknowledged), no byte moved in
//!   either direction for the limit.
//!
//! An idle member (no work, no live failure streak, nothing in flight) is ready however
//! long it idles. A zero limit turns the check off.

use std::time::Duration;

/// What [`judge`] reads. Times are offsets on one monotonic clock (the engine's start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProgressInputs {
    /// `--no-progress-seconds`; zero: never `no_progress`.
    pub limit: Duration,
    pub now: Duration,
    /// Requests are queued or running in the engine.
    pub engine_work: bool,
    /// When the current spell of work began (`None` while idle).
    pub work_since: Option<Duration>,
    /// The last step that succeeded.
    pub last_step_ok: Option<Duration>,
    /// The first failed step of the current streak (no success since it).
    pub failing_since: Option<Duration>,
    /// The last failed step.
    pub last_step_failed: Option<Duration>,
    /// Failed steps in the current streak.
    pub failed_steps: u64,
    /// When transfers became pending (bytes in flight), `None` when none are.
    pub kv_pending_since: Option<Duration>,
    /// The last time a KV byte moved (sent or received).
    pub last_kv_moved: Option<Duration>,
}

/// What stalled, for how long; `detail` is the `/ready` sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Ready,
    NoProgress {
        /// `engine` or `kv_transfer`.
        stalled: &'static str,
        for_: Duration,
        detail: String,
    },
}

impl Verdict {
    pub fn is_ready(&self) -> bool {
        matches!(self, Verdict::Ready)
    }
}

fn later(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// The verdict on `i` (see the module header).
pub fn judge(i: &ProgressInputs) -> Verdict {
    if i.limit.is_zero() {
        return Verdict::Ready;
    }
    // A streak of failures is live while the last one is less than the limit old.
    let streak_live = i.failed_steps > 0
        && i.last_step_failed
            .is_some_and(|t| i.now.saturating_sub(t) < i.limit);
    // The longer of the two stalls: no success since the work began (or since the last
    // success, if later), and a live streak of failures since its first (a request
    // arriving during the streak does not reset it).
    let work = i
        .engine_work
        .then(|| later(i.work_since, i.last_step_ok))
        .flatten();
    let streak = if streak_live { i.failing_since } else { None };
    let since = match (work, streak) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if let Some(since) = since {
        let stalled = i.now.saturating_sub(since);
        if stalled >= i.limit {
            let last_ok = match i.last_step_ok {
                Some(t) => format!("last successful step {} ago", secs(i.now.saturating_sub(t))),
                None => "no successful step yet".to_owned(),
            };
            let failures = if streak_live {
                format!(", the last {} steps failed", i.failed_steps)
            } else {
                String::new()
            };
            return Verdict::NoProgress {
                stalled: "engine",
                for_: stalled,
                detail: format!(
                    "engine: work queued or running and no step succeeded for {} (limit {}; {last_ok}{failures})",
                    secs(stalled),
                    secs(i.limit),
                ),
            };
        }
    }
    if let Some(pending) = i.kv_pending_since {
        let since = later(Some(pending), i.last_kv_moved).unwrap_or(pending);
        let stalled = i.now.saturating_sub(since);
        if stalled >= i.limit {
            return Verdict::NoProgress {
                stalled: "kv_transfer",
                for_: stalled,
                detail: format!(
                    "kv_transfer: KV bytes in flight and none moved for {} (limit {})",
                    secs(stalled),
                    secs(i.limit),
                ),
            };
        }
    }
    Verdict::Ready
}

#[cfg(test)]
mod tests;
