//! One desired group's step: its objects, the triggers that would co-restart it, the
//! co-restart itself (held back by policy or backoff), removal of old members decode
//! first, and the removal of a group that was scaled away.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::build::{build_group, decode_not_ready};
use super::{
    CoRestart, Ctx, DeleteReason, ENDPOINTS_SETTLE, EventKind, Grace, ObservedPod, PlannedAction,
    PodPhase, READY_DETAIL_REFRESH, Role, Trigger, UnresponsiveCause, add, backoff_delay,
    close_gates, force_delete_margin, is_failure, not_ready_deadline, note_phase, until,
};
use crate::crd::{CoRestartReason, CoRestartRecord, GroupPhase, GroupStatus, RestartPolicy};
use crate::reasons::EventReason;

/// The group's Service and NetworkPolicy (applied every time), and its key Secret (created
/// only when missing: pods may be using the key).
pub(super) fn ensure_group_objects(ctx: &mut Ctx<'_>, g: i32) {
    let obs = ctx.input.observed;
    ctx.actions
        .push(PlannedAction::ApplyGroupService { group: g });
    ctx.actions
        .push(PlannedAction::ApplyNetworkPolicy { group: g });
    if !obs.group_secrets.contains(&g) {
        ctx.actions
            .push(PlannedAction::CreateGroupSecret { group: g });
    }
}

/// Remove a group whose index is no longer desired: decode first, then prefill, then its
/// Service, NetworkPolicy and Secret. Returns its memory while anything is left.
pub(super) fn scale_down_group(
    ctx: &mut Ctx<'_>,
    g: i32,
    pods: &[&ObservedPod],
    mem: Option<&GroupStatus>,
) -> Option<GroupStatus> {
    let obs = ctx.input.observed;
    let mut mem = mem.cloned().unwrap_or_else(|| GroupStatus {
        index: g,
        ..Default::default()
    });
    if mem.phase != GroupPhase::ScalingDown {
        ctx.event(
            EventKind::Normal,
            EventReason::ScalingDown,
            g,
            format!(
                "group {g}: removing (spec.groups is {})",
                ctx.input.spec.groups
            ),
        );
    }
    mem.phase = GroupPhase::ScalingDown;
    // An in-place reset in progress ends: the group's pods go.
    mem.reset = None;
    mem.bootstrap_healthy = false;
    mem.decode_not_ready = None;
    close_gates(ctx, pods);
    if !endpoints_settled(ctx, pods) || !remove_in_order(ctx, pods, DeleteReason::ScaleDown) {
        return Some(mem);
    }
    if obs.group_services.contains(&g)
        || obs.network_policies.contains(&g)
        || obs.group_secrets.contains(&g)
    {
        ctx.actions
            .push(PlannedAction::DeleteGroupResources { group: g });
        return Some(mem);
    }
    None
}

/// True once no live decode among `pods` can still be routed to: each one's gate is closed
/// and, where its executor's routing lags (`gate_closed_since`), has been for
/// [`ENDPOINTS_SETTLE`]. Otherwise asks to be called again when that will be so.
fn endpoints_settled(ctx: &mut Ctx<'_>, pods: &[&ObservedPod]) -> bool {
    let now = ctx.input.now;
    let mut settled = true;
    for p in pods
        .iter()
        .filter(|p| p.role == Role::Decode && !p.terminating)
    {
        if p.group_ready_gate {
            // Closed by this plan (close_gates); observed closed on a later pass.
            ctx.requeue_in(ENDPOINTS_SETTLE);
            settled = false;
        } else if let Some(since) = p.gate_closed_since {
            let at = add(since, ENDPOINTS_SETTLE);
            if now < at {
                ctx.requeue_in(until(now, at));
                settled = false;
            }
        }
    }
    settled
}

