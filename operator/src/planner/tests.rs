//! Table tests: one per co-restart trigger and per rollout rule.

use std::time::Duration;

use super::sim::Sim;
use super::*;
use crate::crd::{CoRestartReason as R, GroupPhase, RestartPolicy, conditions};
use crate::testutil::spec;

/// A sim with `groups` groups built and Ready.
/// A simulator whose `groups` groups have all become Ready (shared with grace_tests.rs).
pub(super) fn ready_sim(groups: i32) -> Sim {
    let mut sim = Sim::new(spec(groups));
    sim.settle(50);
    for g in 0..groups {
        assert_eq!(sim.group(g).phase, GroupPhase::Ready, "group {g} ready");
    }
    sim
}

/// The name of group `g`'s one pod of `role`.
pub(super) fn only_pod(sim: &Sim, g: i32, role: Role) -> String {
    let pods = sim.pods_of(g, role);
    assert_eq!(pods.len(), 1, "one {role:?} pod in group {g}");
    pods[0].name.clone()
}

pub(super) fn condition_of<'a>(
    sim: &'a Sim,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    sim.status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap()
}

#[test]
fn new_deployment_creates_prefill_and_objects_but_no_decode() {
    let mut sim = Sim::new(spec(1));
    let plan = sim.reconcile();
    assert!(plan.actions.contains(&PlannedAction::ApplyClientService));
    assert!(
        plan.actions
            .contains(&PlannedAction::ApplyGroupService { group: 0 })
    );
    assert!(
        plan.actions
            .contains(&PlannedAction::ApplyNetworkPolicy { group: 0 })
    );
    assert!(
        plan.actions
            .contains(&PlannedAction::CreateGroupSecret { group: 0 })
    );
    assert_eq!(
        Sim::created(&plan),
        vec![("demo-g0-i1-p0".to_string(), Role::Prefill)]
    );
    assert_eq!(sim.group(0).phase, GroupPhase::StartingPrefill);
    assert_eq!(sim.group(0).incarnation, 1);
    // A second reconcile with nothing changed creates nothing, and applies the Services
    // and the NetworkPolicy again (a no-op unless someone edited them), but not the
    // Secret.
    let plan = sim.reconcile();
    assert!(Sim::created(&plan).is_empty());
    assert_eq!(
        plan.actions,
        vec![
            PlannedAction::ApplyClientService,
            PlannedAction::ApplyGroupService { group: 0 },
            PlannedAction::ApplyNetworkPolicy { group: 0 },
        ]
    );
}

#[test]
fn decode_waits_for_every_prefill_replica() {
    let mut s = spec(1);
    s.prefill.replicas = 2;
    s.decode.replicas = 2;
    let mut sim = Sim::new(s);
    sim.reconcile();
    assert_eq!(sim.pods_of(0, Role::Prefill).len(), 2);
    sim.set_ready("demo-g0-i1-p0", true);
    let plan = sim.reconcile();
    assert!(Sim::created(&plan).is_empty(), "one prefill still starting");
    sim.set_ready("demo-g0-i1-p1", true);
    let plan = sim.reconcile();
    assert_eq!(
        Sim::created(&plan),
        vec![
            ("demo-g0-i1-d0".to_string(), Role::Decode),
            ("demo-g0-i1-d1".to_string(), Role::Decode)
        ]
    );
    assert_eq!(sim.group(0).phase, GroupPhase::StartingDecode);
}

#[test]
fn gate_opens_only_when_the_whole_group_is_ready() {
    let mut sim = Sim::new(spec(1));
    sim.reconcile();
    sim.start_pending();
    sim.reconcile(); // creates decode
    let d = only_pod(&sim, 0, Role::Decode);
    let plan = sim.reconcile();
    assert!(
        !plan
            .actions
            .iter()
            .any(|a| matches!(a, PlannedAction::SetGroupReadyGate { .. })),
        "gate stays closed while the decode is not ready"
    );
    sim.set_ready(&d, true);
    let plan = sim.reconcile();
    assert!(plan.actions.contains(&PlannedAction::SetGroupReadyGate {
        pod: d.clone(),
        ready: true
    }));
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    assert!(sim.group(0).bootstrap_healthy);
    assert_eq!(plan.became_ready.len(), 1);
    assert_eq!(condition_of(&sim, conditions::AVAILABLE).status, "True");
    assert_eq!(
        condition_of(&sim, conditions::BOOTSTRAP_HEALTHY).status,
        "True"
    );
    // The decode's channel breaks: the gate closes at once, before any co-restart.
    sim.set_ready(&d, false);
    let plan = sim.reconcile();
    assert!(plan.actions.contains(&PlannedAction::SetGroupReadyGate {
        pod: d,
        ready: false
    }));
    assert_eq!(sim.group(0).phase, GroupPhase::Broken);
    assert_eq!(
        condition_of(&sim, conditions::BOOTSTRAP_HEALTHY).status,
        "False"
    );
    assert!(plan.co_restarts.is_empty());
}

