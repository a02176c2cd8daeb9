//! The grace of every delete (`group::removal_grace`): a failure co-restart removes the
//! member that caused it — exited, not ready by its own fault, or on a lost node — with
//! `health.unresponsiveGraceSeconds`; its healthy peer, and every member removed by a
//! rollout, a restart request or a scale-down, keep the full grace. The force-delete of a
//! pod that never finishes terminating follows the grace it was deleted with.

use std::time::Duration;

use super::sim::{POD_GRACE_SECONDS, Sim};
use super::tests::{only_pod, ready_sim};
use super::*;
use crate::crd::{CoRestartReason as R, DEFAULT_UNRESPONSIVE_GRACE_SECONDS, GroupPhase};
use crate::testutil::spec;

const SHORT: i32 = DEFAULT_UNRESPONSIVE_GRACE_SECONDS;

/// The pods a plan deletes, with their grace.
fn graces(plan: &Plan) -> Vec<(String, Grace)> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            PlannedAction::DeletePod { name, grace, .. } => Some((name.clone(), *grace)),
            _ => None,
        })
        .collect()
}

fn short(cause: UnresponsiveCause) -> Grace {
    Grace::Unresponsive {
        seconds: SHORT,
        cause,
    }
}

/// Reconcile (terminations finishing in between) until a plan deletes something.
fn next_deletes(sim: &mut Sim) -> Vec<(String, Grace)> {
    for _ in 0..10 {
        let plan = sim.reconcile();
        let d = graces(&plan);
        if !d.is_empty() {
            return d;
        }
        sim.finish_terminations();
        sim.advance(plan.requeue_after.map_or(1, |d| d.as_secs().max(1)));
    }
    panic!("nothing deleted in 10 reconciles: {:#?}", sim.pods);
}

/// SIGSTOP of the prefill: it stops answering its probes, and the decode's channel to it
/// fails too. The prefill is the cause; the decode is its healthy peer.
#[test]
fn a_hung_prefill_gets_the_short_grace_and_its_decode_the_full_one() {
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.set_ready(&p, false);
    sim.report(&d, "peer_unreachable", "no PONG from prefill-0 for 6s");
    sim.reconcile();
    sim.advance(31);
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberNotReady)]);
    assert_eq!(graces(&plan), vec![(d.clone(), Grace::Full)]);
    assert!(
        !sim.events(&plan)
            .iter()
            .any(|e| e.reason == EventReason::UnresponsiveMemberDeleted),
        "no short-grace Event for the healthy peer"
    );
    sim.finish_terminations();
    let plan = sim.reconcile();
    assert_eq!(
        graces(&plan),
        vec![(p.clone(), short(UnresponsiveCause::NotReady))]
    );
    let ev = sim
        .events(&plan)
        .into_iter()
        .find(|e| e.reason == EventReason::UnresponsiveMemberDeleted)
        .expect("an Event says why the grace is short");
    assert_eq!(ev.type_, EventKind::Warning);
    assert!(
        ev.message.contains(&p)
            && ev.message.contains("incarnation 1")
            && ev.message.contains(&format!("grace {SHORT}s"))
            && ev.message.contains("MemberNotReady"),
        "{}",
        ev.message
    );
}

/// SIGSTOP of the decode: its prefill stays ready, so the decode's not being ready is its
/// own fault; the prefill drains with its full grace.
#[test]
fn a_hung_decode_gets_the_short_grace_and_its_ready_prefill_the_full_one() {
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.set_ready(&d, false);
    sim.reconcile();
    sim.advance(31);
    assert_eq!(
        next_deletes(&mut sim),
        vec![(d, short(UnresponsiveCause::NotReady))]
    );
    sim.finish_terminations();
    assert_eq!(next_deletes(&mut sim), vec![(p, Grace::Full)]);
}

#[test]
fn an_exited_member_gets_the_short_grace_and_the_live_one_the_full_one() {
    for failed in [Role::Prefill, Role::Decode] {
        let mut sim = ready_sim(1);
        let p = only_pod(&sim, 0, Role::Prefill);
        let d = only_pod(&sim, 0, Role::Decode);
        let (dead, live) = if failed == Role::Prefill {
            (p.clone(), d.clone())
        } else {
            (d.clone(), p.clone())
        };
        sim.fail(&dead);
        if failed == Role::Prefill {
            // Its channel is gone with it.
            sim.report(&d, "peer_unreachable", "connection refused");
        }
        let plan = sim.reconcile();
        assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberFailed)]);
        let mut deletes = graces(&plan);
        sim.finish_terminations();
        deletes.extend(next_deletes(&mut sim));
        deletes.sort_by(|a, b| a.0.cmp(&b.0));
        let mut want = vec![
            (dead.clone(), short(UnresponsiveCause::Exited)),
            (live.clone(), Grace::Full),
        ];
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(deletes, want, "{failed:?} failed");
    }
}

/// A two-prefill group: when one prefill hangs, the decode (not ready through it) keeps
/// its full grace, and so does the other prefill, which is ready.
#[test]
fn only_the_hung_prefill_of_two_is_short() {
    let mut s = spec(1);
    s.prefill.replicas = 2;
    let mut sim = Sim::new(s);
    sim.settle(50);
    let prefills: Vec<String> = sim
        .pods_of(0, Role::Prefill)
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let d = only_pod(&sim, 0, Role::Decode);
    sim.set_ready(&prefills[0], false);
    sim.report(&d, "peer_unreachable", "no PONG from prefill-0");
    sim.reconcile();
    sim.advance(31);
    assert_eq!(next_deletes(&mut sim), vec![(d, Grace::Full)]);
    sim.finish_terminations();
    let mut deletes = next_deletes(&mut sim);
    deletes.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        deletes,
        vec![
            (prefills[0].clone(), short(UnresponsiveCause::NotReady)),
            (prefills[1].clone(), Grace::Full),
        ]
    );
}

