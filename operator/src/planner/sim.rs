//! A simulated cluster for planner tests: it applies the planner's actions the way the
//! API server and kubelet would (created pods start Pending; deleted pods linger while
//! terminating) and checks the ordering invariants after every reconcile.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::*;
use crate::crd::{CoRestartReason, GroupPhase, PDDeploymentSpec, PDDeploymentStatus};

/// The pods' own grace period (`terminationGracePeriodSeconds`, Kubernetes' default).
pub const POD_GRACE_SECONDS: i64 = 30;

pub struct Sim {
    pub name: String,
    pub spec: PDDeploymentSpec,
    pub status: Option<PDDeploymentStatus>,
    pub pods: BTreeMap<String, ObservedPod>,
    pub observed_objects: Observed,
    pub now: Timestamp,
    pub restart_requested_at: Option<Timestamp>,
    /// Every action ever applied, in order.
    pub history: Vec<PlannedAction>,
    /// Groups brought down by a planned restart and not Ready again yet (invariant I3).
    pub rolling: BTreeSet<i32>,
    pub last_plan: Option<Plan>,
    /// Pods that do not complete an in-place reset asked of them (a wedged member, or one
    /// its executor cannot reach); every other member resets at once and is ready.
    pub reset_refused: BTreeSet<String>,
}

impl Sim {
    pub fn new(spec: PDDeploymentSpec) -> Self {
        Self {
            name: "demo".into(),
            spec,
            status: None,
            pods: BTreeMap::new(),
            observed_objects: Observed::default(),
            now: "2026-01-01T00:00:00Z".parse().unwrap(),
            restart_requested_at: None,
            history: Vec::new(),
            rolling: BTreeSet::new(),
            last_plan: None,
            reset_refused: BTreeSet::new(),
        }
    }

    pub fn observed(&self) -> Observed {
        let mut o = self.observed_objects.clone();
        o.pods = self.pods.values().cloned().collect();
        o
    }

    /// Plan without applying (to inspect what the planner would do).
    pub fn peek(&self) -> Plan {
        let observed = self.observed();
        plan(&PlanInput {
            name: &self.name,
            generation: Some(1),
            spec: &self.spec,
            status: self.status.as_ref(),
            restart_requested_at: self.restart_requested_at,
            observed: &observed,
            now: self.now,
        })
    }

    /// One reconcile: plan, check invariants, apply every action, keep the status.
    pub fn reconcile(&mut self) -> Plan {
        let plan = self.peek();
        for a in &plan.actions {
            self.check_before(a);
            self.apply(a);
        }
        for r in &plan.co_restarts {
            let was_ready = self.status.as_ref().is_some_and(|s| {
                s.group_statuses
                    .iter()
                    .any(|g| g.index == r.group && g.phase == GroupPhase::Ready)
            });
            if is_failure(r.reason) {
                self.rolling.remove(&r.group);
            } else if was_ready {
                // Taken down by the rollout (a group that was already down is not).
                self.rolling.insert(r.group);
            }
        }
        self.status = Some(plan.status.clone());
        for g in &plan.status.group_statuses {
            if g.phase == GroupPhase::Ready || g.index >= self.spec.groups {
                self.rolling.remove(&g.index);
            }
        }
        self.check_after();
        self.last_plan = Some(plan.clone());
        plan
    }