#[test]
fn member_failed_event_says_how_the_member_ended() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.fail(&d);
    sim.pods.get_mut(&d).unwrap().exit = Some("OOMKilled, exit code 137".into());
    let plan = sim.reconcile();
    let ev = sim.events(&plan);
    assert!(
        ev.iter().any(|e| e.reason.as_str() == "MemberFailed"
            && e.message.contains(&format!(
                "decode pod {d} exited (Failed: OOMKilled, exit code 137)"
            ))),
        "{ev:#?}"
    );
}

#[test]
fn member_failed_removes_decode_then_prefill_then_rebuilds_prefill_first() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.fail(&d);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberFailed)]);
    assert_eq!(
        Sim::deleted(&plan),
        vec![(d.clone(), Role::Decode)],
        "decode first, alone"
    );
    let ev = sim.events(&plan);
    assert!(ev.iter().any(|e| e.reason.as_str() == "MemberFailed"
        && e.type_ == EventKind::Warning
        && e.message.contains("incarnation 1 → 2")));
    let g = sim.group(0);
    assert_eq!(
        (g.incarnation, g.phase, g.co_restarts),
        (2, GroupPhase::Restarting, 1)
    );
    assert_eq!(g.last_co_restart.as_ref().unwrap().reason, R::MemberFailed);

    // The decode is still terminating: the prefill is not touched yet.
    let plan = sim.reconcile();
    assert!(Sim::deleted(&plan).is_empty());
    assert!(Sim::created(&plan).is_empty());
    sim.finish_terminations();
    let plan = sim.reconcile();
    assert_eq!(Sim::deleted(&plan), vec![(p, Role::Prefill)]);
    assert!(
        Sim::created(&plan).is_empty(),
        "nothing new while the old prefill lives"
    );
    sim.finish_terminations();
    let plan = sim.reconcile();
    assert_eq!(
        Sim::created(&plan),
        vec![("demo-g0-i2-p0".to_string(), Role::Prefill)]
    );
    sim.settle(20);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    assert_eq!(sim.group(0).incarnation, 2);
}

#[test]
fn member_failed_prefill_also_co_restarts() {
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.fail(&p);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberFailed)]);
    // The healthy decode goes first, even though the prefill is the one that failed.
    assert_eq!(Sim::deleted(&plan)[0].1, Role::Decode);
    assert_eq!(Sim::deleted(&plan).len(), 1);
}

#[test]
fn member_deleted_when_evicted() {
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.evict(&p);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberDeleted)]);
}

#[test]
fn member_deleted_when_a_pod_vanishes() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.vanish(&d);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberDeleted)]);
    // Nothing decode is left, so the prefill goes in the same step.
    assert_eq!(Sim::deleted(&plan).len(), 1);
    assert_eq!(Sim::deleted(&plan)[0].1, Role::Prefill);
}

/// The window counts from the member's first failed probe: its readiness turned false
/// (threshold − 1) probe periods after that.
fn window_after_the_flip(sim: &Sim) -> u64 {
    let h = &sim.spec.health;
    let detection = (h.failure_threshold as u64 - 1) * h.probe_period_seconds as u64;
    assert!(
        detection > 0,
        "the spec's probes must detect over time for this to test it"
    );
    h.co_restart_after_seconds as u64 - detection
}

#[test]
fn member_not_ready_after_the_window_only() {
    let mut sim = ready_sim(1);
    let window = window_after_the_flip(&sim);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.set_ready(&d, false);
    let plan = sim.reconcile();
    assert!(plan.co_restarts.is_empty());
    assert_eq!(plan.requeue_after, Some(Duration::from_secs(window)));
    sim.advance(window - 1);
    assert!(sim.reconcile().co_restarts.is_empty());
    sim.advance(1);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberNotReady)]);
}

#[test]
fn a_window_shorter_than_the_detection_ends_at_the_flip_not_before() {
    let mut s = spec(1);
    s.health.co_restart_after_seconds = 1;
    s.health.probe_period_seconds = 2;
    s.health.failure_threshold = 3;
    let mut sim = Sim::new(s);
    sim.settle(50);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.set_ready(&d, false);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberNotReady)]);
}

