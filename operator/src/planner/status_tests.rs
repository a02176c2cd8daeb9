//! Table tests of the status: conditions and counts, why a member does not run, what a
//! not-ready decode says and where it goes (the group's `decodeNotReady`, the
//! `BootstrapHealthy` condition and its reason's rules).

use super::sim::Sim;
use super::tests::{condition_of, only_pod, ready_sim};
use super::*;
use crate::crd::{CoRestartReason as R, conditions};
use crate::testutil::spec;

#[test]
fn conditions_keep_their_transition_time_while_unchanged() {
    let mut sim = ready_sim(1);
    let t0 = condition_of(&sim, conditions::AVAILABLE)
        .last_transition_time
        .clone();
    sim.advance(100);
    sim.reconcile();
    assert_eq!(
        condition_of(&sim, conditions::AVAILABLE).last_transition_time,
        t0
    );
}

#[test]
fn status_counts_and_selector() {
    let sim = ready_sim(2);
    let st = sim.status.as_ref().unwrap();
    assert_eq!((st.groups, st.ready_groups, st.updated_groups), (2, 2, 2));
    assert_eq!(
        st.selector.as_deref(),
        Some("tandem.dev/deployment=demo,tandem.dev/role=decode")
    );
    assert_eq!(
        st.group_statuses[1].pods,
        vec!["demo-g1-i1-d0", "demo-g1-i1-p0"]
    );
}

#[test]
fn a_pod_stuck_terminating_past_its_grace_is_force_deleted() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    let p = only_pod(&sim, 0, Role::Prefill);
    // The node is gone: both pods are not ready; after the window the group co-restarts,
    // and nobody ever confirms the deletion of its pods. They are deleted with the short
    // grace (their node is lost), so the force-delete follows it, with no margin
    // (grace_tests.rs has the margin after the full grace of a pod deleted by someone else).
    sim.lose_node_of(&d);
    sim.lose_node_of(&p);
    sim.reconcile();
    sim.advance(31);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberNotReady)]);
    assert_eq!(Sim::deleted(&plan), vec![(d.clone(), Role::Decode)]);
    let short = Duration::from_secs(crate::crd::DEFAULT_UNRESPONSIVE_GRACE_SECONDS as u64);
    // The decode, terminating on a lost node, holds nothing: the prefill is deleted in the
    // next plan; within the grace period: wait, and ask to be woken at its end (no margin
    // on a lost node: no kubelet will confirm).
    let plan = sim.reconcile();
    assert_eq!(Sim::deleted(&plan), vec![(p.clone(), Role::Prefill)]);
    let plan = sim.reconcile();
    assert!(
        !plan
            .actions
            .iter()
            .any(|a| matches!(a, PlannedAction::ForceDeletePod { .. }))
    );
    let wake = plan.requeue_after.expect("a requeue at the grace's end");
    assert_eq!(wake, short);
    sim.advance(wake.as_secs());
    let plan = sim.reconcile();
    for (name, role) in [(&d, Role::Decode), (&p, Role::Prefill)] {
        assert!(plan.actions.contains(&PlannedAction::ForceDeletePod {
            name: name.clone(),
            group: 0,
            role
        }));
        assert!(
            sim.events(&plan)
                .iter()
                .any(|e| e.reason.as_str() == "PodForceDeleted"
                    && e.type_ == EventKind::Warning
                    && e.message.contains(name.as_str()))
        );
    }
    sim.settle(20);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    assert_eq!(sim.group(0).incarnation, 2);
}

#[test]
fn why_a_member_does_not_run_reaches_the_group_message() {
    let mut sim = Sim::new(spec(1));
    sim.reconcile();
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.pods.get_mut(&p).unwrap().waiting =
        Some("Unschedulable: 0/2 nodes are available: 2 Insufficient cpu.".into());
    sim.reconcile();
    let g = sim.group(0);
    assert_eq!(g.phase, GroupPhase::StartingPrefill);
    assert_eq!(
        g.message.as_deref(),
        Some(
            "prefill pod demo-g0-i1-p0: Unschedulable: 0/2 nodes are available: 2 Insufficient cpu."
        )
    );
    sim.pods.get_mut(&p).unwrap().waiting = None;
    sim.reconcile();
    assert_eq!(sim.group(0).message, None);
}