/// Delete `pods` decode first: prefill pods are deleted only once no decode pod is left
/// (terminating ones included), but for decodes terminating on a lost node, which can
/// drain nothing and whose end no kubelet will confirm (their force-delete follows). Returns
/// true when nothing is left.
fn remove_in_order(ctx: &mut Ctx<'_>, pods: &[&ObservedPod], reason: DeleteReason) -> bool {
    let mut left = false;
    for role in [Role::Decode, Role::Prefill] {
        let of_role: Vec<&&ObservedPod> = pods.iter().filter(|p| p.role == role).collect();
        if of_role.is_empty() {
            continue;
        }
        left = true;
        let holds_the_next_role = of_role.iter().any(|p| !(p.terminating && p.node_lost));
        for p in &of_role {
            if p.terminating {
                force_delete_if_stuck(ctx, p);
            } else {
                let grace = removal_grace(ctx, p, pods, reason);
                if let Grace::Unresponsive { seconds, cause } = grace {
                    ctx.event(
                        EventKind::Warning,
                        EventReason::UnresponsiveMemberDeleted,
                        p.group,
                        format!(
                            "{} pod {} (incarnation {}) deleted with grace {seconds}s for {}: {}",
                            role.as_str(),
                            p.name,
                            p.incarnation,
                            reason.as_str(),
                            cause.describe()
                        ),
                    );
                }
                ctx.actions.push(PlannedAction::DeletePod {
                    name: p.name.clone(),
                    group: p.group,
                    role,
                    incarnation: p.incarnation,
                    reason,
                    grace,
                });
            }
        }
        if holds_the_next_role {
            return false;
        }
    }
    !left
}

/// The grace a member is deleted with: the short `health.unresponsiveGraceSeconds` for a
/// member that is the cause of a failure co-restart and cannot drain, its full grace for
/// everything else.
///
/// Why: the grace period is there so that a process can finish its work after SIGTERM. A
/// process that is stopped or wedged cannot act on SIGTERM, so its grace only delays the
/// SIGKILL — and its group's rebuild, which waits for the old pods to be gone (a SIGSTOPped
/// prefill held its group 30 s). A planned removal (rollout, restart request, scale-down)
/// takes healthy members, which drain, so it always keeps the full grace. In a failure
/// co-restart a member is taken for the cause, and gets the short grace, when it
/// - has exited (nothing is left to drain);
/// - is on a node that stopped reporting (no kubelet will stop it gracefully; the grace
///   only delays the force-delete, which follows `deletionTimestamp`);
/// - is a prefill that is not ready (its readiness is its own engine and KV loop);
/// - is a decode that is not ready while every prefill of its incarnation is ready (its
///   readiness is its channel to them, so with healthy prefills the fault is its own).
///
/// The healthy peer keeps its full grace: a ready member, and a decode that is not ready
/// only because a prefill of its incarnation is not (its channel is down with its peer),
/// is alive, acts on SIGTERM, ends its requests with a reason and exits well within its
/// grace. A pod of a stale incarnation is judged the same way: being stale says nothing
/// about whether it can drain.
fn removal_grace(
    ctx: &Ctx<'_>,
    p: &ObservedPod,
    pods: &[&ObservedPod],
    reason: DeleteReason,
) -> Grace {
    let DeleteReason::CoRestart(r) = reason else {
        return Grace::Full;
    };
    if !is_failure(r) {
        return Grace::Full;
    }
    let cause = if matches!(p.phase, PodPhase::Failed | PodPhase::Succeeded) {
        UnresponsiveCause::Exited
    } else if p.node_lost {
        UnresponsiveCause::NodeLost
    } else if p.ready {
        return Grace::Full;
    } else if p.role == Role::Prefill || prefills_ready(p, pods) {
        UnresponsiveCause::NotReady
    } else {
        return Grace::Full;
    };
    Grace::Unresponsive {
        seconds: ctx.input.spec.health.unresponsive_grace_seconds.max(1),
        cause,
    }
}

/// Every prefill of `decode`'s incarnation among `pods` runs and is ready (and there is
/// one): nothing on the prefill side explains the decode's not being ready.
fn prefills_ready(decode: &ObservedPod, pods: &[&ObservedPod]) -> bool {
    let mut prefills = pods
        .iter()
        .filter(|q| q.role == Role::Prefill && q.incarnation == decode.incarnation)
        .peekable();
    prefills.peek().is_some()
        && prefills.all(|q| q.ready && !q.terminating && q.phase == PodPhase::Running)
}