#[test]
fn member_not_ready_counts_only_members_that_were_ready() {
    // A prefill that never became Ready is still starting, not wedged.
    let mut sim = Sim::new(spec(1));
    sim.reconcile();
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.set_ready(&p, false);
    sim.advance(3600);
    let plan = sim.reconcile();
    assert!(plan.co_restarts.is_empty());
    assert_eq!(sim.group(0).phase, GroupPhase::StartingPrefill);
}

#[test]
fn prefill_with_decode_was_ready_and_counts_as_wedged() {
    let mut sim = Sim::new(spec(1));
    sim.reconcile();
    sim.start_pending();
    sim.reconcile(); // decode created: the prefill was Ready
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.set_ready(&p, false);
    sim.advance(sim.spec.health.co_restart_after_seconds as u64);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberNotReady)]);
}

#[test]
fn incarnation_mismatch_inside_a_group() {
    let mut sim = ready_sim(1);
    // A decode of an old incarnation shows up beside the group's pods (for example
    // left behind by an operator that lost its status).
    let mut stray = sim
        .pods
        .values()
        .find(|p| p.role == Role::Decode)
        .unwrap()
        .clone();
    stray.name = "demo-g0-i0-d0".into();
    stray.incarnation = 0;
    sim.pods.insert(stray.name.clone(), stray);
    let plan = sim.peek();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(0, R::IncarnationMismatch)]
    );
    // Both decodes go first; the prefill waits.
    let deleted = Sim::deleted(&plan);
    assert_eq!(deleted.len(), 2);
    assert!(deleted.iter().all(|(_, r)| *r == Role::Decode));
}

#[test]
fn status_lost_recovers_incarnation_from_labels() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.fail(&d);
    sim.reconcile();
    sim.settle(20);
    assert_eq!(sim.group(0).incarnation, 2);
    sim.status = None; // the operator forgot everything
    let plan = sim.reconcile();
    assert!(
        plan.co_restarts.is_empty(),
        "no restart for a healthy group"
    );
    assert!(Sim::created(&plan).is_empty());
    assert_eq!(sim.group(0).incarnation, 2);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
}

#[test]
fn revision_change_rolls_one_group_at_a_time_highest_first() {
    let mut sim = ready_sim(3);
    sim.spec.decode.template.image = "tandem:2".into();
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(2, R::RevisionChanged)]
    );
    let ev = sim.events(&plan);
    assert!(
        ev.iter()
            .any(|e| e.reason.as_str() == "RevisionChanged" && e.type_ == EventKind::Normal)
    );
    // Group 2 is down: nothing else starts.
    assert!(sim.reconcile().co_restarts.is_empty());
    let mut order = vec![2];
    for _ in 0..60 {
        sim.start_pending();
        sim.finish_terminations();
        let plan = sim.reconcile();
        order.extend(plan.co_restarts.iter().map(|r| r.group));
        // Each group's decode leaves its Services before it is deleted.
        sim.advance(1);
    }
    assert_eq!(order, vec![2, 1, 0]);
    let st = sim.status.as_ref().unwrap();
    assert_eq!(st.updated_groups, 3);
    assert_eq!(st.current_revision, st.update_revision);
    assert_eq!(
        condition_of(&sim, conditions::PROGRESSING).reason,
        "Complete"
    );
}

#[test]
fn min_ready_seconds_holds_the_next_group_until_the_rebuilt_one_has_settled() {
    let mut sim = ready_sim(3);
    sim.spec.rollout.min_ready_seconds = 5;
    sim.spec.decode.template.image = "tandem:2".into();
    // Groups Ready for less than 5 s are not taken down by the rollout either.
    assert!(sim.reconcile().co_restarts.is_empty());
    sim.advance(5);
    assert_eq!(
        Sim::co_restart_reasons(&sim.reconcile()),
        vec![(2, R::RevisionChanged)]
    );
    // Group 2's decode leaves its Services first (ENDPOINTS_SETTLE); then rebuild it
    // without the clock moving: it turns Ready, but group 1 waits.
    sim.advance(ENDPOINTS_SETTLE.as_secs());
    for _ in 0..20 {
        sim.start_pending();
        sim.finish_terminations();
        let plan = sim.reconcile();
        assert!(plan.co_restarts.is_empty(), "{:?}", plan.co_restarts);
    }
    assert_eq!(sim.group(2).phase, GroupPhase::Ready);
    let plan = sim.reconcile();
    assert!(plan.co_restarts.is_empty());
    // The planner asks to be called back when group 2 has settled, not later.
    let requeue = plan.requeue_after.expect("a requeue while group 2 settles");
    assert!(requeue <= Duration::from_secs(5), "{requeue:?}");
    sim.advance(4);
    assert!(sim.reconcile().co_restarts.is_empty(), "4 s of the 5 only");
    sim.advance(1);
    assert_eq!(
        Sim::co_restart_reasons(&sim.reconcile()),
        vec![(1, R::RevisionChanged)]
    );
}

