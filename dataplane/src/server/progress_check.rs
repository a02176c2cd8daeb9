//! The `/ready` check `engine_progress`: the engine's progress record and the KV byte
//! counters sampled here, judged by [`crate::progress::judge`]. The KV side is sampled on
//! each `/ready` (no cost on the transfer path): bytes moved between two reads are seen at
//! the second. The watch also logs and counts the turns, once each.

use std::sync::Mutex;
use std::time::Duration;

use crate::metrics::{DirectionLabels, Metrics, ReasonLabels};
use crate::pd::Check;
use crate::progress::{ProgressInputs, Verdict, judge};
use crate::scheduler::EngineHealth;

#[derive(Debug, Default)]
struct Seen {
    kv_total: u64,
    kv_moved: Option<Duration>,
    kv_pending_since: Option<Duration>,
    stalled: bool,
}

/// State of the check between `/ready` calls.
#[derive(Debug, Default)]
pub struct ProgressWatch(Mutex<Seen>);

impl ProgressWatch {
    /// The check, with `limit` the `--no-progress-seconds` (zero: off).
    pub fn check(&self, engine: &EngineHealth, metrics: &Metrics, limit: Duration) -> Check {
        let e = engine.progress();
        let bytes = |d: &str| {
            metrics
                .kv
                .transfer_bytes
                .get_or_create(&DirectionLabels {
                    direction: d.into(),
                })
                .get()
        };
        let kv_total = bytes("sent") + bytes("received");
        let pending = metrics.kv.bytes_in_flight.get() > 0;
        let Ok(mut seen) = self.0.lock() else {
            return Check::new("engine_progress", true, "no_progress", "unknown".into());
        };
        if kv_total != seen.kv_total {
            seen.kv_total = kv_total;
            seen.kv_moved = Some(e.now);
        }
        seen.kv_pending_since = match (pending, seen.kv_pending_since) {
            (false, _) => None,
            (true, None) => Some(e.now),
            (true, since) => since,
        };
        let verdict = judge(&ProgressInputs {
            limit,
            now: e.now,
            engine_work: e.work,
            work_since: e.work_since,
            last_step_ok: e.last_step_ok,
            failing_since: e.failing_since,
            last_step_failed: e.last_step_failed,
            failed_steps: e.failed_steps,
            kv_pending_since: seen.kv_pending_since,
            last_kv_moved: seen.kv_moved,
        });
        match (&verdict, seen.stalled) {
            (
                Verdict::NoProgress {
                    stalled,
                    for_,
                    detail,
                },
                false,
            ) => {
                seen.stalled = true;
                metrics
                    .progress_stalls
                    .get_or_create(&ReasonLabels {
                        reason: "no_progress".into(),
                    })
                    .inc();
                tracing::warn!(
                    reason = "no_progress",
                    stalled = *stalled,
                    stalled_ms = for_.as_millis() as u64,
                    limit_ms = limit.as_millis() as u64,
                    %detail,
                    "not ready: work is making no progress"
                );
            }
            (Verdict::Ready, true) => {
                seen.stalled = false;
                tracing::info!(
                    reason = "no_progress",
                    "ready again: work is making progress"
                );
            }
            _ => {}
        }
        match verdict {
            Verdict::Ready => Check::new(
                "engine_progress",
                true,
                "no_progress",
                if limit.is_zero() {
                    "off (--no-progress-seconds 0)".into()
                } else if e.work {
                    format!("work making progress (limit {} s)", limit.as_secs())
                } else {
                    format!("idle (limit {} s)", limit.as_secs())
                },
            ),
            Verdict::NoProgress {
                detail, stalled, ..
            } => Check::new("engine_progress", false, "no_progress", detail).with_stalled(stalled),
        }
    }
}