/// A terminating pod past its grace period plus its margin ([`FORCE_DELETE_MARGIN`](super::FORCE_DELETE_MARGIN), none
/// on a lost node: [`force_delete_margin`]) is force-deleted
/// (and reported); before that, ask to be called again when the margin runs out.
fn force_delete_if_stuck(ctx: &mut Ctx<'_>, p: &ObservedPod) {
    let Some(deadline) = p.deletion_deadline else {
        return;
    };
    let limit = add(deadline, force_delete_margin(p));
    let now = ctx.input.now;
    if now < limit {
        ctx.requeue_in(until(now, limit));
        return;
    }
    ctx.actions.push(PlannedAction::ForceDeletePod {
        name: p.name.clone(),
        group: p.group,
        role: p.role,
    });
    ctx.event(
        EventKind::Warning,
        EventReason::PodForceDeleted,
        p.group,
        format!(
            "{} pod {} is still terminating {}s after its grace period ended (its node is gone or its kubelet hung): deleted with grace period 0",
            p.role.as_str(),
            p.name,
            until(deadline, now).as_secs()
        ),
    );
}

/// Look for a reason to co-restart a started group (pods of its incarnation exist or
/// existed). Most severe first.
pub(super) fn find_trigger(
    ctx: &Ctx<'_>,
    mem: &GroupStatus,
    pods: &[&ObservedPod],
) -> Option<Trigger> {
    if mem.incarnation == 0 || mem.phase == GroupPhase::Restarting || mem.reset.is_some() {
        // A co-restart in progress handles its own faults (an in-place reset falls back).
        return None;
    }
    let input = ctx.input;
    let current: Vec<&&ObservedPod> = pods
        .iter()
        .filter(|p| p.incarnation == mem.incarnation)
        .collect();
    if let Some(p) = current
        .iter()
        .find(|p| matches!(p.phase, PodPhase::Failed | PodPhase::Succeeded))
    {
        return Some(Trigger {
            reason: CoRestartReason::MemberFailed,
            detail: format!(
                "{} pod {} exited ({:?}{})",
                p.role.as_str(),
                p.name,
                p.phase,
                p.exit
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ),
        });
    }
    if let Some(p) = current.iter().find(|p| p.terminating) {
        return Some(Trigger {
            reason: CoRestartReason::MemberDeleted,
            detail: format!("{} pod {} is being deleted", p.role.as_str(), p.name),
        });
    }
    if let Some(missing) = mem
        .pods
        .iter()
        .find(|n| !pods.iter().any(|p| &p.name == *n))
    {
        return Some(Trigger {
            reason: CoRestartReason::MemberDeleted,
            detail: format!("pod {missing} vanished"),
        });
    }
    if let Some(p) = pods
        .iter()
        .find(|p| p.incarnation != mem.incarnation && !p.terminating)
    {
        return Some(Trigger {
            reason: CoRestartReason::IncarnationMismatch,
            detail: format!(
                "pod {} has incarnation {}, group has {}",
                p.name, p.incarnation, mem.incarnation
            ),
        });
    }
    let window = Duration::from_secs(input.spec.health.co_restart_after_seconds.max(1) as u64);
    // A group whose members completed an in-place reset was ready as they answered it (they
    // said so): a decode that fails again before the kubelet saw it ready counts as wedged
    // (the next co-restart then recreates the pods).
    let reset_done = mem.last_co_restart.as_ref().is_some_and(|r| r.in_place);
    let group_was_ready = mem.ready_since.is_some() || reset_done;
    let decode_exists = current.iter().any(|p| p.role == Role::Decode);
    for p in &current {
        // A prefill was Ready if decode pods were created for it; a decode was Ready if
        // its group was.
        let was_ready = group_was_ready || (p.role == Role::Prefill && decode_exists);
        if p.ready || !was_ready {
            continue;
        }
        let since = p.not_ready_since.unwrap_or(input.now);
        let deadline = not_ready_deadline(&input.spec.health, since);
        if deadline <= input.now {
            let mut detail = format!(
                "{} pod {} not ready for more than {}s",
                p.role.as_str(),
                p.name,
                window.as_secs()
            );
            if let Some(d) = &p.ready_detail {
                detail.push_str(&format!(": {}: {}", d.reason, d.message));
            }
            return Some(Trigger {
                reason: CoRestartReason::MemberNotReady,
                detail,
            });
        }
    }
    if let Some(req) = input.restart_requested_at {
        // A request in the future (clock skew) would restart the group over and over.
        let started = mem.since.as_ref().map(|t| t.0);
        if req <= input.now && started.is_none_or(|s| s < req) {
            return Some(Trigger {
                reason: CoRestartReason::RestartRequested,
                detail: format!("restart requested at {req}"),
            });
        }
    }
    let (target_rev, _) = ctx.target_for(mem);
    if mem.revision != target_rev {
        return Some(Trigger {
            reason: CoRestartReason::RevisionChanged,
            detail: format!("revision {} → {}", mem.revision, target_rev),
        });
    }
    None
}

