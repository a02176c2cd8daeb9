//! The in-place co-restart (docs/in-place-reset.md): when both members of a group are
//! alive and the fault is the channel or the session, the members reset to the next
//! incarnation without exiting — prefill first, then decode — and keep their weights. A
//! co-restart that deletes the pods reloads the model (seconds for SmolLM2, minutes for the
//! models served on GPUs); a reset takes about a second.
//!
//! The decision and every step of it are here, pure: whether a co-restart may go in place
//! ([`refusal`]), the members to ask on each plan (`ResetMember`, prefill first), when the
//! reset is done (every member serves the new incarnation), and the fall back to deleting
//! the pods when it does not complete within `restart.inPlaceResetSeconds` or a member
//! crashes, hangs or goes away meanwhile. The executors only make the calls and move a
//! member's observed incarnation on once the member says it is ready at the new one.
//!
//! The ordering invariant holds throughout: the decode's readiness gate is closed from the
//! start of the reset until every member serves the new incarnation, so no request is sent
//! to a decode whose prefill is of another incarnation; and a prefill at the new incarnation
//! refuses a decode of the old one at the handshake (`incarnation_mismatch`).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{
    Ctx, EventKind, ObservedPod, PlannedAction, PodPhase, Role, Trigger, add, close_gates,
    note_phase, until,
};
use crate::crd::{CoRestartReason, CoRestartRecord, GroupPhase, GroupStatus, InPlaceReset};
use crate::reasons::EventReason;

/// The `/ready` reasons of a decode (docs/readiness.md) that say its channel or session is
/// at fault while its process answers: a reset, which ends every room, forgets the session
/// and handshakes afresh at a new incarnation, heals them. Not here: the engine's own faults
/// (`engine_stalled`, `engine_stopped`: the engine thread is wedged or gone, a reset keeps
/// it), a drain (`draining`, `peer_shutdown`, `shutting_down`: the process is leaving),
/// mismatches that only new pods fix (`auth_failed`, `model_mismatch`, `layout_mismatch`,
/// `version_mismatch`, `malformed`), and the executor's own reasons for a body it could not
/// read (a decode that does not answer is taken for hung).
pub const IN_PLACE_REASONS: &[&str] = &[
    "incarnation_mismatch",
    "peer_restarted",
    "not_authenticated",
    "peer_expired",
    "handshaking",
    "handshake_timeout",
    "probe_timeout",
    "no_session",
    "peer_unresponsive",
    "peer_lost",
    "peer_unreachable",
    "loop_stalled",
    // Only a stalled KV transfer (`stalled: kv_transfer`): an engine that makes no
    // progress (`stalled: engine`) needs new pods (see `refusal`).
    "no_progress",
];

/// Longest single reset call: the member answers as soon as it is ready at the new
/// incarnation; a call that has not by then is asked again on a later plan.
pub const MAX_RESET_CALL: Duration = Duration::from_secs(5);

/// How a [`step`] left the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Still resetting: the group's memory is final for this plan.
    Waiting,
    /// Every member serves the new incarnation: build (and open the gates) as usual.
    Done,
    /// Given up: the group is `Restarting` at a newer incarnation, every pod stale.
    FellBack,
}

