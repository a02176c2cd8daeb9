//! The group planner: a pure function from (desired spec, remembered status, observed
//! cluster, now) to the actions that move the cluster one step towards the spec, plus the
//! status to write. No I/O happens here, so the ordering invariants (a decode never runs
//! against a prefill of another incarnation; co-restarts remove decode first, then
//! prefill, then rebuild prefill first) are tested exhaustively without an API server.
//!
//! A group's life, as derived on every call:
//! 1. *Restarting*: pods of an older incarnation exist. Delete the decode pods and wait
//!    until they are gone; then delete the prefill pods and wait until they are gone.
//! 2. *Building*: create the prefill pods of the current incarnation; once every one of
//!    them is Ready, create the decode pods; once those are Ready the group is Ready and
//!    the decode pods' readiness gate is set, so the client Service routes to them.
//! 3. *Triggers* on a started group: a member Failed, deleted or evicted, a member that
//!    was Ready stays not-ready past the window, pods of another incarnation, a revision
//!    change, or a restart request. A co-restart bumps the incarnation and enters phase 1.
//!    Failure restarts back off exponentially; planned ones (rollout, request) are
//!    limited by `rollout.maxUnavailableGroups`; a rebuilt group counts as available again
//!    once it has been Ready for `rollout.minReadySeconds`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::crd::{
    CoRestartReason, GroupPhase, GroupStatus, PDDeploymentSpec, PDDeploymentStatus, RestartPolicy,
    RevisionedSpec, labels,
};

mod build;
mod group;
pub mod reset;
mod status;

use crate::reasons::EventReason;
pub use crate::role::Role;

pub use reset::ResetOutcome;

use group::{ensure_group_objects, find_trigger, scale_down_group, step_group};

/// Pod phase as the kubelet reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

/// What the planner needs to know about one pod the deployment owns.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedPod {
    pub name: String,
    pub group: i32,
    pub role: Role,
    /// Replica index inside the role (the `{r}{index}` at the end of its name). A member
    /// keeps its name when it resets in place, so its name's incarnation may be older than
    /// `incarnation`: members are matched by role and index, never by name.
    pub index: i32,
    pub revision: String,
    /// The incarnation the member serves (the `tandem.dev/incarnation` label; an in-place
    /// reset moves it on).
    pub incarnation: i64,
    pub phase: PodPhase,
    /// `deletionTimestamp` is set (deleted, evicted, being drained).
    pub terminating: bool,
    /// The dataplane's own readiness (`ContainersReady`; the pod's `Ready` condition also
    /// includes the group gate, which the planner itself sets).
    pub ready: bool,
    /// When readiness last turned false (`ContainersReady.lastTransitionTime`).
    pub not_ready_since: Option<Timestamp>,
    /// Current value of the `tandem.dev/group-ready` condition.
    pub group_ready_gate: bool,
    /// When the gate was closed (its condition's `lastTransitionTime` while `False`), where
    /// the executor's routing needs time to follow it; `None` where it follows at once (the
    /// local runtime's router) or the gate was never set.
    pub gate_closed_since: Option<Timestamp>,
    /// `deletionTimestamp`: when a terminating pod's grace period ends. The API server
    /// sets it from the grace of the delete that started the termination, so a pod
    /// deleted with the short grace ([`Grace::Unresponsive`]) is force-deleted that much
    /// sooner.
    pub deletion_deadline: Option<Timestamp>,
    /// Its node stopped reporting: the node lifecycle controller turned the pod's `Ready`
    /// False while the kubelet's last word (`ContainersReady`) was still True. Such a pod
    /// cannot be stopped gracefully (its kubelet is gone); always false locally.
    pub node_lost: bool,
    /// Why the pod is not running yet, when the scheduler or the kubelet said why
    /// (`Unschedulable: …`, `ImagePullBackOff: …`, `CreateContainerConfigError: …`).
    pub waiting: Option<String>,
    /// How an ended member ended, when its executor knows (`OOMKilled, exit code 137` from
    /// the kubelet's container status; `killed by SIGKILL` from the local runtime).
    pub exit: Option<String>,
    /// Why a started, running, not-ready decode pod is not ready, as its `/ready` body
    /// says; `None` for every other pod. The executors read it (the controller over HTTP,
    /// the local runtime from its own probes); the planner only reports it.
    pub ready_detail: Option<ReadyDetail>,
}