/// Advance one desired group: fire its trigger (or hold it back), remove old members,
/// build new ones, set the readiness gates. Returns the group's new memory.
pub(super) fn step_group(
    ctx: &mut Ctx<'_>,
    mut mem: GroupStatus,
    pods: &[&ObservedPod],
    fire: Option<Trigger>,
    prev_phase: Option<GroupPhase>,
) -> GroupStatus {
    let g = mem.index;
    mem.message = None;
    let prev_detail = mem.decode_not_ready.take();
    mem.decode_not_ready = decode_not_ready(pods, mem.incarnation, prev_detail);
    if mem.decode_not_ready.is_some() {
        ctx.requeue_in(READY_DETAIL_REFRESH);
    }

    if let Some(t) = fire
        && !co_restart(ctx, &mut mem, pods, &t)
        && is_failure(t.reason)
    {
        // A broken group held back (backoff or policy None): stop its traffic, report,
        // and keep its pods for inspection. A held-back planned restart (policy None)
        // leaves a healthy group serving; its message says what was not done.
        close_gates(ctx, pods);
        mem.phase = GroupPhase::Broken;
        mem.bootstrap_healthy = false;
        note_phase(ctx, &mem, prev_phase);
        return mem;
    }

    // An in-place reset in progress (or begun just now).
    if mem.reset.is_some() {
        match super::reset::step(ctx, &mut mem, pods, prev_phase) {
            super::reset::Step::Waiting => return mem,
            // Done: every pod serves the new incarnation, build as usual. Fell back: every
            // pod is stale, removed below.
            super::reset::Step::Done | super::reset::Step::FellBack => {}
        }
    }

    if mem.incarnation == 0 {
        let (rev, _) = ctx.target(g);
        mem.incarnation = 1;
        mem.revision = rev.to_string();
        mem.since = Some(Time(ctx.input.now));
    }

    // Phase 1: remove pods of older incarnations, decode first.
    let stale: Vec<&ObservedPod> = pods
        .iter()
        .filter(|p| p.incarnation != mem.incarnation)
        .copied()
        .collect();
    if !stale.is_empty() {
        if mem.phase != GroupPhase::Restarting {
            // Stale pods without a co-restart in progress: a mismatch the trigger pass
            // found but the policy keeps us from acting on.
            mem.phase = GroupPhase::Broken;
            mem.message = Some("pods of another incarnation exist".into());
            close_gates(ctx, pods);
            note_phase(ctx, &mem, prev_phase);
            return mem;
        }
        close_gates(ctx, &stale);
        let reason = mem
            .last_co_restart
            .as_ref()
            .map_or(CoRestartReason::IncarnationMismatch, |r| r.reason);
        mem.bootstrap_healthy = false;
        if !is_failure(reason) && !endpoints_settled(ctx, &stale) {
            mem.message = Some(format!(
                "taking {} pod(s) of the previous incarnation out of the Services before removing them",
                stale.len()
            ));
            note_phase(ctx, &mem, prev_phase);
            return mem;
        }
        remove_in_order(ctx, &stale, DeleteReason::CoRestart(reason));
        mem.message = Some(format!(
            "removing {} pod(s) of the previous incarnation, decode first",
            stale.len()
        ));
        note_phase(ctx, &mem, prev_phase);
        return mem;
    }

    // Phase 2: build at the current incarnation.
    build_group(ctx, &mut mem, pods, prev_phase);
    mem
}