    fn apply(&mut self, a: &PlannedAction) {
        self.history.push(a.clone());
        let o = &mut self.observed_objects;
        match a {
            PlannedAction::ApplyClientService => o.client_service = true,
            PlannedAction::ApplyRouter => o.router = true,
            PlannedAction::DeleteRouter => o.router = false,
            PlannedAction::ApplyGroupService { group } => {
                o.group_services.insert(*group);
            }
            PlannedAction::ApplyNetworkPolicy { group } => {
                o.network_policies.insert(*group);
            }
            PlannedAction::CreateGroupSecret { group } => {
                o.group_secrets.insert(*group);
            }
            PlannedAction::DeleteGroupResources { group } => {
                o.group_services.remove(group);
                o.network_policies.remove(group);
                o.group_secrets.remove(group);
            }
            PlannedAction::CreatePod(intent) => {
                assert!(
                    !self.pods.contains_key(&intent.name),
                    "created {} twice",
                    intent.name
                );
                self.pods.insert(
                    intent.name.clone(),
                    ObservedPod {
                        name: intent.name.clone(),
                        group: intent.group,
                        role: intent.role,
                        index: intent.index,
                        revision: intent.revision.clone(),
                        incarnation: intent.incarnation,
                        phase: PodPhase::Pending,
                        terminating: false,
                        ready: false,
                        not_ready_since: Some(self.now),
                        group_ready_gate: false,
                        gate_closed_since: None,
                        deletion_deadline: None,
                        node_lost: false,
                        waiting: None,
                        exit: None,
                        ready_detail: None,
                    },
                );
            }
            PlannedAction::DeletePod { name, grace, .. } => {
                // Like the API server: `deletionTimestamp` is the delete's grace ahead (the
                // pod's own, 30 s, when the delete names none).
                let secs = match grace {
                    Grace::Full => POD_GRACE_SECONDS,
                    Grace::Unresponsive { seconds, .. } => i64::from(*seconds),
                };
                let deadline = self
                    .now
                    .checked_add(SignedDuration::from_secs(secs))
                    .unwrap();
                if let Some(p) = self.pods.get_mut(name) {
                    p.terminating = true;
                    p.deletion_deadline = Some(deadline);
                }
            }
            PlannedAction::ForceDeletePod { name, .. } => {
                let p = self.pods.remove(name).expect("force-deleted pod exists");
                assert!(
                    p.terminating,
                    "{name} force-deleted without being deleted first"
                );
                let deadline = p
                    .deletion_deadline
                    .expect("terminating pods have a deadline");
                assert!(
                    self.now
                        >= deadline
                            .checked_add(SignedDuration::try_from(force_delete_margin(&p)).unwrap())
                            .unwrap(),
                    "{name} force-deleted before its grace period and the margin ran out"
                );
            }
            PlannedAction::ResetMember {
                name,
                to_incarnation,
                ..
            } => {
                // Like an executor whose call the member answered "ready at the new
                // incarnation": the label moves on, and the member is ready there.
                if !self.reset_refused.contains(name)
                    && let Some(p) = self.pods.get_mut(name)
                {
                    p.incarnation = *to_incarnation;
                    p.ready = true;
                    p.not_ready_since = None;
                    p.ready_detail = None;
                }
            }
            PlannedAction::SetGroupReadyGate { pod, ready } => {
                if let Some(p) = self.pods.get_mut(pod) {
                    // Like the controller's patch: the condition's transition time.
                    if p.group_ready_gate != *ready {
                        p.gate_closed_since = (!*ready).then_some(self.now);
                    }
                    p.group_ready_gate = *ready;
                }
            }
            PlannedAction::Event(_) => {}
        }
    }