/// A not-ready dataplane's own account of why (docs/readiness.md): the body's `reason`
/// and `message` (and `stalled`, what a `no_progress` says stalled), or the executor's
/// reason when the body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReadyDetail {
    pub reason: String,
    pub message: String,
    /// `engine` or `kv_transfer` for `no_progress`; `None` for other reasons, and from a
    /// dataplane too old to say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stalled: Option<String>,
}

impl ReadyDetail {
    pub fn new(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            message: message.into(),
            stalled: None,
        }
    }
}

/// The observed cluster: pods and per-group objects the deployment owns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    pub pods: Vec<ObservedPod>,
    pub client_service: bool,
    /// The router's objects exist (its Service `<name>-router`, ours, was seen).
    pub router: bool,
    pub group_services: BTreeSet<i32>,
    pub network_policies: BTreeSet<i32>,
    pub group_secrets: BTreeSet<i32>,
}

/// Everything the planner reads.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub name: &'a str,
    pub generation: Option<i64>,
    pub spec: &'a PDDeploymentSpec,
    /// The status written by the previous reconcile (the operator's memory).
    pub status: Option<&'a PDDeploymentStatus>,
    /// Parsed `tandem.dev/restart-requested-at` annotation.
    pub restart_requested_at: Option<Timestamp>,
    pub observed: &'a Observed,
    pub now: Timestamp,
}

/// A pod the controller must create; it builds the object from these facts.
#[derive(Debug, Clone, PartialEq)]
pub struct PodIntent {
    pub name: String,
    pub group: i32,
    pub role: Role,
    /// Replica index inside the role (0..replicas).
    pub index: i32,
    pub incarnation: i64,
    pub revision: String,
    /// The pod-shaping spec of `revision`.
    pub template: RevisionedSpec,
}

/// Why a pod is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteReason {
    /// Part of a co-restart of its group.
    CoRestart(CoRestartReason),
    /// Its group index is at or above `spec.groups`.
    ScaleDown,
}

impl DeleteReason {
    /// The metric label: the co-restart reason, or `ScaleDown`.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeleteReason::CoRestart(r) => r.as_str(),
            DeleteReason::ScaleDown => "ScaleDown",
        }
    }
}

/// How long a deleted member is given between SIGTERM and SIGKILL. The planner decides
/// (`group::removal_grace`); the executors carry it out: on a cluster as the delete's
/// `gracePeriodSeconds`, locally as the delay before SIGKILL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grace {
    /// The member's own grace period (the pod's `terminationGracePeriodSeconds`; locally
    /// `--grace-period-seconds`): it can act on SIGTERM, so it drains and exits early.
    Full,
    /// `health.unresponsiveGraceSeconds`: the member cannot act on SIGTERM or has nothing
    /// left to drain, and waiting out its full grace would only hold its group's
    /// co-restart (a stopped process ignores SIGTERM until the SIGKILL).
    Unresponsive {
        seconds: i32,
        cause: UnresponsiveCause,
    },
}

impl Grace {
    /// The metric label: `full` or `short`.
    pub fn kind(&self) -> &'static str {
        match self {
            Grace::Full => "full",
            Grace::Unresponsive { .. } => "short",
        }
    }

    /// Why the grace is short (a metric label; `none` for the full grace).
    pub fn cause(&self) -> &'static str {
        match self {
            Grace::Full => "none",
            Grace::Unresponsive { cause, .. } => cause.as_str(),
        }
    }
}