#[test]
fn min_ready_seconds_does_not_delay_failure_repairs() {
    let mut sim = ready_sim(2);
    sim.spec.rollout.min_ready_seconds = 60;
    // Group 1 just became Ready again (its ready_since is now); group 0 fails: repaired at
    // once, whatever the settle time.
    let decode = only_pod(&sim, 0, Role::Decode);
    sim.fail(&decode);
    assert_eq!(
        Sim::co_restart_reasons(&sim.reconcile()),
        vec![(0, R::MemberFailed)]
    );
}

#[test]
fn max_unavailable_two_rolls_two_groups_at_once() {
    let mut sim = ready_sim(3);
    sim.spec.rollout.max_unavailable_groups = 2;
    sim.spec.prefill.template.image = "tandem:2".into();
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(1, R::RevisionChanged), (2, R::RevisionChanged)]
    );
}

#[test]
fn partition_keeps_lower_groups_on_the_old_revision() {
    let mut sim = ready_sim(3);
    let old = sim.group(0).revision.clone();
    sim.spec.rollout.partition = 2;
    sim.spec.decode.template.image = "tandem:2".into();
    sim.settle(60);
    assert_ne!(sim.group(2).revision, old);
    assert_eq!(sim.group(1).revision, old);
    assert_eq!(sim.group(0).revision, old);
    // A held-back group that fails is rebuilt at its own (current) revision.
    let d = only_pod(&sim, 0, Role::Decode);
    sim.fail(&d);
    sim.settle(60);
    assert_eq!(sim.group(0).revision, old);
    assert_eq!(sim.group(0).incarnation, 2);
    let pods = sim.pods_of(0, Role::Prefill);
    assert_eq!(pods[0].revision, old);
}

#[test]
fn paused_rollout_starts_nothing() {
    let mut sim = ready_sim(2);
    sim.spec.rollout.paused = true;
    sim.spec.decode.template.image = "tandem:2".into();
    let plan = sim.reconcile();
    assert!(plan.co_restarts.is_empty());
    assert_eq!(condition_of(&sim, conditions::PROGRESSING).reason, "Paused");
    sim.spec.rollout.paused = false;
    assert_eq!(sim.reconcile().co_restarts.len(), 1);
}

#[test]
fn pausing_keeps_updated_groups_where_they_are() {
    // partition 1: group 1 moves to the new revision, group 0 stays.
    let mut sim = ready_sim(2);
    let old = sim
        .status
        .as_ref()
        .unwrap()
        .update_revision
        .clone()
        .unwrap();
    sim.spec.rollout.partition = 1;
    sim.spec.decode.template.image = "tandem:2".into();
    sim.settle(40);
    let new = sim
        .status
        .as_ref()
        .unwrap()
        .update_revision
        .clone()
        .unwrap();
    assert_ne!(old, new);
    assert_eq!(sim.group(1).revision, new);
    assert_eq!(sim.group(0).revision, old);
    // Pause with the partition lifted: nothing moves, in either direction.
    sim.spec.rollout.partition = 0;
    sim.spec.rollout.paused = true;
    let plan = sim.reconcile();
    assert!(plan.co_restarts.is_empty(), "{:?}", plan.co_restarts);
    sim.settle(10);
    assert_eq!(
        (sim.group(0).revision.clone(), sim.group(1).revision.clone()),
        (old.clone(), new.clone())
    );
    // A failure while paused rebuilds the updated group at its own revision.
    let d1 = only_pod(&sim, 1, Role::Decode);
    sim.fail(&d1);
    sim.settle(40);
    assert_eq!(sim.group(1).revision, new);
    assert_eq!(sim.group(1).phase, GroupPhase::Ready);
    // Unpaused: group 0 follows.
    sim.spec.rollout.paused = false;
    sim.settle(40);
    assert_eq!(sim.group(0).revision, new);
}