    /// Invariants that concern one action before it takes effect.
    fn check_before(&self, a: &PlannedAction) {
        if let PlannedAction::DeletePod {
            name,
            reason,
            grace,
            ..
        } = a
        {
            self.check_grace(name, *reason, *grace);
        }
        match a {
            // I2: a decode pod is created only when every prefill pod of its incarnation
            // exists, runs and is Ready.
            // I7: an in-place reset asks only a live member, prefill first: a decode only
            // once every prefill of its group serves the new incarnation and is ready.
            PlannedAction::ResetMember {
                name,
                group,
                role,
                from_incarnation,
                to_incarnation,
                ..
            } => {
                let pod = self
                    .pods
                    .get(name)
                    .unwrap_or_else(|| panic!("I7: reset of unknown pod {name}"));
                assert!(
                    pod.phase == PodPhase::Running && !pod.terminating && !pod.node_lost,
                    "I7: reset of {name}, which is not a live member: {pod:?}"
                );
                assert!(
                    pod.incarnation == *from_incarnation && from_incarnation < to_incarnation,
                    "I7: reset of {name} from {from_incarnation} to {to_incarnation}, pod at {}",
                    pod.incarnation
                );
                if *role == Role::Decode {
                    for p in self
                        .pods
                        .values()
                        .filter(|p| p.group == *group && p.role == Role::Prefill)
                    {
                        assert!(
                            p.incarnation == *to_incarnation && p.ready,
                            "I7: decode {name} reset to {to_incarnation} before prefill {} (incarnation {}, ready {})",
                            p.name,
                            p.incarnation,
                            p.ready
                        );
                    }
                }
            }
            PlannedAction::CreatePod(intent) if intent.role == Role::Decode => {
                let prefill: Vec<_> = self
                    .pods
                    .values()
                    .filter(|p| p.group == intent.group && p.role == Role::Prefill)
                    .collect();
                assert_eq!(
                    prefill.len() as i32,
                    intent.template.prefill.replicas,
                    "I2: decode {} created with {} prefill pods",
                    intent.name,
                    prefill.len()
                );
                for p in prefill {
                    assert!(
                        p.incarnation == intent.incarnation
                            && p.ready
                            && p.phase == PodPhase::Running
                            && !p.terminating,
                        "I2: decode {} created while prefill {p:?} not Ready at its incarnation",
                        intent.name
                    );
                }
            }
            // I5: policy None deletes nothing on its own initiative: only pods whose group
            // is no longer wanted. Judged from the pod itself and the spec, not from the
            // reason the planner gives (which would let a mislabelled deletion through).
            PlannedAction::DeletePod { name, reason, .. }
                if self.spec.restart.policy == RestartPolicy::None =>
            {
                let pod = self
                    .pods
                    .get(name)
                    .unwrap_or_else(|| panic!("I5: deletion of unknown pod {name}"));
                assert!(
                    pod.group >= self.spec.groups,
                    "I5: policy None deleted {name} of group {} while spec.groups is {} ({reason:?})",
                    pod.group,
                    self.spec.groups
                );
                assert_eq!(
                    *reason,
                    DeleteReason::ScaleDown,
                    "I5: {name}: a scale-down deletion is reported as such"
                );
            }
            _ => {}
        }
    }

    /// I6: the grace of a delete. Judged from the pod itself and the spec where they
    /// tell: a pod of a group no longer wanted, or one removed by a rollout or a restart
    /// request, keeps its full grace; so does a member that is ready on a live node (it
    /// drains). A member that has exited, or whose node is lost, removed by a failure
    /// co-restart gets the short grace, and a short grace is `unresponsiveGraceSeconds`.
    fn check_grace(&self, name: &str, reason: DeleteReason, grace: Grace) {
        let pod = self
            .pods
            .get(name)
            .unwrap_or_else(|| panic!("I6: deletion of unknown pod {name}"));
        let planned = pod.group >= self.spec.groups
            || matches!(
                reason,
                DeleteReason::ScaleDown
                    | DeleteReason::CoRestart(
                        CoRestartReason::RevisionChanged | CoRestartReason::RestartRequested
                    )
            );
        let exited = matches!(pod.phase, PodPhase::Failed | PodPhase::Succeeded);
        if planned || (pod.ready && !pod.node_lost && !exited) {
            assert_eq!(
                grace,
                Grace::Full,
                "I6: {name} ({reason:?}, ready {}) must keep its full grace",
                pod.ready
            );
        } else if exited || pod.node_lost {
            assert!(
                matches!(grace, Grace::Unresponsive { .. }),
                "I6: {name} ({reason:?}, {:?}, node lost {}) removed by a failure with {grace:?}",
                pod.phase,
                pod.node_lost
            );
        }
        if let Grace::Unresponsive { seconds, .. } = grace {
            assert_eq!(
                seconds, self.spec.health.unresponsive_grace_seconds,
                "I6: {name}: the short grace is health.unresponsiveGraceSeconds"
            );
        }
    }

