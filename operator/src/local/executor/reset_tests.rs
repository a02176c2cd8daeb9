//! In-place resets through the local executor: one call per member and incarnation, the
//! member's incarnation moved on only by a "ready" answer, and the planner's whole reset
//! carried out without a process started or signalled.

use super::tests::{Fake, executor, t};
use super::*;
use crate::crd::{GroupPhase, PDDeploymentStatus};
use crate::local::member::ProbeOutcome;
use crate::planner::{self, PlanInput, ReadyDetail};
use crate::reasons::EventReason;
use crate::reset_call::ResetReply;
use crate::testutil::spec;

fn reset(pod: &str, role: Role, to: i64) -> PlannedAction {
    PlannedAction::ResetMember {
        name: pod.into(),
        group: 0,
        role,
        from_incarnation: to - 1,
        to_incarnation: to,
        timeout: Duration::from_secs(3),
    }
}

fn ready(reset: bool) -> ResetReply {
    ResetReply::Ready {
        reset,
        incarnation: "00000000000000aa".into(),
        took_ms: 40,
    }
}

/// Run the planner against the executor until it has nothing more to do this instant.
fn reconcile(x: &mut LocalExecutor<Fake>, status: &mut Option<PDDeploymentStatus>, clock: i64) {
    let s = spec(1);
    for _ in 0..5 {
        let observed = x.observed();
        let plan = planner::plan(&PlanInput {
            name: "demo",
            generation: Some(1),
            spec: &s,
            status: status.as_ref(),
            restart_requested_at: None,
            observed: &observed,
            now: t(clock),
        });
        for a in &plan.actions {
            x.execute(a, t(clock)).unwrap();
        }
        *status = Some(plan.status.clone());
        if plan.actions.iter().all(|a| {
            matches!(
                a,
                PlannedAction::Event(_) | PlannedAction::ResetMember { .. }
            )
        }) {
            break;
        }
    }
}

fn ready_group(x: &mut LocalExecutor<Fake>, status: &mut Option<PDDeploymentStatus>) {
    reconcile(x, status, 0);
    x.on_probe("demo-g0-i1-p0", ProbeOutcome::Ready, t(1));
    reconcile(x, status, 1);
    x.on_probe("demo-g0-i1-d0", ProbeOutcome::Ready, t(2));
    reconcile(x, status, 2);
    assert_eq!(
        status.as_ref().unwrap().group_statuses[0].phase,
        GroupPhase::Ready
    );
}

#[test]
fn one_call_per_member_and_incarnation_and_only_ready_moves_it_on() {
    let mut x = executor();
    let mut status = None;
    ready_group(&mut x, &mut status);
    let p = "demo-g0-i1-p0";
    x.execute(&reset(p, Role::Prefill, 2), t(3)).unwrap();
    x.execute(&reset(p, Role::Prefill, 2), t(3)).unwrap();
    assert_eq!(
        x.processes.resets.len(),
        1,
        "a repeat while in flight makes no call"
    );
    let call = &x.processes.resets[0];
    assert_eq!(
        (call.pod.as_str(), call.role, call.to_incarnation),
        (p, Role::Prefill, 2)
    );
    assert_eq!(call.http, x.members[p].http);
    assert_eq!(&call.key, x.objects.keys.get(&0).unwrap());
    assert_eq!(call.timeout, Duration::from_secs(3));

    // Refused: the member stays where it is, and the next ask makes a new call.
    let refused = ResetReply::Refused {
        status: 504,
        reason: "reset_incomplete".into(),
        message: "no handshake yet".into(),
    };
    assert!(x.on_reset(p, 2, refused, t(4)));
    assert_eq!(x.members[p].incarnation, 1);
    let last = x.record.entries().last().unwrap();
    assert!(
        last.warning && last.message.contains("reset_incomplete"),
        "{last:?}"
    );
    x.execute(&reset(p, Role::Prefill, 2), t(5)).unwrap();
    assert_eq!(x.processes.resets.len(), 2);

    // Ready: the incarnation moves on, the process and its pid stay.
    let pid = x.members[p].pid;
    assert!(x.on_reset(p, 2, ready(true), t(6)));
    let m = &x.members[p];
    assert_eq!((m.incarnation, m.resets, m.pid), (2, 1, pid));
    assert!(m.readiness.ready);
    assert_eq!(
        x.observed()
            .pods
            .iter()
            .find(|o| o.name == p)
            .unwrap()
            .incarnation,
        2
    );
    // Already there: no call.
    x.execute(&reset(p, Role::Prefill, 2), t(7)).unwrap();
    assert_eq!(x.processes.resets.len(), 2);
    assert_eq!(x.processes.spawned.len(), 2, "no process started");
    assert!(x.processes.signals.is_empty(), "no process signalled");
}

#[test]
fn a_member_that_is_leaving_is_not_asked() {
    let mut x = executor();
    let mut status = None;
    ready_group(&mut x, &mut status);
    x.terminate_role(Role::Decode, "test", t(3));
    x.execute(&reset("demo-g0-i1-d0", Role::Decode, 2), t(3))
        .unwrap();
    x.on_exit(
        "demo-g0-i1-p0",
        "killed by signal 9".into(),
        false,
        None,
        t(3),
    );
    x.execute(&reset("demo-g0-i1-p0", Role::Prefill, 2), t(3))
        .unwrap();
    assert!(x.processes.resets.is_empty());
}

/// The whole in-place co-restart as the runtime carries it out: a decode whose channel
/// fails; the prefill then the decode asked; the group Ready again with the same
/// processes, and the router's endpoint at the new incarnation.
#[test]
fn the_planner_through_this_executor_resets_in_place_prefill_first() {
    let mut x = executor();
    let mut status = None;
    ready_group(&mut x, &mut status);
    let (p, d) = ("demo-g0-i1-p0", "demo-g0-i1-d0");
    let fault = ProbeOutcome::NotReady(ReadyDetail::new(
        "peer_restarted",
        "the prefill came back with a new incarnation",
    ));
    for s in 3..6 {
        x.on_probe(d, fault.clone(), t(s));
    }
    reconcile(&mut x, &mut status, 6);
    let window = spec(1).health.co_restart_after_seconds as i64;
    reconcile(&mut x, &mut status, 6 + window + 1);
    let now = 6 + window + 1;
    let g = &status.as_ref().unwrap().group_statuses[0];
    assert_eq!((g.phase, g.incarnation), (GroupPhase::Resetting, 2));
    assert_eq!(x.processes.resets.len(), 1);
    assert_eq!(x.processes.resets[0].pod, p, "prefill first");
    assert!(
        x.endpoints().is_empty(),
        "out of the router while resetting"
    );

    x.on_reset(p, 2, ready(true), t(now + 1));
    reconcile(&mut x, &mut status, now + 1);
    assert_eq!(x.processes.resets.len(), 2);
    assert_eq!(x.processes.resets[1].pod, d);
    x.on_reset(d, 2, ready(true), t(now + 2));
    reconcile(&mut x, &mut status, now + 2);
    let g = &status.as_ref().unwrap().group_statuses[0];
    assert_eq!((g.phase, g.incarnation), (GroupPhase::Ready, 2));
    assert_eq!(x.endpoints().len(), 1);
    assert_eq!(x.endpoints()[0].incarnation, 2);
    assert_eq!(x.processes.spawned.len(), 2, "no process started");
    assert!(x.processes.signals.is_empty(), "no process signalled");
    assert!(x.record.entries().any(|e| e.kind == EntryKind::Event
        && e.reason.map(EventReason::as_str) == Some("InPlaceResetCompleted")));
}
