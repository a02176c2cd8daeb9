//! `spec.router`: the router's objects are applied on every reconcile while it is set,
//! deleted once when it is removed, and never touch a group.

use super::sim::Sim;
use super::tests::ready_sim;
use super::*;
use crate::crd::{GroupPhase, RouterSpec};

fn router_actions(plan: &Plan) -> Vec<PlannedAction> {
    plan.actions
        .iter()
        .filter(|a| matches!(a, PlannedAction::ApplyRouter | PlannedAction::DeleteRouter))
        .cloned()
        .collect()
}

#[test]
fn without_spec_router_there_is_no_router_action() {
    let mut sim = ready_sim(2);
    for _ in 0..3 {
        assert!(router_actions(&sim.reconcile()).is_empty());
    }
}

#[test]
fn spec_router_applies_the_router_every_reconcile_right_after_the_client_service() {
    let mut spec = crate::testutil::spec(2);
    spec.router = Some(RouterSpec::default());
    let mut sim = Sim::new(spec);
    let first = sim.reconcile();
    assert_eq!(
        &first.actions[..2],
        &[
            PlannedAction::ApplyClientService,
            PlannedAction::ApplyRouter
        ]
    );
    sim.settle(50);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
    assert_eq!(sim.group(1).phase, GroupPhase::Ready);
    assert_eq!(
        router_actions(&sim.reconcile()),
        vec![PlannedAction::ApplyRouter]
    );
}

#[test]
fn removing_spec_router_deletes_it_once_and_leaves_the_groups_alone() {
    let mut sim = ready_sim(2);
    sim.spec.router = Some(RouterSpec {
        replicas: 2,
        ..RouterSpec::default()
    });
    let before = (sim.group(0).incarnation, sim.group(1).incarnation);
    let plan = sim.reconcile();
    assert_eq!(router_actions(&plan), vec![PlannedAction::ApplyRouter]);
    // Not part of the revision: nothing is rolled, created or deleted.
    assert!(Sim::created(&plan).is_empty() && Sim::deleted(&plan).is_empty());

    sim.spec.router = None;
    let plan = sim.reconcile();
    assert_eq!(router_actions(&plan), vec![PlannedAction::DeleteRouter]);
    assert!(Sim::created(&plan).is_empty() && Sim::deleted(&plan).is_empty());
    assert!(router_actions(&sim.reconcile()).is_empty());
    assert_eq!((sim.group(0).incarnation, sim.group(1).incarnation), before);
    assert_eq!(sim.group(0).phase, GroupPhase::Ready);
}

#[test]
fn the_router_is_not_part_of_the_revision() {
    let plain = crate::testutil::spec(1);
    let mut routed = plain.clone();
    routed.router = Some(RouterSpec::default());
    assert_eq!(
        RevisionedSpec::from_spec(&plain).revision(),
        RevisionedSpec::from_spec(&routed).revision()
    );
}
