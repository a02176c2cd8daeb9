//! Building a group at its current incarnation: create the missing members in order
//! (prefill, then decode once every prefill is Ready), derive the phase, open or close the
//! decode pods' readiness gates, and carry what a not-ready decode says into the status.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{
    Ctx, MAX_DETAIL_MESSAGE, ObservedPod, PlannedAction, PodIntent, PodPhase, Role, add,
    close_gates, not_ready_deadline, note_phase, until,
};
use crate::crd::{DecodeNotReady, GroupPhase, GroupStatus};
use crate::names::pod_name;

/// The first (by name) running decode pod of `incarnation` that reports why it is not
/// ready. While the same pod keeps the same reason, the message remembered in `prev` is
/// kept: a message may carry counters ("last PONG 8123 ms ago"), and a status that
/// changed on every reconcile would trigger the next one.
pub(super) fn decode_not_ready(
    pods: &[&ObservedPod],
    incarnation: i64,
    prev: Option<DecodeNotReady>,
) -> Option<DecodeNotReady> {
    let (pod, detail) = pods
        .iter()
        .filter(|p| {
            p.role == Role::Decode
                && p.incarnation == incarnation
                && p.phase == PodPhase::Running
                && !p.ready
                && !p.terminating
        })
        .filter_map(|p| p.ready_detail.as_ref().map(|d| (p, d)))
        .min_by(|a, b| a.0.name.cmp(&b.0.name))?;
    if let Some(prev) = prev
        && prev.pod == pod.name
        && prev.reason == detail.reason
    {
        return Some(prev);
    }
    Some(DecodeNotReady {
        pod: pod.name.clone(),
        reason: detail.reason.clone(),
        message: truncate(&detail.message, MAX_DETAIL_MESSAGE),
    })
}

/// `s` cut to at most `max` bytes on a character boundary, marked with `…` when cut.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &s[..cut])
}