#[test]
fn the_short_grace_is_the_specs() {
    let mut s = spec(1);
    s.health.unresponsive_grace_seconds = 7;
    let mut sim = Sim::new(s);
    sim.settle(50);
    let p = only_pod(&sim, 0, Role::Prefill);
    sim.fail(&p);
    let deletes = next_deletes(&mut sim);
    sim.finish_terminations();
    let mut all = deletes;
    all.extend(next_deletes(&mut sim));
    assert!(
        all.contains(&(
            p,
            Grace::Unresponsive {
                seconds: 7,
                cause: UnresponsiveCause::Exited
            }
        )),
        "{all:?}"
    );
}

/// A rollout, a restart request and a scale-down take healthy groups down: full grace,
/// even for a member that happens to be not ready (or exited) when its turn comes.
#[test]
fn planned_removals_keep_the_full_grace() {
    // Rollout: the prefill goes not ready while the decode leaves the Services.
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.spec.decode.template.image = "tandem:2".into();
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(0, R::RevisionChanged)]
    );
    sim.set_ready(&p, false);
    sim.advance(ENDPOINTS_SETTLE.as_secs());
    assert_eq!(next_deletes(&mut sim), vec![(d, Grace::Full)]);
    sim.finish_terminations();
    assert_eq!(next_deletes(&mut sim), vec![(p, Grace::Full)]);

    // Restart request.
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.advance(1);
    sim.restart_requested_at = Some(sim.now);
    let plan = sim.reconcile();
    assert_eq!(
        Sim::co_restart_reasons(&plan),
        vec![(0, R::RestartRequested)]
    );
    sim.fail(&d);
    sim.advance(ENDPOINTS_SETTLE.as_secs());
    assert_eq!(next_deletes(&mut sim), vec![(d, Grace::Full)]);

    // Scale-down of a group whose decode has exited.
    let mut sim = ready_sim(2);
    let d1 = only_pod(&sim, 1, Role::Decode);
    sim.fail(&d1);
    sim.spec.groups = 1;
    let deletes = next_deletes(&mut sim);
    assert!(
        deletes.iter().all(|(_, g)| *g == Grace::Full) && !deletes.is_empty(),
        "{deletes:?}"
    );
}

/// A lost node: its pods are deleted with the short grace, decode and prefill without
/// waiting for each other, and force-deleted as soon as that grace ends (no margin: no
/// kubelet will confirm), not after the pod's 30 s + margin.
#[test]
fn on_a_lost_node_the_force_delete_follows_the_short_grace() {
    let mut sim = ready_sim(1);
    let p = only_pod(&sim, 0, Role::Prefill);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.lose_node_of(&p);
    sim.lose_node_of(&d);
    sim.reconcile();
    sim.advance(31);
    let plan = sim.reconcile();
    assert_eq!(
        graces(&plan),
        vec![(d.clone(), short(UnresponsiveCause::NodeLost))]
    );
    let deleted_at = sim.now;
    let deadline = sim.pods[&d].deletion_deadline.expect("terminating");
    assert_eq!(
        deadline.duration_since(deleted_at).as_secs(),
        i64::from(SHORT),
        "deletionTimestamp is the delete's grace ahead"
    );
    // Its kubelet is gone: it never finishes terminating, and it holds nothing: the
    // prefill goes in the next plan (short too), and each is forced as soon as its grace
    // ends (no margin on a lost node: no kubelet will confirm).
    let plan = sim.reconcile();
    assert_eq!(
        graces(&plan),
        vec![(p.clone(), short(UnresponsiveCause::NodeLost))]
    );
    let mut forced = std::collections::BTreeMap::new();
    for _ in 0..60 {
        sim.finish_terminations();
        let plan = sim.reconcile();
        for a in &plan.actions {
            if let PlannedAction::ForceDeletePod { name, .. } = a {
                forced.insert(name.clone(), sim.now.duration_since(deleted_at).as_secs());
            }
        }
        if forced.len() == 2 {
            break;
        }
        sim.advance(1);
    }
    assert_eq!(forced.get(&d), Some(&i64::from(SHORT)), "{forced:?}");
    assert_eq!(forced.get(&p), Some(&i64::from(SHORT)), "{forced:?}");
    sim.settle(30);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    assert_eq!(sim.group(0).incarnation, 2);
}

/// A pod deleted by someone else (an eviction) has the grace that delete gave it: the
/// force-delete waits for that one (30 s + margin), not for the short grace.
#[test]
fn an_evicted_pod_is_forced_after_its_own_grace() {
    let mut sim = ready_sim(1);
    let d = only_pod(&sim, 0, Role::Decode);
    sim.evict(&d);
    let evicted_at = sim.now;
    let plan = sim.reconcile();
    assert_eq!(Sim::co_restart_reasons(&plan), vec![(0, R::MemberDeleted)]);
    let limit = POD_GRACE_SECONDS + FORCE_DELETE_MARGIN.as_secs() as i64;
    sim.advance(limit as u64 - 1);
    let plan = sim.reconcile();
    assert!(
        !plan
            .actions
            .iter()
            .any(|a| matches!(a, PlannedAction::ForceDeletePod { .. })),
        "forced before its own grace and the margin"
    );
    assert_eq!(plan.requeue_after, Some(Duration::from_secs(1)));
    sim.advance(1);
    assert_eq!(sim.now.duration_since(evicted_at).as_secs(), limit);
    let plan = sim.reconcile();
    assert!(
        plan.actions
            .iter()
            .any(|a| matches!(a, PlannedAction::ForceDeletePod { name, .. } if *name == d))
    );
}
