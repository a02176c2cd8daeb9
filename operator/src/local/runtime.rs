//! The local runtime's loop: observe the member processes, ask the planner, carry out its
//! actions, keep its status (the operator's memory between reconciles, kept in memory
//! here as the controller keeps it in the resource), publish a snapshot.
//!
//! It reconciles on every process exit, every readiness change, every manifest edit, when
//! the planner asked to be called again (`requeue_after`: a backoff or a not-ready window
//! ends), when a grace period or the startup allowance ends, and at least every
//! [`RESYNC`]. One task owns all the state; processes, probes, the file watch and signals
//! talk to it through one channel.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use super::executor::{EntryKind, LocalExecutor};
pub use super::input::Input;
use super::manifest::Manifest;
use super::metrics::LocalMetrics;
use super::process::{self, LocalProcesses};
use super::snapshot::{self, MemberView, Snapshot};
use crate::crd::{PDDeploymentStatus, RevisionedSpec};
use crate::metrics::Metrics;
use crate::planner::{self, PlanInput, PlannedAction, Role};
use crate::reasons::EventReason;

/// Reconcile at least this often.
pub const RESYNC: Duration = Duration::from_secs(5);
/// Plans applied in a row before waiting for the world (each pass sees the previous
/// pass's processes; a quiet world needs one or two).
const MAX_PASSES: usize = 8;
/// Wait after SIGKILL at the end of a shutdown before giving up on a process.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Fixed facts shown in every snapshot.
pub struct Descr {
    pub file: std::path::PathBuf,
    pub endpoint: String,
    pub log_dir: std::path::PathBuf,
    pub grace: Duration,
}

pub struct Runtime {
    pub descr: Descr,
    pub manifest: Manifest,
    pub generation: i64,
    pub spec_error: Option<String>,
    pub status: Option<PDDeploymentStatus>,
    pub exec: LocalExecutor<LocalProcesses>,
    pub metrics: Arc<Metrics>,
    pub local: LocalMetrics,
    pub snapshot: watch::Sender<Arc<Snapshot>>,
    requeue_at: Option<Instant>,
    retry_at: Option<Instant>,
    failures: u32,
    shutting_down: bool,
}

fn instant_of(t: Timestamp) -> Instant {
    let d = t.duration_since(Timestamp::now());
    Instant::now() + Duration::try_from(d).unwrap_or(Duration::ZERO)
}

impl Runtime {
    pub fn new(
        descr: Descr,
        manifest: Manifest,
        exec: LocalExecutor<LocalProcesses>,
        metrics: Arc<Metrics>,
        local: LocalMetrics,
        snapshot: watch::Sender<Arc<Snapshot>>,
    ) -> Self {
        Self {
            descr,
            manifest,
            generation: 1,
            spec_error: None,
            status: None,
            exec,
            metrics,
            local,
            snapshot,
            requeue_at: None,
            retry_at: None,
            failures: 0,
            shutting_down: false,
        }
    }

    /// Run until a stop signal; then stop every member and return.
    pub async fn run(&mut self, mut rx: UnboundedReceiver<Input>) {
        let mut dirty = true;
        loop {
            self.exec.enforce_deadlines(Timestamp::now());
            let retry_due = self.retry_at.is_some_and(|r| r <= Instant::now());
            let requeue_due = self.requeue_at.is_some_and(|r| r <= Instant::now());
            if dirty || retry_due || requeue_due {
                self.retry_at = None;
                self.reconcile();
            }
            self.publish();
            let mut wake = Instant::now() + RESYNC;
            for t in [self.requeue_at, self.retry_at].into_iter().flatten() {
                wake = wake.min(t);
            }
            if let Some(t) = self.exec.next_deadline() {
                wake = wake.min(instant_of(t));
            }
            let first = tokio::select! {
                m = rx.recv() => m,
                _ = tokio::time::sleep_until(wake) => {
                    dirty = true;
                    continue;
                }
            };
            let Some(first) = first else { break };
            dirty = false;
            let mut next = Some(first);
            while let Some(input) = next {
                match input {
                    Input::Stop { signal } => {
                        info!("{signal} received: stopping every member, decode first");
                        self.shutdown(&mut rx).await;
                        return;
                    }
                    other => dirty |= self.handle(other),
                }
                next = rx.try_recv().ok();
            }
        }
        self.shutdown(&mut rx).await;
    }

