//! Prometheus metrics of the operator (served as text on `/metrics`).

use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::planner::{Plan, PlannedAction};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// Every metric the operator exports, registered in `registry`.
pub struct Metrics {
    pub registry: Registry,
    pub reconciles: Counter,
    pub reconcile_errors: Family<ReasonLabel, Counter>,
    pub co_restarts: Family<ReasonLabel, Counter>,
    pub group_ready_seconds: Histogram,
    pub reconcile_duration_seconds: Histogram,
    pub is_leader: Gauge,
    pub unparsable_pods: Counter,
    pub force_deleted_pods: Counter,
    pub member_deletes: Family<DeleteLabels, Counter>,
    pub ready_reads: Family<ResultLabel, Counter>,
    pub in_place_resets: Family<OutcomeLabel, Counter>,
    pub reset_calls: Family<OutcomeLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

/// A member delete: why (the co-restart reason or `ScaleDown`), with which grace (`full`,
/// `short`) and why short (`exited`, `not_ready`, `node_lost`; `none` for the full grace).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeleteLabels {
    pub reason: String,
    pub grace: String,
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tandem_operator");
        let reconciles = Counter::default();
        let reconcile_errors = Family::<ReasonLabel, Counter>::default();
        let co_restarts = Family::<ReasonLabel, Counter>::default();
        // 1 s .. ~68 min: model loading dominates the time to a Ready group.
        let group_ready_seconds = Histogram::new(exponential_buckets(1.0, 2.0, 13));
        // 1 ms .. ~16 s.
        let reconcile_duration_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        let is_leader = Gauge::default();
        let unparsable_pods = Counter::default();
        let force_deleted_pods = Counter::default();
        let member_deletes = Family::<DeleteLabels, Counter>::default();
        let ready_reads = Family::<ResultLabel, Counter>::default();
        let in_place_resets = Family::<OutcomeLabel, Counter>::default();
        let reset_calls = Family::<OutcomeLabel, Counter>::default();
        // Counters get their `_total` suffix from the encoder.
        registry.register(
            "reconciles",
            "Reconciles of PDDeployments",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles by reason",
            reconcile_errors.clone(),
        );
        registry.register(
            "co_restarts",
            "Group co-restarts started, by reason",
            co_restarts.clone(),
        );
        registry.register(
            "group_ready_seconds",
            "Time from the start of a group incarnation to the group being Ready",
            group_ready_seconds.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one reconcile",
            reconcile_duration_seconds.clone(),
        );
        registry.register(
            "is_leader",
            "1 while this replica holds the leader lease (or election is off)",
            is_leader.clone(),
        );
        registry.register(
            "unparsable_pods",
            "Owned pods skipped because their Tandem labels could not be parsed",
            unparsable_pods.clone(),
        );
        registry.register(
            "force_deleted_pods",
            "Pods deleted with grace 0 because they stayed terminating past their grace period (node gone or kubelet hung)",
            force_deleted_pods.clone(),
        );
        registry.register(
            "member_deletes",
            "Member deletes the planner asked for, by reason, grace (full: the pod's own; short: health.unresponsiveGraceSeconds) and why the grace is short (exited, not_ready, node_lost; none)",
            member_deletes.clone(),
        );
        registry.register(
            "decode_ready_reads",
            "Reads of a not-ready decode pod's /ready by result: not_ready (it gave a reason), ready, or why it could not be read (probe_unreachable, probe_unknown_format, probe_malformed)",
            ready_reads.clone(),
        );
        registry.register(
            "in_place_resets",
            "In-place co-restarts by outcome: started, completed (every member serves the new incarnation, weights kept), fell_back (deleted and recreated instead)",
            in_place_resets.clone(),
        );
        registry.register(
            "reset_calls",
            "In-place reset calls to members by outcome: ready, already (a repeat), no_answer, or the member's refusal reason (reset_incomplete, stale_incarnation, draining, reset_unauthorized, ...)",
            reset_calls.clone(),
        );
        Self {
            registry,
            reconciles,
            reconcile_errors,
            co_restarts,
            group_ready_seconds,
            reconcile_duration_seconds,
            is_leader,
            unparsable_pods,
            force_deleted_pods,
            member_deletes,
            ready_reads,
            in_place_resets,
            reset_calls,
        }
    }

    /// Count one in-place reset call by its outcome ([`crate::reset_call::ResetReply::outcome`]).
    pub fn reset_call(&self, outcome: &str) {
        self.reset_calls
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Count one read of a decode pod's `/ready`.
    pub fn ready_read(&self, result: &str) {
        self.ready_reads
            .get_or_create(&ResultLabel {
                result: result.to_string(),
            })
            .inc();
    }

    /// Count a reconcile and time it until the returned guard drops.
    pub fn reconcile_started(&self) -> ReconcileTimer<'_> {
        self.reconciles.inc();
        ReconcileTimer {
            start: Instant::now(),
            histogram: &self.reconcile_duration_seconds,
        }
    }

    pub fn reconcile_failed(&self, reason: &str) {
        self.reconcile_errors
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Record what a plan decided (after its status was persisted).
    pub fn plan_applied(&self, plan: &Plan) {
        for c in &plan.co_restarts {
            self.co_restarts
                .get_or_create(&ReasonLabel {
                    reason: c.reason.as_str().to_string(),
                })
                .inc();
        }
        for a in &plan.actions {
            if let PlannedAction::DeletePod { reason, grace, .. } = a {
                self.member_deletes
                    .get_or_create(&DeleteLabels {
                        reason: reason.as_str().to_string(),
                        grace: grace.kind().to_string(),
                        cause: grace.cause().to_string(),
                    })
                    .inc();
            }
        }
        for (_, outcome) in &plan.resets {
            self.in_place_resets
                .get_or_create(&OutcomeLabel {
                    outcome: outcome.as_str().to_string(),
                })
                .inc();
        }
        for (_, took) in &plan.became_ready {
            self.group_ready_seconds.observe(took.as_secs_f64());
        }
    }

    /// Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Observes the reconcile duration when dropped.
pub struct ReconcileTimer<'a> {
    start: Instant,
    histogram: &'a Histogram,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        let d: Duration = self.start.elapsed();
        self.histogram.observe(d.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{CoRestartReason, PDDeploymentStatus};
    use crate::planner::{CoRestart, DeleteReason, Grace, Role, UnresponsiveCause};

    #[test]
    fn names_and_labels_are_exported() {
        let m = Metrics::new();
        {
            let _t = m.reconcile_started();
        }
        m.reconcile_failed("kube_api");
        m.is_leader.set(1);
        m.ready_read("probe_unreachable");
        let delete = |name: &str, grace| PlannedAction::DeletePod {
            name: name.into(),
            group: 0,
            role: Role::Prefill,
            incarnation: 1,
            reason: DeleteReason::CoRestart(CoRestartReason::MemberNotReady),
            grace,
        };
        m.plan_applied(&Plan {
            actions: vec![
                delete("a", Grace::Full),
                delete(
                    "b",
                    Grace::Unresponsive {
                        seconds: 2,
                        cause: UnresponsiveCause::NotReady,
                    },
                ),
            ],
            status: PDDeploymentStatus::default(),
            co_restarts: vec![CoRestart {
                group: 0,
                reason: CoRestartReason::MemberFailed,
                old_incarnation: 1,
                new_incarnation: 2,
                in_place: false,
            }],
            became_ready: vec![(0, Duration::from_secs(42))],
            requeue_after: None,
            resets: vec![(0, crate::planner::ResetOutcome::FellBack)],
        });
        m.reset_call("no_answer");
        let text = m.encode();
        for needle in [
            "tandem_operator_reconciles_total 1",
            "tandem_operator_reconcile_errors_total{reason=\"kube_api\"} 1",
            "tandem_operator_co_restarts_total{reason=\"MemberFailed\"} 1",
            "tandem_operator_in_place_resets_total{outcome=\"fell_back\"} 1",
            "tandem_operator_reset_calls_total{outcome=\"no_answer\"} 1",
            "tandem_operator_group_ready_seconds_sum 42.0",
            "tandem_operator_group_ready_seconds_count 1",
            "tandem_operator_reconcile_duration_seconds_count 1",
            "tandem_operator_is_leader 1",
            "tandem_operator_decode_ready_reads_total{result=\"probe_unreachable\"} 1",
            "tandem_operator_member_deletes_total{reason=\"MemberNotReady\",grace=\"full\",cause=\"none\"} 1",
            "tandem_operator_member_deletes_total{reason=\"MemberNotReady\",grace=\"short\",cause=\"not_ready\"} 1",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }
}