/// Why a member removed by a failure co-restart is taken for unresponsive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnresponsiveCause {
    /// It has exited (pod `Failed` or `Succeeded`): nothing is left to drain.
    Exited,
    /// It is not ready through its own fault: a prefill (its readiness is its own engine
    /// and KV loop), or a decode whose prefills are all ready. A hung process (SIGSTOP, a
    /// wedged loop) is not ready and cannot act on SIGTERM.
    NotReady,
    /// Its node stopped reporting: no kubelet is there to stop it gracefully.
    NodeLost,
}

impl UnresponsiveCause {
    pub fn as_str(&self) -> &'static str {
        match self {
            UnresponsiveCause::Exited => "exited",
            UnresponsiveCause::NotReady => "not_ready",
            UnresponsiveCause::NodeLost => "node_lost",
        }
    }

    /// For people: the log lines and Events.
    pub fn describe(&self) -> &'static str {
        match self {
            UnresponsiveCause::Exited => "it has exited",
            UnresponsiveCause::NotReady => {
                "it is not ready and cannot be relied on to act on SIGTERM"
            }
            UnresponsiveCause::NodeLost => "its node stopped reporting",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Normal,
    Warning,
}

/// A Kubernetes Event the controller publishes on the PDDeployment.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedEvent {
    pub type_: EventKind,
    pub reason: EventReason,
    pub group: i32,
    pub message: String,
}

/// One step the controller carries out.
#[derive(Debug, Clone, PartialEq)]
pub enum PlannedAction {
    ApplyClientService,
    /// Apply the router's objects (`spec.router` is set): its ServiceAccount, Role,
    /// RoleBinding, Deployment and Service.
    ApplyRouter,
    /// Delete the router's objects (`spec.router` was removed).
    DeleteRouter,
    ApplyGroupService {
        group: i32,
    },
    ApplyNetworkPolicy {
        group: i32,
    },
    /// Create (never overwrite) the Secret with the group's random key.
    CreateGroupSecret {
        group: i32,
    },
    CreatePod(Box<PodIntent>),
    DeletePod {
        name: String,
        group: i32,
        role: Role,
        /// The pod's incarnation (for the executors' log lines).
        incarnation: i64,
        reason: DeleteReason,
        grace: Grace,
    },
    /// Remove a pod whose deletion nobody confirmed within its grace period plus
    /// [`FORCE_DELETE_MARGIN`] (its node is gone or its kubelet hung): delete it with grace
    /// period 0, so that a co-restart waiting for it can go on.
    ForceDeletePod {
        name: String,
        group: i32,
        role: Role,
    },
    /// Ask a live member to reset in place to `to_incarnation` (docs/in-place-reset.md): it
    /// ends every room with a reason, forgets its KV session state and handshakes afresh,
    /// keeping its process and weights. The executor moves the member's observed
    /// incarnation on once the member says it is ready at `to_incarnation`; until then (or
    /// when a call fails) the next plan asks again — the call is idempotent — until
    /// `restart.inPlaceResetSeconds` have passed and the planner deletes the pods instead.
    ResetMember {
        name: String,
        group: i32,
        role: Role,
        from_incarnation: i64,
        to_incarnation: i64,
        /// How long the member may take to be ready at the new incarnation.
        timeout: Duration,
    },
    /// Patch the decode pod's `tandem.dev/group-ready` status condition.
    SetGroupReadyGate {
        pod: String,
        ready: bool,
    },
    /// Remove the Service, NetworkPolicy and Secret of a group that was scaled away.
    DeleteGroupResources {
        group: i32,
    },
    Event(PlannedEvent),
}