/// Why the co-restart `t` of a group may not go in place (`None`: it may).
pub(super) fn refusal(
    ctx: &Ctx<'_>,
    mem: &GroupStatus,
    pods: &[&ObservedPod],
    t: &Trigger,
) -> Option<String> {
    if ctx.input.spec.restart.in_place_reset_seconds <= 0 {
        return Some("restart.inPlaceResetSeconds is 0".into());
    }
    if t.reason != CoRestartReason::MemberNotReady {
        return Some(format!("{} needs new pods", t.reason));
    }
    if mem.last_co_restart.as_ref().is_some_and(|r| r.in_place) && mem.ready_since.is_none() {
        return Some("the previous in-place reset did not bring the group back to Ready".into());
    }
    let current: Vec<&ObservedPod> = pods
        .iter()
        .filter(|p| p.incarnation == mem.incarnation)
        .copied()
        .collect();
    if current.len() != pods.len() {
        return Some("pods of another incarnation exist".into());
    }
    let (rev, spec) = ctx.target_for(mem);
    if mem.revision != rev {
        return Some(format!("the group moves to revision {rev}"));
    }
    for (role, want) in [
        (Role::Prefill, spec.prefill.replicas.max(1)),
        (Role::Decode, spec.decode.replicas.max(1)),
    ] {
        let have = current.iter().filter(|p| p.role == role).count() as i32;
        if have != want {
            return Some(format!("{have} of {want} {} pods exist", role.as_str()));
        }
    }
    for p in &current {
        if p.phase != PodPhase::Running || p.terminating || p.node_lost {
            return Some(format!("{} pod {} is not running", p.role.as_str(), p.name));
        }
        match p.role {
            Role::Prefill if !p.ready => {
                return Some(format!("prefill pod {} is not ready (it may hang)", p.name));
            }
            Role::Decode if !p.ready => match &p.ready_detail {
                // `no_progress` says what stalled: the KV transfer (the channel, which a
                // reset renews) or the engine (a reset keeps the engine thread, so the
                // stall outlives it). A body that does not say (an older dataplane) gets
                // new pods, which heal either.
                Some(d)
                    if d.reason == "no_progress" && d.stalled.as_deref() != Some("kv_transfer") =>
                {
                    return Some(match d.stalled.as_deref() {
                        Some("engine") => format!(
                            "decode pod {} makes no progress in its engine, which a reset keeps",
                            p.name
                        ),
                        other => format!(
                            "decode pod {} makes no progress and says {} stalled, not its KV transfer",
                            p.name,
                            other.unwrap_or("nothing of what")
                        ),
                    });
                }
                Some(d) if IN_PLACE_REASONS.contains(&d.reason.as_str()) => {}
                Some(d) => {
                    return Some(format!(
                        "decode pod {} is not ready for {}, which a reset does not heal",
                        p.name, d.reason
                    ));
                }
                None => {
                    return Some(format!(
                        "decode pod {} does not say why it is not ready",
                        p.name
                    ));
                }
            },
            _ => {}
        }
    }
    None
}

/// Begin the in-place co-restart of `mem` to `new` (the caller has counted it and set the
/// backoff): the pods stay, the group enters `Resetting`.
pub(super) fn begin(ctx: &mut Ctx<'_>, mem: &mut GroupStatus, t: &Trigger, new: i64) {
    let now = ctx.input.now;
    mem.reset = Some(InPlaceReset {
        from_incarnation: mem.incarnation,
        started: Time(now),
    });
    mem.incarnation = new;
    mem.last_co_restart = Some(CoRestartRecord {
        time: Time(now),
        reason: t.reason,
        in_place: true,
    });
    mem.phase = GroupPhase::Resetting;
    mem.since = Some(Time(now));
    mem.ready_since = None;
    mem.bootstrap_healthy = false;
    mem.decode_not_ready = None;
}

/// What keeps `p` from completing a reset, if anything: it has exited, is being deleted or
/// its node stopped reporting.
fn member_problem(p: &ObservedPod) -> Option<String> {
    let what = if matches!(p.phase, PodPhase::Failed | PodPhase::Succeeded) {
        format!(
            "exited{}",
            p.exit
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        )
    } else if p.terminating {
        "is being deleted".into()
    } else if p.node_lost {
        "is on a node that stopped reporting".into()
    } else {
        return None;
    };
    Some(format!("{} pod {} {what}", p.role.as_str(), p.name))
}