#[test]
fn broken_groups_are_repaired_before_healthy_ones_are_rolled() {
    let mut sim = ready_sim(3);
    let d0 = only_pod(&sim, 0, Role::Decode);
    sim.fail(&d0);
    sim.spec.decode.template.image = "tandem:2".into();
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(0, R::MemberFailed)],
        "the repair uses the rollout's budget; healthy groups wait"
    );
    // The repair rebuilds the group at the update revision.
    assert_eq!(
        sim.group(0).revision,
        sim.status
            .as_ref()
            .unwrap()
            .update_revision
            .clone()
            .unwrap()
    );
}

#[test]
fn restart_request_rolls_groups_once_each() {
    let mut sim = ready_sim(2);
    sim.advance(10);
    sim.restart_requested_at = Some(sim.now);
    sim.advance(1);
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(1, R::RestartRequested)]
    );
    let mut n = 1;
    for _ in 0..40 {
        sim.start_pending();
        sim.finish_terminations();
        n += sim.reconcile().co_restarts.len();
        sim.advance(1);
    }
    assert_eq!(n, 2, "each group restarted exactly once");
    assert!(sim.reconcile().co_restarts.is_empty());
}

#[test]
fn restart_request_in_the_future_is_ignored() {
    let mut sim = ready_sim(1);
    sim.restart_requested_at = Some(sim.now.checked_add(SignedDuration::from_hours(1)).unwrap());
    assert!(sim.reconcile().co_restarts.is_empty());
}

/// Fail group 0's decode; the plan of the reconcile that saw it.
fn fail_decode(sim: &mut Sim) -> Plan {
    let d = only_pod(sim, 0, Role::Decode);
    sim.fail(&d);
    sim.reconcile()
}

/// Rebuild group 0 to Ready without letting time pass (well inside any backoff).
fn rebuild_at_once(sim: &mut Sim) {
    for _ in 0..6 {
        sim.finish_terminations();
        sim.start_pending();
        sim.reconcile();
    }
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
}

/// The backoff is held only once the group is flapping: from its `FLAPPING_STREAK + 1`-th
/// failure in a row, each after it served again; then `base × 2^(n-1)`, capped at max.
#[test]
fn repeated_failures_back_off_exponentially_once_the_group_flaps() {
    let mut s = spec(1);
    s.restart.backoff.base_seconds = 10;
    s.restart.backoff.max_seconds = 25;
    let mut sim = Sim::new(s);
    sim.settle(20);
    let mut delays = vec![];
    for round in 0..5 {
        let plan = fail_decode(&mut sim);
        if round < super::group::FLAPPING_STREAK {
            assert_eq!(
                plan.co_restarts.len(),
                1,
                "round {round}: a group that served again is repaired at once"
            );
        } else {
            assert!(plan.co_restarts.is_empty(), "round {round}: held back");
            assert_eq!(sim.group(0).phase, GroupPhase::Broken);
            let c = condition_of(&sim, conditions::DEGRADED);
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("True", "CoRestartBackoff")
            );
            let wait = plan.requeue_after.expect("requeue at the deadline");
            delays.push(wait.as_secs());
            sim.advance(wait.as_secs());
            assert_eq!(sim.reconcile().co_restarts.len(), 1);
        }
        let next = sim.group(0).next_restart_after.clone().unwrap();
        assert!(next.0 > sim.now);
        rebuild_at_once(&mut sim);
    }
    // Held after the 2nd, 3rd and 4th co-restarts of the streak.
    assert_eq!(delays, vec![20, 25, 25], "base × 2^(n-1), capped at max");
}

/// Issue 22's target: a crash a few seconds after an earlier one, once the group served
/// again, is repaired at once — the backoff does not turn it into a `baseSeconds` outage.
#[test]
fn a_failure_after_the_group_served_again_is_repaired_at_once() {
    let mut s = spec(1);
    s.restart.backoff.base_seconds = 60;
    let mut sim = Sim::new(s);
    sim.settle(20);
    assert_eq!(fail_decode(&mut sim).co_restarts.len(), 1);
    rebuild_at_once(&mut sim);
    sim.advance(3);
    // The prefill this time: another member, another cause, a few seconds later.
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.fail(&p);
    let plan = sim.reconcile();
    assert_eq!(
        plan.co_restarts.len(),
        1,
        "not held by the first one's backoff"
    );
    assert_eq!(sim.group(0).backoff_streak, 2, "the streak still counts it");
}