/// Failures in a row after which a group that serves between them is held by the backoff
/// too (see [`repaired_at_once`]).
pub const FLAPPING_STREAK: i32 = 2;

/// Whether a failure co-restart goes ahead inside the backoff. The backoff is for a group
/// that cannot stay up: one that fails again before it is Ready at its new incarnation (a
/// crash loop: a bad model path, an OOM at load), or one that keeps failing after serving
/// ([`FLAPPING_STREAK`] failure co-restarts in a row without staying Ready for
/// `backoff.maxSeconds`). A group that came back Ready and then fails, once, is repaired at
/// once: two unrelated crashes a few seconds apart (a prefill OOM-killed, then the decode
/// on a node under pressure) are two short outages, not one held for `baseSeconds`.
fn repaired_at_once(mem: &GroupStatus) -> bool {
    mem.ready_since.is_some() && mem.backoff_streak < FLAPPING_STREAK
}

/// Start a co-restart unless policy or backoff hold it back. Returns true when started.
fn co_restart(
    ctx: &mut Ctx<'_>,
    mem: &mut GroupStatus,
    pods: &[&ObservedPod],
    t: &Trigger,
) -> bool {
    let g = mem.index;
    let now = ctx.input.now;
    if ctx.policy() == RestartPolicy::None {
        mem.message = Some(format!(
            "would co-restart ({}): {}; restart.policy is None",
            t.reason, t.detail
        ));
        return false;
    }
    if is_failure(t.reason)
        && let Some(after) = &mem.next_restart_after
        && after.0 > now
        && !repaired_at_once(mem)
    {
        // No countdown in the message: it would change the status on every reconcile.
        // `nextRestartAfter` says when.
        mem.message = Some(format!(
            "co-restart ({}) held back by backoff until {}: {}",
            t.reason, after.0, t.detail
        ));
        ctx.requeue_in(until(now, after.0));
        return false;
    }

    let old = mem.incarnation;
    let new = old + 1;
    let (rev, _) = ctx.target_for(mem);
    let rev = rev.to_string();
    let type_ = if is_failure(t.reason) {
        EventKind::Warning
    } else {
        EventKind::Normal
    };
    let not_in_place = super::reset::refusal(ctx, mem, pods, t);
    let how = match &not_in_place {
        None => "in place (the members reset without exiting, prefill first)".to_string(),
        Some(why) => format!("by recreating the pods ({why})"),
    };
    ctx.event(
        type_,
        EventReason::CoRestart(t.reason),
        g,
        format!(
            "group {g} co-restart {how}: incarnation {old} → {new}, revision {rev}: {}",
            t.detail
        ),
    );
    ctx.co_restarts.push(CoRestart {
        group: g,
        reason: t.reason,
        old_incarnation: old,
        new_incarnation: new,
        in_place: not_in_place.is_none(),
    });
    if is_failure(t.reason) {
        mem.backoff_streak += 1;
        let delay = backoff_delay(
            ctx.input.spec.restart.backoff.base_seconds,
            ctx.input.spec.restart.backoff.max_seconds,
            mem.backoff_streak,
        );
        mem.next_restart_after = Some(Time(add(now, delay)));
    }
    mem.co_restarts += 1;
    if not_in_place.is_none() {
        ctx.resets.push((g, super::reset::ResetOutcome::Started));
        super::reset::begin(ctx, mem, t, new);
        return true;
    }
    mem.incarnation = new;
    mem.revision = rev;
    mem.last_co_restart = Some(CoRestartRecord {
        time: Time(now),
        reason: t.reason,
        in_place: false,
    });
    mem.phase = GroupPhase::Restarting;
    mem.since = Some(Time(now));
    mem.pods.clear();
    mem.ready_since = None;
    mem.bootstrap_healthy = false;
    // The pod it was about belongs to the incarnation that is being removed.
    mem.decode_not_ready = None;
    true
}