/// Create missing members in order (prefill, then decode once every prefill is Ready),
/// derive the phase and open or close the decode pods' readiness gates.
pub(super) fn build_group(
    ctx: &mut Ctx<'_>,
    mem: &mut GroupStatus,
    pods: &[&ObservedPod],
    prev_phase: Option<GroupPhase>,
) {
    let g = mem.index;
    let now = ctx.input.now;
    let name = ctx.input.name;
    let template = if mem.revision == ctx.update_revision {
        ctx.update.clone()
    } else if mem.revision == ctx.current_revision {
        ctx.current.clone()
    } else if pods.is_empty() {
        // Nothing built yet at a revision we no longer know: build at the target.
        let (rev, t) = ctx.target(g);
        mem.revision = rev.to_string();
        t.clone()
    } else {
        // Pods of a revision whose spec we no longer keep (the status was lost during a
        // rollout): adding members would mix revisions in one incarnation. Wait for the
        // RevisionChanged co-restart the trigger pass schedules.
        mem.message = Some(format!(
            "revision {} is no longer known; waiting for a co-restart",
            mem.revision
        ));
        mem.pods = pods.iter().map(|p| p.name.clone()).collect();
        mem.pods.sort();
        mem.phase = GroupPhase::Broken;
        mem.bootstrap_healthy = false;
        close_gates(ctx, pods);
        note_phase(ctx, mem, prev_phase);
        return;
    };
    let seen: BTreeSet<&str> = mem.pods.iter().map(String::as_str).collect();
    let (mut created_prefill, mut created_decode) = (false, false);
    let create = |ctx: &mut Ctx<'_>, role: Role, index: i32| -> bool {
        let pod = pod_name(name, g, mem.incarnation, role, index);
        // A pod seen before and now missing is a deletion the trigger pass handles
        // (or policy None reports); never recreate a single member silently.
        if seen.contains(pod.as_str()) {
            return false;
        }
        ctx.actions
            .push(PlannedAction::CreatePod(Box::new(PodIntent {
                name: pod,
                group: g,
                role,
                index,
                incarnation: mem.incarnation,
                revision: mem.revision.clone(),
                template: template.clone(),
            })));
        true
    };

    let members = |role: Role| -> Vec<&ObservedPod> {
        pods.iter().filter(|p| p.role == role).copied().collect()
    };
    let prefill = members(Role::Prefill);
    let decode = members(Role::Decode);
    let want_prefill = template.prefill.replicas.max(1);
    let want_decode = template.decode.replicas.max(1);

    // Members are matched by role and index, not by name: one that reset in place keeps
    // the name of the incarnation it was created at.
    for i in 0..want_prefill {
        if !prefill.iter().any(|p| p.index == i) {
            created_prefill |= create(ctx, Role::Prefill, i);
        }
    }
    let healthy = |p: &&ObservedPod| p.ready && p.phase == PodPhase::Running && !p.terminating;
    let prefill_ready = prefill.len() as i32 == want_prefill && prefill.iter().all(healthy);
    if prefill_ready {
        for i in 0..want_decode {
            if !decode.iter().any(|p| p.index == i) {
                created_decode |= create(ctx, Role::Decode, i);
            }
        }
    }
    let decode_ready = decode.len() as i32 == want_decode && decode.iter().all(healthy);

    mem.pods = pods.iter().map(|p| p.name.clone()).collect();
    mem.pods.sort();
    let all_ready = prefill_ready && decode_ready;
    mem.bootstrap_healthy = decode_ready && !decode.is_empty();
    mem.phase = if all_ready {
        GroupPhase::Ready
    } else if mem.ready_since.is_some() || (!decode.is_empty() && !prefill_ready) {
        GroupPhase::Broken
    } else if decode.is_empty() && !created_decode {
        if prefill.is_empty() && !created_prefill {
            GroupPhase::Pending
        } else {
            GroupPhase::StartingPrefill
        }
    } else {
        GroupPhase::StartingDecode
    };
    if !all_ready
        && mem.message.is_none()
        && let Some(p) = pods.iter().find(|p| p.waiting.is_some())
    {
        // What the scheduler or the kubelet said about a member that does not run.
        mem.message = Some(format!(
            "{} pod {}: {}",
            p.role.as_str(),
            p.name,
            p.waiting.as_deref().unwrap_or_default()
        ));
    }
    if !all_ready
        && mem.message.is_none()
        && let Some(d) = &mem.decode_not_ready
    {
        // What a running decode says about itself.
        mem.message = Some(format!("decode pod {}: {}: {}", d.pod, d.reason, d.message));
    }
    if all_ready {
        if mem.ready_since.is_none() {
            mem.ready_since = Some(Time(now));
            if let Some(s) = &mem.since {
                ctx.became_ready.push((g, until(s.0, now)));
            }
        }
        // Stable for longer than the longest backoff: forget earlier failures.
        let max = Duration::from_secs(ctx.input.spec.restart.backoff.max_seconds.max(1) as u64);
        if let Some(rs) = &mem.ready_since
            && add(rs.0, max) <= now
        {
            mem.backoff_streak = 0;
            mem.next_restart_after = None;
        }
    }
    if mem.phase == GroupPhase::Broken {
        schedule_not_ready_check(ctx, pods);
    }
    for p in &decode {
        if p.group_ready_gate != all_ready {
            ctx.actions.push(PlannedAction::SetGroupReadyGate {
                pod: p.name.clone(),
                ready: all_ready,
            });
        }
    }
    note_phase(ctx, mem, prev_phase);
}

/// Ask to be called again when a not-ready member of a started group reaches the window.
pub(super) fn schedule_not_ready_check(ctx: &mut Ctx<'_>, pods: &[&ObservedPod]) {
    let health = &ctx.input.spec.health;
    let now = ctx.input.now;
    let next = pods
        .iter()
        .filter(|p| !p.ready)
        .filter_map(|p| p.not_ready_since)
        .map(|s| until(now, not_ready_deadline(health, s)))
        .min();
    if let Some(d) = next {
        ctx.requeue_in(d);
    }
}