/// A co-restart decided in this plan (for metrics).
#[derive(Debug, Clone, PartialEq)]
pub struct CoRestart {
    pub group: i32,
    pub reason: CoRestartReason,
    pub old_incarnation: i64,
    pub new_incarnation: i64,
    /// Begun in place (the members reset without exiting); it may still fall back.
    pub in_place: bool,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub actions: Vec<PlannedAction>,
    pub status: PDDeploymentStatus,
    pub co_restarts: Vec<CoRestart>,
    /// Groups that became Ready in this plan, with how long they took since their
    /// incarnation began (for the time-to-group-ready histogram).
    pub became_ready: Vec<(i32, Duration)>,
    /// Reconcile again after this long even if nothing changes (a backoff expires or a
    /// not-ready member reaches its window).
    pub requeue_after: Option<Duration>,
    /// In-place resets that began, completed or fell back in this plan (for metrics).
    pub resets: Vec<(i32, ResetOutcome)>,
}

/// How long past its grace period a terminating pod may linger before it is force-deleted.
/// A live kubelet removes a pod within its grace period; one that has not after this
/// margin is on a node that is gone or hung, and would hold its group's co-restart forever.
pub const FORCE_DELETE_MARGIN: Duration = Duration::from_secs(10);

/// How long past its grace period `p` may linger before it is force-deleted:
/// [`FORCE_DELETE_MARGIN`], or nothing for a pod on a node that stopped reporting
/// ([`ObservedPod::node_lost`]): no kubelet will confirm its end, so a margin would only
/// hold the group's rebuild, and a process still running there is fenced by its
/// incarnation (its replacement has another name and another incarnation, which the
/// handshake checks).
pub fn force_delete_margin(p: &ObservedPod) -> Duration {
    if p.node_lost {
        Duration::ZERO
    } else {
        FORCE_DELETE_MARGIN
    }
}

/// How long a planned removal (a rollout, a requested restart, a scale-down) waits between
/// closing a decode's gate and deleting it. A closed gate takes the pod out of its Services
/// only after the kubelet has recomputed `Ready`, the EndpointSlice controller has dropped
/// the endpoint and every node's kube-proxy has rewritten its rules (about a second on an
/// idle cluster; kube-proxy's minimum sync period alone is 1 s). Deleting at once stops the
/// decode while connections are still routed to it: clients see "connection refused" (the
/// e2e suite's `helm upgrade` did, one request in 66). A failure co-restart does not wait: its
/// group is not serving anyway.
pub const ENDPOINTS_SETTLE: Duration = Duration::from_secs(3);

/// While a decode pod reports why it is not ready, plan again this often: its reason can
/// change (`handshaking` → `auth_failed`) without its readiness changing, and so without
/// any pod event that would trigger a reconcile.
pub const READY_DETAIL_REFRESH: Duration = Duration::from_secs(5);

/// Longest `/ready` message kept in the status (a condition message may hold several).
const MAX_DETAIL_MESSAGE: usize = 512;

/// Label selector of the client-facing decode pods.
pub fn decode_selector(deployment: &str) -> String {
    format!(
        "{}={deployment},{}=decode",
        labels::DEPLOYMENT,
        labels::ROLE
    )
}

/// Delay before the co-restart after `streak` consecutive failure co-restarts:
/// `base × 2^(streak-1)`, capped at `max`.
pub fn backoff_delay(base_seconds: i32, max_seconds: i32, streak: i32) -> Duration {
    let base = base_seconds.max(1) as u64;
    let max = max_seconds.max(1) as u64;
    let shift = (streak.max(1) - 1).min(32) as u32;
    Duration::from_secs(base.saturating_mul(1u64 << shift).min(max))
}

fn is_failure(reason: CoRestartReason) -> bool {
    !matches!(
        reason,
        CoRestartReason::RevisionChanged | CoRestartReason::RestartRequested
    )
}

fn add(ts: Timestamp, d: Duration) -> Timestamp {
    ts.checked_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX))
        .unwrap_or(Timestamp::MAX)
}

fn until(now: Timestamp, later: Timestamp) -> Duration {
    let d = later.duration_since(now);
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}

