//! The in-place co-restart (`planner::reset`): when it is chosen, its order (prefill
//! first, gates closed throughout), its completion without a pod created or deleted, and
//! its fall back to deleting the pods.

use std::time::Duration;

use super::sim::Sim;
use super::tests::{only_pod, ready_sim};
use super::*;
use crate::crd::{CoRestartReason as R, GroupPhase};

/// The members a plan asks to reset, with the incarnation asked for.
fn resets(plan: &Plan) -> Vec<(String, Role, i64)> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            PlannedAction::ResetMember {
                name,
                role,
                to_incarnation,
                ..
            } => Some((name.clone(), *role, *to_incarnation)),
            _ => None,
        })
        .collect()
}

fn has_event(sim: &Sim, plan: &Plan, reason: EventReason) -> Option<PlannedEvent> {
    sim.events(plan).into_iter().find(|e| e.reason == reason)
}

/// Make the decode of group 0 report `reason` and let the co-restart window pass; returns
/// the plan that decided.
fn decode_fault(sim: &mut Sim, reason: &str) -> Plan {
    decode_fault_saying(sim, reason, "the channel says so")
}

fn decode_fault_saying(sim: &mut Sim, reason: &str, message: &str) -> Plan {
    let d = only_pod(sim, 0, Role::Decode);
    sim.report(&d, reason, message);
    stalled_plan(sim)
}

/// The plan once a reported fault has lasted past the co-restart window.
fn stalled_plan(sim: &mut Sim) -> Plan {
    sim.reconcile();
    let window = sim.spec.health.co_restart_after_seconds as u64;
    sim.advance(window + 1);
    sim.reconcile()
}

#[test]
fn a_channel_fault_resets_the_group_in_place_prefill_first_and_keeps_every_pod() {
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    let d = only_pod(&sim, 0, Role::Decode);
    let before: Vec<String> = sim.pods.keys().cloned().collect();
    let start = sim.history.len();

    let plan = decode_fault(&mut sim, "peer_restarted");
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberNotReady)]);
    assert!(plan.co_restarts[0].in_place);
    let ev = has_event(&sim, &plan, EventReason::CoRestart(R::MemberNotReady)).unwrap();
    assert!(ev.message.contains("in place"), "{}", ev.message);
    // Prefill first; the decode's gate closes; nothing is deleted or created.
    assert_eq!(resets(&plan), vec![(p.clone(), Role::Prefill, 2)]);
    assert!(Sim::deleted(&plan).is_empty() && Sim::created(&plan).is_empty());
    assert!(!sim.pods[&d].group_ready_gate);
    let g = sim.group(0);
    assert_eq!((g.phase, g.incarnation), (GroupPhase::Resetting, 2));
    assert_eq!(g.reset.as_ref().unwrap().from_incarnation, 1);
    assert_eq!(plan.resets, vec![(0, ResetOutcome::Started)]);

    // The prefill answered (the simulator moves it on): the decode is next.
    let plan = sim.reconcile();
    assert_eq!(resets(&plan), vec![(d.clone(), Role::Decode, 2)]);
    assert_eq!(sim.group(0).phase, GroupPhase::Resetting);

    // Both serve incarnation 2: Ready again, the gate open, the same pods.
    let plan = sim.reconcile();
    assert!(resets(&plan).is_empty());
    let g = sim.group(0);
    assert_eq!((g.phase, g.incarnation), (GroupPhase::Ready, 2));
    assert!(g.reset.is_none());
    assert!(g.last_co_restart.as_ref().unwrap().in_place);
    assert_eq!(g.co_restarts, 1);
    assert!(sim.pods[&d].group_ready_gate);
    assert_eq!(sim.pods.keys().cloned().collect::<Vec<_>>(), before);
    let done = has_event(&sim, &plan, EventReason::InPlaceResetCompleted).unwrap();
    assert!(done.message.contains("incarnation 2"), "{}", done.message);
    assert_eq!(plan.resets, vec![(0, ResetOutcome::Completed)]);
    assert!(
        sim.history[start..].iter().all(|a| !matches!(
            a,
            PlannedAction::DeletePod { .. } | PlannedAction::CreatePod(_)
        )),
        "no pod deleted or created"
    );
}