#[test]
fn a_held_back_co_restart_keeps_the_status_still() {
    let mut s = spec(1);
    s.restart.backoff.base_seconds = 60;
    let mut sim = Sim::new(s);
    sim.settle(20);
    // The first two failures (each after the group served again) restart at once; the
    // third in a row is held back by the backoff.
    for _ in 0..super::group::FLAPPING_STREAK {
        let d = only_pod(&sim, 0, Role::Decode);
        sim.fail(&d);
        assert_eq!(sim.reconcile().co_restarts.len(), 1);
        sim.settle(20);
    }
    let d = only_pod(&sim, 0, Role::Decode);
    sim.fail(&d);
    sim.reconcile();
    let first = sim.status.clone().unwrap();
    assert!(
        first.group_statuses[0]
            .message
            .as_deref()
            .unwrap()
            .contains("held back by backoff until")
    );
    // Time passes inside the backoff: nothing in the status may change (no countdown).
    sim.advance(7);
    sim.reconcile();
    sim.advance(11);
    sim.reconcile();
    assert_eq!(sim.status.clone().unwrap(), first);
}

/// A sim whose group 0 has a Ready prefill and a running, not-ready decode.
fn decode_starting() -> (Sim, String) {
    let mut sim = Sim::new(spec(1));
    sim.reconcile();
    sim.start_pending();
    sim.reconcile(); // creates the decode
    let d = only_pod(&sim, 0, Role::Decode);
    sim.set_ready(&d, false);
    (sim, d)
}

#[test]
fn a_decode_reason_reaches_the_group_status_and_the_condition() {
    let (mut sim, d) = decode_starting();
    let plan = sim.reconcile();
    assert_eq!(
        sim.group(0).decode_not_ready,
        None,
        "no reason reported yet"
    );
    let c = condition_of(&sim, conditions::BOOTSTRAP_HEALTHY);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "ChannelNotReady")
    );
    assert_eq!(plan.requeue_after, None);

    let said = "handshake prefill-0.demo-g0-bootstrap.ns.svc:5600: no authenticated session: we refused the prefill: WELCOME MAC does not verify with the group key (auth_failed)";
    sim.report(&d, "auth_failed", said);
    let plan = sim.reconcile();
    let g = sim.group(0);
    assert_eq!(g.phase, GroupPhase::StartingDecode);
    assert_eq!(
        g.decode_not_ready,
        Some(crate::crd::DecodeNotReady {
            pod: d.clone(),
            reason: "auth_failed".into(),
            message: said.into(),
        })
    );
    assert_eq!(
        g.message.as_deref(),
        Some(format!("decode pod {d}: auth_failed: {said}").as_str())
    );
    let c = condition_of(&sim, conditions::BOOTSTRAP_HEALTHY);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "auth_failed")
    );
    assert_eq!(
        c.message,
        format!("KV channel not healthy in groups 0; group 0 decode pod {d}: auth_failed: {said}")
    );
    // Looked at again soon, so that a change of reason shows without a pod event.
    assert_eq!(plan.requeue_after, Some(READY_DETAIL_REFRESH));

    // The decode heals: nothing to report, the condition turns True.
    sim.set_ready(&d, true);
    sim.reconcile();
    assert_eq!(sim.group(0).decode_not_ready, None);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    let c = condition_of(&sim, conditions::BOOTSTRAP_HEALTHY);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "AllChannelsHealthy")
    );
}

#[test]
fn the_message_of_a_reason_is_kept_until_the_reason_changes() {
    // Messages carry counters ("last PONG 8123 ms ago"): a status that changed on every
    // read would itself trigger the next reconcile.
    let (mut sim, d) = decode_starting();
    sim.report(&d, "probe_timeout", "probe p:5600: last PONG 6100 ms ago");
    sim.reconcile();
    let first = sim.status.clone().unwrap();
    sim.advance(5);
    sim.report(&d, "probe_timeout", "probe p:5600: last PONG 11100 ms ago");
    sim.reconcile();
    assert_eq!(
        sim.status.as_ref().unwrap(),
        &first,
        "no change for a new counter"
    );
    sim.report(
        &d,
        "peer_unreachable",
        "handshake p:5600: connection refused",
    );
    sim.reconcile();
    let g = sim.group(0).decode_not_ready.clone().unwrap();
    assert_eq!(
        (g.reason.as_str(), g.message.as_str()),
        ("peer_unreachable", "handshake p:5600: connection refused")
    );
    assert_eq!(
        condition_of(&sim, conditions::BOOTSTRAP_HEALTHY).reason,
        "peer_unreachable"
    );
}