/// Advance a group in `Resetting`.
pub(super) fn step(
    ctx: &mut Ctx<'_>,
    mem: &mut GroupStatus,
    pods: &[&ObservedPod],
    prev_phase: Option<GroupPhase>,
) -> Step {
    let Some(reset) = mem.reset.clone() else {
        return Step::Done;
    };
    let now = ctx.input.now;
    let to = mem.incarnation;
    let limit = Duration::from_secs(ctx.input.spec.restart.in_place_reset_seconds.max(1) as u64);
    let deadline = add(reset.started.0, limit);
    let stale: Vec<&ObservedPod> = pods
        .iter()
        .filter(|p| p.incarnation != to)
        .copied()
        .collect();
    let broken = pods
        .iter()
        .find_map(|p| member_problem(p))
        .or_else(|| {
            mem.pods
                .iter()
                .find(|n| !pods.iter().any(|p| &p.name == *n))
                .map(|n| format!("pod {n} vanished"))
        })
        .or_else(|| {
            pods.iter()
                .find(|p| p.incarnation != to && p.incarnation != reset.from_incarnation)
                .map(|p| {
                    format!(
                        "pod {} has incarnation {}, neither {} nor {to}",
                        p.name, p.incarnation, reset.from_incarnation
                    )
                })
        });
    if broken.is_none() && stale.is_empty() && !pods.is_empty() {
        mem.reset = None;
        let took = until(reset.started.0, now);
        ctx.event(
            EventKind::Normal,
            EventReason::InPlaceResetCompleted,
            mem.index,
            format!(
                "group {}: every member reset in place to incarnation {to} in {:.1}s, keeping its process and weights",
                mem.index,
                took.as_secs_f64()
            ),
        );
        ctx.resets.push((mem.index, ResetOutcome::Completed));
        return Step::Done;
    }
    let why = broken.or_else(|| {
        (now >= deadline).then(|| {
            format!(
                "not complete after restart.inPlaceResetSeconds ({}s): {} of {} members reset",
                limit.as_secs(),
                pods.len() - stale.len(),
                pods.len()
            )
        })
    });
    if let Some(why) = why {
        fall_back(ctx, mem, pods, &why);
        return Step::FellBack;
    }

    close_gates(ctx, pods);
    mem.bootstrap_healthy = false;
    let prefills: Vec<&ObservedPod> = pods
        .iter()
        .filter(|p| p.role == Role::Prefill)
        .copied()
        .collect();
    let stale_prefills: Vec<&ObservedPod> = stale
        .iter()
        .filter(|p| p.role == Role::Prefill)
        .copied()
        .collect();
    // Prefill first: a decode is reset only once every prefill serves the new incarnation
    // and is ready, so its fresh handshake finds them there.
    let ask: Vec<&ObservedPod> = if !stale_prefills.is_empty() {
        stale_prefills
    } else if prefills.iter().all(|p| p.ready) {
        stale.clone()
    } else {
        Vec::new()
    };
    let timeout = until(now, deadline).min(MAX_RESET_CALL);
    for p in ask {
        ctx.actions.push(PlannedAction::ResetMember {
            name: p.name.clone(),
            group: p.group,
            role: p.role,
            from_incarnation: p.incarnation,
            to_incarnation: to,
            timeout,
        });
    }
    mem.phase = GroupPhase::Resetting;
    mem.message = Some(format!(
        "resetting in place to incarnation {to}, prefill first: {} of {} members reset",
        pods.len() - stale.len(),
        pods.len()
    ));
    // Look again soon (a member's answer moves its incarnation on), and at the deadline.
    ctx.requeue_in(Duration::from_secs(1).min(until(now, deadline)));
    note_phase(ctx, mem, prev_phase);
    Step::Waiting
}

/// Give up an in-place reset: the group co-restarts as if it had never been tried, at a
/// newer incarnation (so every pod, reset or not, is replaced, decode first).
fn fall_back(ctx: &mut Ctx<'_>, mem: &mut GroupStatus, pods: &[&ObservedPod], why: &str) {
    let now = ctx.input.now;
    let old = mem.incarnation;
    let new = old + 1;
    let reason = mem
        .last_co_restart
        .as_ref()
        .map_or(CoRestartReason::MemberNotReady, |r| r.reason);
    ctx.event(
        EventKind::Warning,
        EventReason::InPlaceResetFailed,
        mem.index,
        format!(
            "group {}: in-place reset to incarnation {old} given up: {why}; deleting the pods instead (incarnation {new})",
            mem.index
        ),
    );
    // The same co-restart goes on (it is not counted again); only its way changes.
    ctx.resets.push((mem.index, ResetOutcome::FellBack));
    close_gates(ctx, pods);
    mem.reset = None;
    mem.incarnation = new;
    mem.last_co_restart = Some(CoRestartRecord {
        time: Time(now),
        reason,
        in_place: false,
    });
    mem.phase = GroupPhase::Restarting;
    mem.since = Some(Time(now));
    mem.pods.clear();
    mem.ready_since = None;
    mem.bootstrap_healthy = false;
    mem.decode_not_ready = None;
}

/// What became of an in-place reset in a plan (for the metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetOutcome {
    Started,
    Completed,
    FellBack,
}

impl ResetOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Completed => "completed",
            Self::FellBack => "fell_back",
        }
    }
}