    /// Invariants over the whole cluster after a reconcile.
    fn check_after(&self) {
        // I1: a decode pod never serves beside a prefill pod of another incarnation in its
        // group, and is never ahead of one (terminating pods included: they may still be
        // serving). Only an in-place reset moves a prefill ahead of its decode (prefill
        // first), and the decode's gate is then closed until both serve one incarnation
        // (the prefill refuses the decode's old incarnation at the handshake anyway); the
        // pair may stay so while the group is torn down or held back (a co-restart
        // waiting for its backoff), never serving.
        for d in self.pods.values().filter(|p| p.role == Role::Decode) {
            for p in self
                .pods
                .values()
                .filter(|p| p.role == Role::Prefill && p.group == d.group)
            {
                if d.incarnation == p.incarnation {
                    continue;
                }
                let g = self
                    .status
                    .as_ref()
                    .and_then(|s| s.group_statuses.iter().find(|g| g.index == d.group));
                assert!(
                    p.incarnation > d.incarnation && !d.group_ready_gate,
                    "I1: decode {} (incarnation {}, gate {}) beside prefill {} (incarnation {}), group {:?}",
                    d.name,
                    d.incarnation,
                    d.group_ready_gate,
                    p.name,
                    p.incarnation,
                    g.map(|g| (g.phase, g.incarnation, g.reset.clone()))
                );
            }
        }
        // I3: planned restarts never take more than maxUnavailableGroups groups down.
        let max = self.spec.rollout.max_unavailable_groups as usize;
        assert!(
            self.rolling.len() <= max,
            "I3: {} groups down for the rollout (max {max}): {:?}",
            self.rolling.len(),
            self.rolling
        );
        // I8: the backoff holds only a group that cannot stay up: one that has not been
        // Ready at its incarnation since its last co-restart (a crash loop), or one with
        // `FLAPPING_STREAK` failures in a row. A group that served again and fails once
        // more is repaired at once.
        if let Some(st) = &self.status {
            for g in &st.group_statuses {
                let held = g.phase == GroupPhase::Broken
                    && g.message
                        .as_deref()
                        .is_some_and(|m| m.contains("held back by backoff"));
                assert!(
                    !held
                        || g.ready_since.is_none()
                        || g.backoff_streak >= super::group::FLAPPING_STREAK,
                    "I8: group {} held by the backoff after serving again (streak {}): {:?}",
                    g.index,
                    g.backoff_streak,
                    g.message
                );
            }
        }
        // The readiness gate is open only on decode pods of a Ready group.
        if let Some(st) = &self.status {
            for p in self.pods.values().filter(|p| p.group_ready_gate) {
                let g = st.group_statuses.iter().find(|g| g.index == p.group);
                assert!(
                    g.is_some_and(
                        |g| g.phase == GroupPhase::Ready && g.incarnation == p.incarnation
                    ),
                    "gate open on {} while its group is {:?}",
                    p.name,
                    g.map(|g| g.phase)
                );
            }
        }
    }

    // ---- the kubelet and the outside world ----

    pub fn advance(&mut self, secs: u64) {
        self.now = self
            .now
            .checked_add(SignedDuration::from_secs(secs as i64))
            .unwrap();
    }

    pub fn set_ready(&mut self, name: &str, ready: bool) {
        let now = self.now;
        let p = self.pods.get_mut(name).expect("pod exists");
        if p.terminating || matches!(p.phase, PodPhase::Failed | PodPhase::Succeeded) {
            return;
        }
        p.phase = PodPhase::Running;
        if ready {
            // Its node reports again.
            p.node_lost = false;
        }
        if p.ready != ready {
            p.ready = ready;
            p.not_ready_since = if ready { None } else { Some(now) };
        }
        if ready {
            // The executors read `/ready` of not-ready pods only.
            p.ready_detail = None;
        }
    }

    /// A running decode answers `/ready` with `reason` (the executor read it).
    pub fn report(&mut self, name: &str, reason: &str, message: &str) {
        self.set_ready(name, false);
        self.pods.get_mut(name).expect("pod exists").ready_detail =
            Some(ReadyDetail::new(reason, message));
    }

    /// A running decode answers `/ready` with `no_progress`, saying `stalled` (`engine`,
    /// `kv_transfer`, or nothing: an older dataplane).
    pub fn report_no_progress(&mut self, name: &str, stalled: Option<&str>) {
        self.set_ready(name, false);
        self.pods.get_mut(name).expect("pod exists").ready_detail = Some(ReadyDetail {
            stalled: stalled.map(str::to_owned),
            ..ReadyDetail::new("no_progress", "engine_progress: work is making no progress")
        });
    }

    pub fn fail(&mut self, name: &str) {
        let now = self.now;
        let p = self.pods.get_mut(name).expect("pod exists");
        p.phase = PodPhase::Failed;
        if p.ready {
            p.ready = false;
            p.not_ready_since = Some(now);
        }
    }