/// When the co-restart window of a member that turned not ready at `since` ends. Readiness
/// turns false only after `failureThreshold` consecutive failed probes `probePeriodSeconds`
/// apart (the kubelet's rule, and the local runtime's), so the member began failing
/// (threshold − 1) periods before `since`: the window counts from there. That makes
/// `coRestartAfterSeconds` the time since the member stopped passing its probes, whatever
/// the probes' tuning, and not that time plus the detection. Never before `since` itself.
fn not_ready_deadline(health: &crate::crd::HealthSpec, since: Timestamp) -> Timestamp {
    let window = Duration::from_secs(health.co_restart_after_seconds.max(1) as u64);
    let detection = Duration::from_secs(
        (health.failure_threshold.max(1) as u64 - 1) * health.probe_period_seconds.max(1) as u64,
    );
    add(since, window.saturating_sub(detection))
}

/// Per-call context shared by the group steps.
struct Ctx<'a> {
    input: &'a PlanInput<'a>,
    update: RevisionedSpec,
    update_revision: String,
    current: RevisionedSpec,
    current_revision: String,
    actions: Vec<PlannedAction>,
    co_restarts: Vec<CoRestart>,
    became_ready: Vec<(i32, Duration)>,
    requeue: Option<Duration>,
    resets: Vec<(i32, ResetOutcome)>,
}

impl Ctx<'_> {
    fn requeue_in(&mut self, d: Duration) {
        let d = d.max(Duration::from_secs(1));
        self.requeue = Some(self.requeue.map_or(d, |r| r.min(d)));
    }

    fn event(&mut self, type_: EventKind, reason: EventReason, group: i32, message: String) {
        self.actions.push(PlannedAction::Event(PlannedEvent {
            type_,
            reason,
            group,
            message,
        }));
    }

    /// Revision (and its spec) a group should run: the update revision unless the rollout
    /// is paused or the group is held back by the partition.
    fn target(&self, group: i32) -> (&str, &RevisionedSpec) {
        let rollout = &self.input.spec.rollout;
        if rollout.paused || group < rollout.partition {
            (&self.current_revision, &self.current)
        } else {
            (&self.update_revision, &self.update)
        }
    }

    /// Revision (and spec) a started group should run. While the rollout is paused, a
    /// group keeps the revision it has (when its spec is still known): pausing stops the
    /// rollout where it is and never rolls an updated group back.
    fn target_for(&self, mem: &GroupStatus) -> (&str, &RevisionedSpec) {
        if self.input.spec.rollout.paused {
            if mem.revision == self.update_revision {
                return (&self.update_revision, &self.update);
            }
            if mem.revision == self.current_revision {
                return (&self.current_revision, &self.current);
            }
        }
        self.target(mem.index)
    }

    fn policy(&self) -> RestartPolicy {
        self.input.spec.restart.policy
    }
}

/// What a started group would need, found before the rollout budget is applied.
#[derive(Debug, Clone)]
struct Trigger {
    reason: CoRestartReason,
    detail: String,
}