/// A group that fails again before it is Ready at its new incarnation (a crash loop) is
/// held by the backoff from its second failure.
#[test]
fn a_crash_loop_is_held_by_the_backoff_from_its_second_failure() {
    let mut s = spec(1);
    s.restart.backoff.base_seconds = 10;
    let mut sim = Sim::new(s);
    sim.settle(20);
    assert_eq!(fail_decode(&mut sim).co_restarts.len(), 1);
    // The new prefill starts and fails before the group is Ready again.
    for _ in 0..3 {
        sim.finish_terminations();
        sim.reconcile();
    }
    sim.start_pending();
    sim.reconcile();
    assert_ne!(sim.group(0).phase, GroupPhase::Ready);
    assert!(sim.group(0).ready_since.is_none());
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.fail(&p);
    let plan = sim.reconcile();
    assert!(plan.co_restarts.is_empty(), "held back");
    assert_eq!(sim.group(0).phase, GroupPhase::Broken);
    let wait = plan.requeue_after.expect("requeue at the deadline");
    assert!(
        wait <= Duration::from_secs(10) && wait > Duration::ZERO,
        "{wait:?}"
    );
    sim.advance(wait.as_secs());
    assert_eq!(sim.reconcile().co_restarts.len(), 1);
}

#[test]
fn backoff_delay_formula() {
    assert_eq!(backoff_delay(10, 300, 1), Duration::from_secs(10));
    assert_eq!(backoff_delay(10, 300, 2), Duration::from_secs(20));
    assert_eq!(backoff_delay(10, 300, 6), Duration::from_secs(300));
    assert_eq!(backoff_delay(10, 300, i32::MAX), Duration::from_secs(300));
}

#[test]
fn scale_up_adds_groups_and_scale_down_removes_highest_decode_first() {
    let mut sim = ready_sim(1);
    sim.spec.groups = 3;
    sim.settle(40);
    assert_eq!(sim.status.as_ref().unwrap().ready_groups, 3);
    sim.spec.groups = 1;
    // The removed groups' decodes leave their Services first, and are deleted once that
    // has had time to reach every node.
    let plan = sim.reconcile();
    assert!(Sim::deleted(&plan).is_empty());
    let closed = |plan: &Plan| {
        plan.actions
            .iter()
            .filter(|a| matches!(a, PlannedAction::SetGroupReadyGate { ready: false, .. }))
            .count()
    };
    assert_eq!(closed(&plan), 2);
    assert!(plan.requeue_after.is_some_and(|d| d <= ENDPOINTS_SETTLE));
    sim.advance(ENDPOINTS_SETTLE.as_secs() - 1);
    assert!(Sim::deleted(&sim.reconcile()).is_empty(), "not yet settled");
    sim.advance(1);
    let plan = sim.reconcile();
    let deleted = Sim::deleted(&plan);
    assert_eq!(deleted.len(), 2);
    assert!(
        deleted
            .iter()
            .all(|(n, r)| *r == Role::Decode && !n.contains("-g0-"))
    );
    sim.finish_terminations();
    let plan = sim.reconcile();
    assert!(Sim::deleted(&plan).iter().all(|(_, r)| *r == Role::Prefill));
    sim.finish_terminations();
    let plan = sim.reconcile();
    assert!(
        plan.actions
            .contains(&PlannedAction::DeleteGroupResources { group: 1 })
    );
    assert!(
        plan.actions
            .contains(&PlannedAction::DeleteGroupResources { group: 2 })
    );
    sim.reconcile();
    let st = sim.status.as_ref().unwrap();
    assert_eq!(st.group_statuses.len(), 1);
    assert_eq!(st.groups, 1);
    assert!(sim.pods.values().all(|p| p.group == 0));
}

#[test]
fn policy_none_reports_but_never_deletes() {
    let mut s = spec(2);
    s.restart.policy = RestartPolicy::None;
    let mut sim = Sim::new(s);
    sim.settle(30);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.fail(&d);
    sim.spec.decode.template.image = "tandem:2".into();
    for _ in 0..5 {
        let plan = sim.reconcile();
        assert!(Sim::deleted(&plan).is_empty());
        assert!(plan.co_restarts.is_empty());
    }
    assert_eq!(sim.group(0).phase, GroupPhase::Broken);
    assert!(
        sim.group(0)
            .message
            .as_ref()
            .unwrap()
            .contains("MemberFailed")
    );
    let c = condition_of(&sim, conditions::DEGRADED);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "CoRestartSuppressed")
    );
    // The healthy group keeps serving at its old revision.
    assert_eq!(sim.group(1).phase, GroupPhase::Ready);
}