    /// Apply one input; true when the planner should look again.
    fn handle(&mut self, input: Input) -> bool {
        let now = Timestamp::now();
        match input {
            Input::Exited { pod, how, success } => {
                let Some(m) = self.exec.members.get(&pod) else {
                    return false;
                };
                let planned = m.terminating.is_some();
                let role = m.role.as_str();
                let last = (!planned).then(|| process::last_line(&m.log)).flatten();
                self.local.exit(role, planned);
                self.exec.on_exit(&pod, how, success, last, now);
                self.exec.processes.forget(&pod);
                true
            }
            Input::Probe { pod, outcome } => self.exec.on_probe(&pod, outcome, now),
            Input::Reset {
                pod,
                to_incarnation,
                reply,
            } => {
                self.metrics.reset_call(reply.outcome());
                self.exec.on_reset(&pod, to_incarnation, reply, now)
            }
            Input::Manifest(m) => {
                self.apply_manifest(m, now);
                true
            }
            Input::Stop { .. } => false,
        }
    }

    fn apply_manifest(&mut self, m: Result<Box<Manifest>, String>, now: Timestamp) {
        let m = match m {
            Ok(m) if m.name() != self.manifest.name() => Err(format!(
                "metadata.name changed from {:?} to {:?}: this runtime runs {:?}; start another one for another deployment",
                self.manifest.name(),
                m.name(),
                self.manifest.name()
            )),
            other => other,
        };
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                let msg = format!("the edited manifest is not used, the running spec stays: {e}");
                self.spec_error = Some(e);
                self.exec.record.push(
                    now,
                    EntryKind::Spec,
                    true,
                    -1,
                    None,
                    Some(EventReason::InvalidSpec),
                    msg,
                );
                return;
            }
        };
        self.spec_error = None;
        let old = &self.manifest;
        let spec_changed = m.pdd.spec != old.pdd.spec;
        let request_changed = m.restart_requested_at != old.restart_requested_at;
        if m.cluster_only != old.cluster_only && !m.cluster_only.is_empty() {
            info!(
                fields = %m.cluster_only.join(", "),
                "cluster-only fields are ignored by the local runtime"
            );
        }
        if spec_changed {
            self.generation += 1;
            let from = RevisionedSpec::from_spec(&old.pdd.spec).revision();
            let to = RevisionedSpec::from_spec(&m.pdd.spec).revision();
            let what = if from == to {
                "groups, restart or rollout settings changed (no pod-shaping change)".to_string()
            } else {
                format!("pod revision {from} → {to}: groups roll as the rollout settings allow")
            };
            self.exec.record.push(
                now,
                EntryKind::Spec,
                false,
                -1,
                None,
                Some(EventReason::SpecChanged),
                format!("spec changed (generation {}): {what}", self.generation),
            );
        }
        if request_changed {
            self.exec.record.push(
                now,
                EntryKind::Spec,
                false,
                -1,
                None,
                Some(EventReason::RestartRequestChanged),
                format!(
                    "tandem.dev/restart-requested-at is now {}",
                    m.restart_requested_at
                        .map_or("unset".to_string(), |t| t.to_string())
                ),
            );
        }
        self.manifest = *m;
    }

    /// Plan and act until the plan changes nothing more.
    fn reconcile(&mut self) {
        let name = self.manifest.name().to_string();
        for _ in 0..MAX_PASSES {
            let _timer = self.metrics.reconcile_started();
            let now = Timestamp::now();
            let observed = self.exec.observed();
            let plan = planner::plan(&PlanInput {
                name: &name,
                generation: Some(self.generation),
                spec: &self.manifest.pdd.spec,
                status: self.status.as_ref(),
                restart_requested_at: self.manifest.restart_requested_at,
                observed: &observed,
                now,
            });
            let acted = plan
                .actions
                .iter()
                .any(|a| !matches!(a, PlannedAction::Event(_)));
            // In the plan's order, stopping at the first failure, as the controller does.
            let failed = self
                .exec
                .execute_all(&plan.actions, now)
                .err()
                .map(|f| (f.action.clone(), f.error));
            // The status carries the planner's memory (a co-restart's new incarnation)
            // even when an action failed, as the controller writes it.
            self.status = Some(plan.status.clone());
            self.metrics.plan_applied(&plan);
            self.requeue_at = plan.requeue_after.map(|d| Instant::now() + d);
            if let Some((action, e)) = failed {
                self.failures += 1;
                let delay = crate::controller::backoff(self.failures).min(Duration::from_secs(30));
                let delay = if self.failures == 1 {
                    Duration::from_secs(1)
                } else {
                    delay
                };
                self.retry_at = Some(Instant::now() + delay);
                self.metrics.reconcile_failed("local_action");
                self.local.action_failures.inc();
                let group = match &action {
                    PlannedAction::CreatePod(i) => i.group,
                    _ => -1,
                };
                self.exec.record.push(
                    now,
                    EntryKind::Failed,
                    true,
                    group,
                    None,
                    Some(EventReason::ActionFailed),
                    format!("{e}; retrying in {}s", delay.as_secs()),
                );
                return;
            }
            self.failures = 0;
            if !acted {
                return;
            }
        }
    }

    /// Publish what the router, the display and `/status` show.
    pub fn publish(&self) {
        let now = Timestamp::now();
        let members: Vec<_> = self.exec.members.values().cloned().collect();
        let endpoints = if self.shutting_down {
            Vec::new()
        } else {
            self.exec.endpoints()
        };
        let unavailable = if endpoints.is_empty() {
            snapshot::why_unavailable(
                self.status.as_ref(),
                &members,
                self.shutting_down,
                self.manifest.pdd.spec.groups,
            )
        } else {
            String::new()
        };
        let entries = self.exec.record.entries();
        let skip = entries.len().saturating_sub(snapshot::RECORD_TAIL);
        let snap = Snapshot {
            deployment: self.manifest.name().to_string(),
            file: self.descr.file.clone(),
            endpoint: self.descr.endpoint.clone(),
            log_dir: self.descr.log_dir.clone(),
            grace_seconds: self.descr.grace.as_secs(),
            generation: self.generation,
            spec_error: self.spec_error.clone(),
            shutting_down: self.shutting_down,
            status: self.status.clone(),
            members: members
                .into_iter()
                .map(|m| {
                    let state = m.state(now);
                    MemberView { member: m, state }
                })
                .collect(),
            endpoints,
            unavailable,
            record: entries.skip(skip).cloned().collect(),
            time: now,
        };
        self.snapshot.send_replace(Arc::new(snap));
    }

    /// Stop every member: decode first, then prefill, SIGTERM, and SIGKILL for whatever
    /// still runs one grace period after the first SIGTERM. A second signal kills at once.
    async fn shutdown(&mut self, rx: &mut UnboundedReceiver<Input>) {
        self.shutting_down = true;
        let deadline = Instant::now() + self.descr.grace;
        for role in [Role::Decode, Role::Prefill] {
            self.exec.terminate_role(role, "shutdown", Timestamp::now());
            self.publish();
            if !self.wait(rx, deadline, |x| x.running_of(role) == 0).await {
                break;
            }
        }
        if self.exec.running() > 0 {
            let why = if Instant::now() >= deadline {
                format!(
                    "still running {}s after SIGTERM",
                    self.descr.grace.as_secs()
                )
            } else {
                "stop requested again".to_string()
            };
            self.exec.kill_all(&why, Timestamp::now());
            self.publish();
            let until = Instant::now() + KILL_WAIT;
            self.wait(rx, until, |x| x.running() == 0).await;
        }
        let left = self.exec.running();
        if left > 0 {
            warn!(processes = left, "members still running after SIGKILL");
        } else {
            info!("every member has exited");
        }
        self.publish();
    }

    /// Handle exits until `done` holds or `deadline` passes; false when interrupted by a
    /// second stop signal or the deadline.
    async fn wait(
        &mut self,
        rx: &mut UnboundedReceiver<Input>,
        deadline: Instant,
        done: impl Fn(&LocalExecutor<LocalProcesses>) -> bool,
    ) -> bool {
        while !done(&self.exec) {
            let input = tokio::select! {
                m = rx.recv() => m,
                _ = tokio::time::sleep_until(deadline) => return false,
            };
            match input {
                Some(Input::Stop { signal }) => {
                    warn!("{signal} received again: killing every member now");
                    return false;
                }
                Some(i @ Input::Exited { .. }) => {
                    self.handle(i);
                    self.publish();
                }
                Some(_) => {}
                None => return false,
            }
        }
        true
    }
}