/// Plan one reconcile. Pure: same input, same plan.
pub fn plan(input: &PlanInput<'_>) -> Plan {
    let update = RevisionedSpec::from_spec(input.spec);
    let update_revision = update.revision();
    let prev = input.status.cloned().unwrap_or_default();
    let (current, current_revision) = match (&prev.current_template, &prev.current_revision) {
        (Some(t), Some(r)) if &t.revision() == r => (t.clone(), r.clone()),
        _ => (update.clone(), update_revision.clone()),
    };
    let mut ctx = Ctx {
        input,
        update,
        update_revision,
        current,
        current_revision,
        actions: Vec::new(),
        co_restarts: Vec::new(),
        became_ready: Vec::new(),
        requeue: None,
        resets: Vec::new(),
    };

    let desired_groups = input.spec.groups.max(0);
    let observed = input.observed;

    // Services and NetworkPolicies are applied on every reconcile: a no-op apply costs
    // nothing, and drift (a `kubectl edit`, an operator upgrade) is corrected.
    ctx.actions.push(PlannedAction::ApplyClientService);
    // The router follows `spec.router` the same way; it decides nothing about groups.
    if input.spec.router.is_some() {
        ctx.actions.push(PlannedAction::ApplyRouter);
    } else if input.observed.router {
        ctx.actions.push(PlannedAction::DeleteRouter);
    }

    // Every group index that is desired, remembered or still has pods.
    let mut indices: BTreeSet<i32> = (0..desired_groups).collect();
    indices.extend(prev.group_statuses.iter().map(|g| g.index));
    indices.extend(observed.pods.iter().map(|p| p.group));
    indices.extend(observed.group_services.iter().copied());
    indices.extend(observed.network_policies.iter().copied());
    indices.extend(observed.group_secrets.iter().copied());

    let remembered: BTreeMap<i32, GroupStatus> = prev
        .group_statuses
        .iter()
        .map(|g| (g.index, g.clone()))
        .collect();

    let mut groups: BTreeMap<i32, GroupStatus> = BTreeMap::new();
    let mut triggers: BTreeMap<i32, Trigger> = BTreeMap::new();

    // Pass 1: removal of extra groups, recovery of memory, triggers.
    for &g in &indices {
        let pods: Vec<&ObservedPod> = observed.pods.iter().filter(|p| p.group == g).collect();
        if g >= desired_groups {
            if let Some(mem) = scale_down_group(&mut ctx, g, &pods, remembered.get(&g)) {
                groups.insert(g, mem);
            }
            continue;
        }
        let mut mem = remembered.get(&g).cloned().unwrap_or_else(|| GroupStatus {
            index: g,
            ..Default::default()
        });
        // The status may have been lost or be older than the pods (a status write that
        // failed): the pods' labels are the truth about incarnations.
        if let Some(max) = pods.iter().map(|p| p.incarnation).max()
            && max > mem.incarnation
        {
            mem.incarnation = max;
            if let Some(p) = pods.iter().find(|p| p.incarnation == max) {
                mem.revision = p.revision.clone();
            }
            if mem.phase == GroupPhase::Restarting {
                mem.phase = GroupPhase::Pending;
            }
        }
        if let Some(t) = find_trigger(&ctx, &mem, &pods) {
            triggers.insert(g, t);
        }
        groups.insert(g, mem);
    }

    // Pass 2: decide which triggers fire now. Failure repairs first; planned restarts
    // (rollout, restart request) only while fewer than maxUnavailableGroups groups are
    // down, highest index first.
    let max_unavailable = input.spec.rollout.max_unavailable_groups.max(1);
    let settle = Settle {
        min_ready: Duration::from_secs(input.spec.rollout.min_ready_seconds.max(0) as u64),
        now: input.now,
    };
    let mut unavailable = groups
        .values()
        .filter(|m| m.index < desired_groups && !group_available(m, &triggers, &settle))
        .count() as i32;
    // A planned restart held back only by a group still settling: plan again when it
    // has settled.
    let planned_waiting = triggers.values().any(|t| !is_failure(t.reason));
    if planned_waiting && let Some(d) = groups.values().filter_map(|m| settle.remaining(m)).min() {
        ctx.requeue_in(d);
    }
    let mut fire: BTreeMap<i32, Trigger> = BTreeMap::new();
    for (&g, t) in triggers.iter() {
        if is_failure(t.reason) {
            fire.insert(g, t.clone());
        }
    }
    for (&g, t) in triggers.iter().rev() {
        if is_failure(t.reason) {
            continue;
        }
        let Some(mem) = groups.get(&g) else {
            fire.insert(g, t.clone());
            continue;
        };
        // A Ready group still settling may not be behind the Service yet: it is not taken
        // down before it has settled (the requeue above comes back for it).
        let settling = settle.remaining(mem).is_some();
        if !group_available(mem, &triggers, &Settle::at_once(input.now)) {
            // Already down: restarting it takes nothing more away.
            fire.insert(g, t.clone());
        } else if !settling && unavailable < max_unavailable {
            unavailable += 1;
            fire.insert(g, t.clone());
        }
    }

    // Pass 3: act on each desired group.
    for g in 0..desired_groups {
        let pods: Vec<&ObservedPod> = observed.pods.iter().filter(|p| p.group == g).collect();
        let mem = groups.remove(&g).expect("every desired index has memory");
        let prev_phase = remembered.get(&g).map(|m| m.phase);
        // The Service, NetworkPolicy and key Secret come before the pods that use them.
        ensure_group_objects(&mut ctx, g);
        let mem = step_group(&mut ctx, mem, &pods, fire.remove(&g), prev_phase);
        groups.insert(g, mem);
    }

    let group_statuses: Vec<GroupStatus> = groups.into_values().collect();
    let status = status::summarize(&ctx, &prev, group_statuses);
    Plan {
        actions: ctx.actions,
        status,
        co_restarts: ctx.co_restarts,
        became_ready: ctx.became_ready,
        requeue_after: ctx.requeue,
        resets: ctx.resets,
    }
}