#[test]
fn every_prefill_resets_before_any_decode() {
    let mut s = crate::testutil::spec(1);
    s.prefill.replicas = 2;
    s.decode.replicas = 2;
    let mut sim = Sim::new(s);
    sim.settle(50);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    let decodes: Vec<String> = sim
        .pods_of(0, Role::Decode)
        .iter()
        .map(|p| p.name.clone())
        .collect();
    sim.report(&decodes[1], "incarnation_mismatch", "refused");
    sim.reconcile();
    sim.advance(sim.spec.health.co_restart_after_seconds as u64 + 1);
    let plan = sim.reconcile();
    let first = resets(&plan);
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(first.iter().all(|(_, r, _)| *r == Role::Prefill));
    let plan = sim.reconcile();
    let second = resets(&plan);
    assert_eq!(second.len(), 2, "{second:?}");
    assert!(second.iter().all(|(_, r, _)| *r == Role::Decode));
    sim.reconcile();
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    assert!(sim.pods.values().all(|p| p.incarnation == 2));
}

/// A decode that keeps failing while one prefill has not answered its reset is not asked:
/// prefill first holds even when the prefills answer at different times.
#[test]
fn a_decode_waits_while_any_prefill_has_not_reset() {
    let mut s = crate::testutil::spec(1);
    s.prefill.replicas = 2;
    let mut sim = Sim::new(s);
    sim.settle(50);
    let prefills: Vec<String> = sim
        .pods_of(0, Role::Prefill)
        .iter()
        .map(|p| p.name.clone())
        .collect();
    sim.reset_refused.insert(prefills[1].clone());
    decode_fault(&mut sim, "peer_unresponsive");
    for _ in 0..3 {
        sim.advance(1);
        let plan = sim.reconcile();
        assert_eq!(resets(&plan), vec![(prefills[1].clone(), Role::Prefill, 2)]);
    }
}

#[test]
fn faults_a_reset_cannot_heal_recreate_the_pods() {
    // The decode's engine is wedged: a reset keeps the engine thread.
    let mut sim = ready_sim(1);
    let plan = decode_fault(&mut sim, "engine_stalled");
    assert!(!plan.co_restarts[0].in_place);
    assert!(resets(&plan).is_empty());
    assert_eq!(Sim::deleted(&plan).len(), 1);
    let ev = has_event(&sim, &plan, EventReason::CoRestart(R::MemberNotReady)).unwrap();
    assert!(ev.message.contains("engine_stalled"), "{}", ev.message);

    // The decode's engine makes no progress (held, or every step failing): the same; and
    // a `no_progress` that does not say what stalled (an older dataplane) too.
    for stalled in [Some("engine"), None] {
        let mut sim = ready_sim(1);
        let d = only_pod(&sim, 0, Role::Decode);
        sim.report_no_progress(&d, stalled);
        let plan = stalled_plan(&mut sim);
        assert!(!plan.co_restarts[0].in_place, "{stalled:?}");
        assert!(resets(&plan).is_empty());
        assert_eq!(Sim::deleted(&plan).len(), 1);
        let ev = has_event(&sim, &plan, EventReason::CoRestart(R::MemberNotReady)).unwrap();
        assert!(ev.message.contains("no progress"), "{}", ev.message);
    }
    // Its KV transfer making no progress is the channel's fault: reset in place. The
    // message is for people: the structured `stalled` decides, whatever the sentence.
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.report_no_progress(&d, Some("kv_transfer"));
    let plan = stalled_plan(&mut sim);
    assert!(plan.co_restarts[0].in_place);
    assert_eq!(resets(&plan).len(), 1);

    // A decode that does not say why (it may hang).
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.set_ready(&d, false);
    sim.reconcile();
    sim.advance(sim.spec.health.co_restart_after_seconds as u64 + 1);
    let plan = sim.reconcile();
    assert!(!plan.co_restarts[0].in_place && resets(&plan).is_empty());

    // A prefill that is not ready (a SIGSTOPped prefill: its decode's channel fails too).
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.set_ready(&p, false);
    let plan = decode_fault(&mut sim, "peer_unresponsive");
    assert!(!plan.co_restarts[0].in_place && resets(&plan).is_empty());

    // A member that exited.
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.fail(&d);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberFailed)]);
    assert!(!plan.co_restarts[0].in_place && resets(&plan).is_empty());

    // Turned off.
    let mut sim = ready_sim(1);
    sim.spec.restart.in_place_reset_seconds = 0;
    let plan = decode_fault(&mut sim, "peer_restarted");
    assert!(!plan.co_restarts[0].in_place && resets(&plan).is_empty());
    let ev = has_event(&sim, &plan, EventReason::CoRestart(R::MemberNotReady)).unwrap();
    assert!(
        ev.message.contains("inPlaceResetSeconds is 0"),
        "{}",
        ev.message
    );
}