    /// Eviction or `kubectl delete`: the pod starts terminating.
    pub fn evict(&mut self, name: &str) {
        let deadline = self
            .now
            .checked_add(SignedDuration::from_secs(POD_GRACE_SECONDS))
            .unwrap();
        let p = self.pods.get_mut(name).expect("pod exists");
        p.terminating = true;
        p.deletion_deadline = Some(deadline);
    }

    /// The pod's node stops reporting: the node lifecycle controller turns its `Ready`
    /// False; the kubelet, gone, never finishes a termination there.
    pub fn lose_node_of(&mut self, name: &str) {
        let now = self.now;
        let p = self.pods.get_mut(name).expect("pod exists");
        p.node_lost = true;
        if p.ready {
            p.ready = false;
            p.not_ready_since = Some(now);
        }
    }

    /// The pod object disappears at once (force delete, node loss).
    pub fn vanish(&mut self, name: &str) {
        self.pods.remove(name);
    }

    /// Terminating pods finish terminating, except on a lost node (only a force delete
    /// removes those).
    pub fn finish_terminations(&mut self) {
        self.pods.retain(|_, p| !p.terminating || p.node_lost);
    }

    /// The kubelet starts every pending pod and its dataplane becomes ready.
    pub fn start_pending(&mut self) {
        let names: Vec<String> = self
            .pods
            .values()
            .filter(|p| p.phase == PodPhase::Pending && !p.terminating)
            .map(|p| p.name.clone())
            .collect();
        for n in names {
            self.set_ready(&n, true);
        }
    }

    /// Faults stop: lost nodes report again (their kubelets finish the terminations
    /// there) and every live pod's dataplane becomes ready.
    pub fn heal_all(&mut self) {
        for p in self.pods.values_mut() {
            p.node_lost = false;
        }
        let names: Vec<String> = self
            .pods
            .values()
            .filter(|p| {
                !p.terminating && !matches!(p.phase, PodPhase::Failed | PodPhase::Succeeded)
            })
            .map(|p| p.name.clone())
            .collect();
        for n in names {
            self.set_ready(&n, true);
        }
    }

    /// Reconcile with a healthy kubelet until nothing changes; returns the steps taken.
    pub fn settle(&mut self, max_steps: usize) -> usize {
        for step in 0..max_steps {
            let plan = self.reconcile();
            let idle = plan
                .actions
                .iter()
                .all(|a| matches!(a, PlannedAction::Event(_)))
                && !self
                    .pods
                    .values()
                    .any(|p| p.terminating || p.phase == PodPhase::Pending);
            if idle {
                return step;
            }
            self.start_pending();
            self.finish_terminations();
            if let Some(d) = plan.requeue_after {
                self.advance(d.as_secs().max(1));
            }
        }
        max_steps
    }

    pub fn pods_of(&self, group: i32, role: Role) -> Vec<&ObservedPod> {
        self.pods
            .values()
            .filter(|p| p.group == group && p.role == role)
            .collect()
    }

    pub fn group(&self, g: i32) -> &crate::crd::GroupStatus {
        self.status
            .as_ref()
            .and_then(|s| s.group_statuses.iter().find(|x| x.index == g))
            .expect("group status")
    }

    pub fn events(&self, plan: &Plan) -> Vec<PlannedEvent> {
        plan.actions
            .iter()
            .filter_map(|a| match a {
                PlannedAction::Event(e) => Some(e.clone()),
                _ => None,
            })
            .collect()
    }

    pub fn deleted(plan: &Plan) -> Vec<(String, Role)> {
        plan.actions
            .iter()
            .filter_map(|a| match a {
                PlannedAction::DeletePod { name, role, .. } => Some((name.clone(), *role)),
                _ => None,
            })
            .collect()
    }

    pub fn created(plan: &Plan) -> Vec<(String, Role)> {
        plan.actions
            .iter()
            .filter_map(|a| match a {
                PlannedAction::CreatePod(i) => Some((i.name.clone(), i.role)),
                _ => None,
            })
            .collect()
    }

    pub fn co_restart_reasons(plan: &Plan) -> Vec<(i32, CoRestartReason)> {
        plan.co_restarts
            .iter()
            .map(|r| (r.group, r.reason))
            .collect()
    }
}