/// `rollout.minReadySeconds` at the time of this plan.
struct Settle {
    min_ready: Duration,
    now: Timestamp,
}

impl Settle {
    /// No settle time: Ready counts at once.
    fn at_once(now: Timestamp) -> Self {
        Self {
            min_ready: Duration::ZERO,
            now,
        }
    }

    /// How long until a Ready group has been Ready for `min_ready`; `None` when it has
    /// (or is not Ready).
    fn remaining(&self, mem: &GroupStatus) -> Option<Duration> {
        if mem.phase != GroupPhase::Ready || self.min_ready.is_zero() {
            return None;
        }
        let since = mem.ready_since.as_ref()?.0;
        let left = until(self.now, add(since, self.min_ready));
        (!left.is_zero()).then_some(left)
    }
}

/// A group counts as available for the rollout budget when it is Ready, has been for
/// `rollout.minReadySeconds`, and nothing is about to break it.
fn group_available(mem: &GroupStatus, triggers: &BTreeMap<i32, Trigger>, settle: &Settle) -> bool {
    mem.phase == GroupPhase::Ready
        && settle.remaining(mem).is_none()
        && triggers
            .get(&mem.index)
            .is_none_or(|t| !is_failure(t.reason))
}

/// Close the readiness gate of every decode pod in `pods` whose gate is open.
fn close_gates(ctx: &mut Ctx<'_>, pods: &[&ObservedPod]) {
    for p in pods {
        if p.role == Role::Decode && p.group_ready_gate {
            ctx.actions.push(PlannedAction::SetGroupReadyGate {
                pod: p.name.clone(),
                ready: false,
            });
        }
    }
}

/// Emit an event when a group's phase changes.
fn note_phase(ctx: &mut Ctx<'_>, mem: &GroupStatus, prev: Option<GroupPhase>) {
    if prev == Some(mem.phase) {
        return;
    }
    let from = prev.map_or("None".to_string(), |p| format!("{p:?}"));
    let type_ = if mem.phase == GroupPhase::Broken {
        EventKind::Warning
    } else {
        EventKind::Normal
    };
    let mut message = format!(
        "group {}: {from} → {:?} at incarnation {}",
        mem.index, mem.phase, mem.incarnation
    );
    if let Some(m) = &mem.message {
        message.push_str(": ");
        message.push_str(m);
    }
    ctx.event(type_, EventReason::GroupPhaseChanged, mem.index, message);
}

#[cfg(test)]
mod grace_tests;
#[cfg(test)]
mod props;
#[cfg(test)]
mod reset_tests;
#[cfg(test)]
mod router_tests;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod status_tests;
#[cfg(test)]
mod tests;