#[test]
fn a_reason_kubernetes_would_refuse_is_not_the_condition_reason() {
    let (mut sim, d) = decode_starting();
    let long = "x".repeat(2000);
    sim.report(&d, "not a reason!", &long);
    sim.reconcile();
    let c = condition_of(&sim, conditions::BOOTSTRAP_HEALTHY);
    assert_eq!(c.reason, "DecodeNotReady");
    let g = sim.group(0).decode_not_ready.clone().unwrap();
    assert_eq!(
        g.reason, "not a reason!",
        "kept verbatim in the group status"
    );
    assert_eq!(
        g.message,
        format!("{}…", "x".repeat(512)),
        "long messages are cut"
    );
}

#[test]
fn condition_reasons_follow_the_api_servers_rule() {
    for ok in ["auth_failed", "A", "DecodeNotReady", "a:b,c_d", "x_"] {
        assert!(crate::reasons::is_condition_reason(ok), "{ok}");
    }
    for bad in [
        "",
        "_x",
        "9lives",
        "a b",
        "a-b",
        "a:",
        "a,",
        "ü",
        &"a".repeat(1025),
    ] {
        assert!(!crate::reasons::is_condition_reason(bad), "{bad}");
    }
}

#[test]
fn only_running_not_ready_decode_pods_of_the_incarnation_are_reported() {
    let (mut sim, d) = decode_starting();
    let p = only_pod(&sim, 0, Role::Prefill);
    // A prefill's detail is not the decode's reason.
    sim.pods.get_mut(&p).unwrap().ready_detail = Some(ReadyDetail::new("engine_stalled", "x"));
    sim.reconcile();
    assert_eq!(sim.group(0).decode_not_ready, None);
    // A terminating decode says nothing that matters any more.
    sim.report(&d, "draining", "not_draining: shutting down");
    sim.pods.get_mut(&d).unwrap().terminating = true;
    assert_eq!(sim.peek().status.group_statuses[0].decode_not_ready, None);
}

#[test]
fn several_groups_report_the_lowest_first_and_a_co_restart_names_the_reason() {
    let mut sim = ready_sim(2);
    let window = sim.spec.health.co_restart_after_seconds as u64;
    let d0 = only_pod(&sim, 0, Role::Decode);
    let d1 = only_pod(&sim, 1, Role::Decode);
    sim.report(
        &d1,
        "peer_expired",
        "handshake p1:5600: the prefill dropped our session",
    );
    sim.report(&d0, "probe_timeout", "probe p0:5600: last PONG 6100 ms ago");
    sim.reconcile();
    let c = condition_of(&sim, conditions::BOOTSTRAP_HEALTHY);
    assert_eq!(c.reason, "probe_timeout", "group 0's reason");
    assert_eq!(
        c.message,
        format!(
            "KV channel not healthy in groups 0,1; group 0 decode pod {d0}: probe_timeout: probe p0:5600: last PONG 6100 ms ago; group 1 decode pod {d1}: peer_expired: handshake p1:5600: the prefill dropped our session"
        )
    );
    assert_eq!(sim.group(0).phase, GroupPhase::Broken);
    // Past the window: the co-restart's event says what the decode said.
    sim.advance(window);
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(0, R::MemberNotReady), (1, R::MemberNotReady)]
    );
    let ev = sim
        .events(&plan)
        .into_iter()
        .find(|e| e.group == 0 && e.reason.as_str() == "MemberNotReady")
        .unwrap();
    assert!(
        ev.message.ends_with(&format!(
            "decode pod {d0} not ready for more than {window}s: probe_timeout: probe p0:5600: last PONG 6100 ms ago"
        )),
        "{}",
        ev.message
    );
    // The reported pod belongs to the incarnation being removed.
    assert_eq!(sim.group(0).decode_not_ready, None);
}

#[test]
fn a_rollout_deletes_a_decode_only_once_it_has_left_its_services() {
    let mut sim = ready_sim(1);
    sim.spec.decode.template.image = "tandem:2".into();
    let d = only_pod(&sim, 0, Role::Decode);
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(0, R::RevisionChanged)]
    );
    assert!(plan.actions.contains(&PlannedAction::SetGroupReadyGate {
        pod: d.clone(),
        ready: false
    }));
    assert!(
        Sim::deleted(&plan).is_empty(),
        "deleted while still routed to"
    );
    assert!(
        sim.group(0)
            .message
            .as_deref()
            .unwrap()
            .contains("out of the Services")
    );
    sim.advance(ENDPOINTS_SETTLE.as_secs() - 1);
    assert!(Sim::deleted(&sim.reconcile()).is_empty());
    sim.advance(1);
    assert_eq!(Sim::deleted(&sim.reconcile()), vec![(d, Role::Decode)]);
}