#[test]
fn a_reset_that_does_not_complete_in_time_falls_back_to_new_pods() {
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.reset_refused.insert(d.clone());
    decode_fault(&mut sim, "handshake_timeout");
    // The prefill resets; the decode never answers.
    sim.reconcile();
    assert_eq!(sim.pods[&p].incarnation, 2);
    let limit = sim.spec.restart.in_place_reset_seconds as u64;
    let mut fell_back = None;
    for _ in 0..limit + 2 {
        sim.advance(1);
        let plan = sim.reconcile();
        if let Some(ev) = has_event(&sim, &plan, EventReason::InPlaceResetFailed) {
            fell_back = Some((plan, ev));
            break;
        }
        assert_eq!(resets(&plan), vec![(d.clone(), Role::Decode, 2)]);
    }
    let (plan, ev) = fell_back.expect("the reset gave up within its limit");
    assert_eq!(ev.type_, EventKind::Warning);
    assert!(ev.message.contains("inPlaceResetSeconds"), "{}", ev.message);
    assert_eq!(plan.resets, vec![(0, ResetOutcome::FellBack)]);
    // Decode first, at a newer incarnation: the reset prefill goes too.
    assert_eq!(Sim::deleted(&plan), vec![(d.clone(), Role::Decode)]);
    let g = sim.group(0);
    assert_eq!((g.phase, g.incarnation), (GroupPhase::Restarting, 3));
    assert!(!g.last_co_restart.as_ref().unwrap().in_place);
    assert_eq!(g.co_restarts, 1, "the same co-restart, not a second one");
    sim.finish_terminations();
    sim.settle(50);
    let g = sim.group(0);
    assert_eq!((g.phase, g.incarnation), (GroupPhase::Ready, 3));
    assert!(!sim.pods.contains_key(&p) && !sim.pods.contains_key(&d));
}

#[test]
fn a_member_that_fails_during_a_reset_ends_it_at_once() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.reset_refused.insert(d.clone());
    decode_fault(&mut sim, "no_session");
    sim.fail(&d);
    let plan = sim.reconcile();
    let ev = has_event(&sim, &plan, EventReason::InPlaceResetFailed).expect("gave up");
    assert!(ev.message.contains("exited"), "{}", ev.message);
    assert_eq!(sim.group(0).phase, GroupPhase::Restarting);
    // The exited decode is removed with the short grace: it has nothing to drain.
    assert!(plan.actions.iter().any(|a| matches!(
        a,
        PlannedAction::DeletePod { name, grace: Grace::Unresponsive { .. }, .. } if *name == d
    )));
}

/// A decode that fails again right after its reset, before its group was seen Ready, is
/// not reset a second time: the next co-restart recreates the pods.
#[test]
fn a_reset_that_did_not_bring_the_group_back_is_not_tried_twice() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    decode_fault(&mut sim, "peer_restarted");
    sim.reconcile(); // the decode resets
    sim.report(&d, "peer_restarted", "again");
    let plan = sim.reconcile(); // done; not Ready
    assert!(has_event(&sim, &plan, EventReason::InPlaceResetCompleted).is_some());
    assert_ne!(sim.group(0).phase, GroupPhase::Ready);
    // Past the backoff and the window.
    let mut decided = None;
    for _ in 0..40 {
        sim.advance(5);
        let plan = sim.reconcile();
        if !plan.co_restarts.is_empty() {
            decided = Some(plan);
            break;
        }
    }
    let plan = decided.expect("a second co-restart");
    assert!(!plan.co_restarts[0].in_place, "recreated the second time");
    let ev = has_event(&sim, &plan, EventReason::CoRestart(R::MemberNotReady)).unwrap();
    assert!(
        ev.message.contains("previous in-place reset"),
        "{}",
        ev.message
    );
}

#[test]
fn a_reset_call_is_bounded_by_what_is_left_of_the_limit() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.reset_refused.insert(only_pod(&sim, 0, Role::Prefill));
    let plan = decode_fault(&mut sim, "peer_lost");
    let timeout = |plan: &Plan| {
        plan.actions.iter().find_map(|a| match a {
            PlannedAction::ResetMember { timeout, .. } => Some(*timeout),
            _ => None,
        })
    };
    assert_eq!(timeout(&plan), Some(reset::MAX_RESET_CALL));
    let limit = sim.spec.restart.in_place_reset_seconds as u64;
    sim.advance(limit - 2);
    let plan = sim.reconcile();
    assert_eq!(timeout(&plan), Some(Duration::from_secs(2)));
    assert!(!sim.pods[&d].group_ready_gate);
}
