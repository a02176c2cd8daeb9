//! The grace of the pod deletes on the API server: a hung or failed member's delete
//! carries `gracePeriodSeconds` = `health.unresponsiveGraceSeconds`; a healthy member's,
//! and every planned removal's, names no grace (the pod's own applies).

use http::{Method, StatusCode};
use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::json;

use super::mock_api::run;
use super::mock_api::*;
use super::observe::observe_pod;
use crate::crd::{CoRestartReason, CoRestartRecord, GroupPhase, PDDeploymentStatus};
use crate::planner::Role;

/// A Ready group at incarnation 1 whose co-restart to incarnation 2 (for `reason`) is
/// under way, as an earlier reconcile left it.
fn restarting(reason: CoRestartReason) -> PDDeploymentStatus {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let decode = member(Role::Decode, 1, "Running", true, Some(true));
    let s1 = status_after(None, &[]);
    let s2 = status_after(Some(&s1), std::slice::from_ref(&prefill));
    let mut st = status_after(Some(&s2), &[prefill, decode]);
    let g = &mut st.group_statuses[0];
    assert_eq!(g.phase, GroupPhase::Ready);
    g.incarnation = 2;
    g.phase = GroupPhase::Restarting;
    g.last_co_restart = Some(CoRestartRecord {
        time: Time(now()),
        reason,
        in_place: false,
    });
    st
}

/// `pod` with `Ready` False for `ReadinessGatesNotReady`: a decode whose gate is closed.
fn gated(mut pod: Pod) -> Pod {
    pod.status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()
        .push(PodCondition {
            type_: "Ready".into(),
            status: "False".into(),
            reason: Some("ReadinessGatesNotReady".into()),
            ..Default::default()
        });
    pod
}

fn gone() -> serde_json::Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200})
}

/// A pod whose node stopped reporting: the node lifecycle controller turned `Ready`
/// False (keeping the empty reason), the kubelet's `ContainersReady` is still True.
fn on_a_lost_node(mut pod: Pod) -> Pod {
    let conds = pod.status.as_mut().unwrap().conditions.as_mut().unwrap();
    conds.push(PodCondition {
        type_: "Ready".into(),
        status: "False".into(),
        last_transition_time: Some(Time(now())),
        ..Default::default()
    });
    pod
}

#[tokio::test]
async fn a_hung_prefill_is_deleted_with_the_short_grace_and_an_event() {
    // The decode is gone; the prefill is running and not ready (stopped, wedged).
    let hung = member(Role::Prefill, 1, "Running", false, None);
    let trigger = pdd(Some(restarting(CoRestartReason::MemberNotReady)));
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[hung], true).await;
        api.objects().await;
        let ev = api.event().await;
        assert_eq!(ev["reason"], "UnresponsiveMemberDeleted");
        assert_eq!(ev["type"], "Warning");
        assert_eq!(ev["action"], "Delete");
        let note = ev["note"].as_str().unwrap();
        assert!(
            note.contains("demo-g0-i1-p0")
                && note.contains(&format!(
                    "grace {}s",
                    crate::crd::DEFAULT_UNRESPONSIVE_GRACE_SECONDS
                )),
            "{note}"
        );
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-p0?"))
            .await;
        assert_eq!(
            del.body["gracePeriodSeconds"],
            crate::crd::DEFAULT_UNRESPONSIVE_GRACE_SECONDS,
            "{}",
            del.body
        );
        del.reply(StatusCode::OK, gone());
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
    let text = metrics.encode();
    assert!(
        text.contains(
            "tandem_operator_member_deletes_total{reason=\"MemberNotReady\",grace=\"short\",cause=\"not_ready\"} 1"
        ),
        "{text}"
    );
}

#[tokio::test]
async fn the_short_grace_is_the_specs() {
    let hung = member(Role::Prefill, 1, "Running", false, None);
    let mut trigger = pdd(Some(restarting(CoRestartReason::MemberNotReady)));
    trigger.spec.health.unresponsive_grace_seconds = 7;
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[hung], true).await;
        api.objects().await;
        api.event().await;
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-p0?"))
            .await;
        assert_eq!(del.body["gracePeriodSeconds"], 7, "{}", del.body);
        del.reply(StatusCode::OK, gone());
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn the_healthy_peer_of_a_hung_prefill_keeps_its_full_grace() {
    // The prefill hangs; the decode is not ready only because its channel to the prefill
    // is down. The decode goes first, with no grace named (the pod's own).
    let hung = member(Role::Prefill, 1, "Running", false, None);
    let decode = member(Role::Decode, 1, "Running", false, Some(false));
    let trigger = pdd(Some(restarting(CoRestartReason::MemberNotReady)));
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[hung, decode], true).await;
        api.objects().await;
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-d0?"))
            .await;
        assert!(
            del.body
                .get("gracePeriodSeconds")
                .is_none_or(|g| g.is_null()),
            "{}",
            del.body
        );
        del.reply(StatusCode::OK, gone());
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
    assert!(metrics.encode().contains(
        "tandem_operator_member_deletes_total{reason=\"MemberNotReady\",grace=\"full\",cause=\"none\"} 1"
    ));
}

#[tokio::test]
async fn a_member_on_a_lost_node_is_deleted_with_the_short_grace() {
    let lost = on_a_lost_node(member(Role::Prefill, 1, "Running", true, None));
    let seen = observe_pod(&lost).unwrap();
    assert!(seen.node_lost && !seen.ready, "{seen:?}");
    let trigger = pdd(Some(restarting(CoRestartReason::MemberNotReady)));
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[lost], true).await;
        api.objects().await;
        let ev = api.event().await;
        assert!(
            ev["note"]
                .as_str()
                .unwrap()
                .contains("node stopped reporting"),
            "{ev}"
        );
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-p0?"))
            .await;
        assert_eq!(
            del.body["gracePeriodSeconds"],
            crate::crd::DEFAULT_UNRESPONSIVE_GRACE_SECONDS,
            "{}",
            del.body
        );
        del.reply(StatusCode::OK, gone());
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
    assert!(metrics.encode().contains("cause=\"node_lost\"} 1"));
}

/// A decode on a lost node whose gate the operator has closed: its `Ready` reads False for
/// `ReadinessGatesNotReady`, as on a live node, so the pod alone does not tell; its node's
/// `Ready` (Unknown) does, and the decode gets the short grace (the e2e suite's s06 saw it
/// deleted with its full grace and force-deleted 40 s later before this).
#[tokio::test]
async fn a_gated_decode_on_a_node_that_stopped_reporting_gets_the_short_grace() {
    let mut decode = gated(member(Role::Decode, 1, "Running", true, Some(false)));
    decode.spec.as_mut().unwrap().node_name = Some("n1".into());
    let seen = observe_pod(&decode).unwrap();
    assert!(
        !seen.node_lost && seen.ready,
        "the pod alone reads as healthy"
    );
    let trigger = pdd(Some(restarting(CoRestartReason::MemberNotReady)));
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads_all(&trigger, &[decode], &[("n1", "Unknown")], true, vec![])
            .await;
        api.objects().await;
        let ev = api.event().await;
        assert!(
            ev["note"]
                .as_str()
                .unwrap()
                .contains("node stopped reporting"),
            "{ev}"
        );
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-d0?"))
            .await;
        assert_eq!(
            del.body["gracePeriodSeconds"],
            crate::crd::DEFAULT_UNRESPONSIVE_GRACE_SECONDS,
            "{}",
            del.body
        );
        del.reply(StatusCode::OK, gone());
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
    assert!(metrics.encode().contains("cause=\"node_lost\"} 1"));
}

#[tokio::test]
async fn a_rollout_deletes_even_a_not_ready_member_with_its_full_grace() {
    let not_ready = member(Role::Prefill, 1, "Running", false, None);
    let trigger = pdd(Some(restarting(CoRestartReason::RevisionChanged)));
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[not_ready], true).await;
        api.objects().await;
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-p0?"))
            .await;
        assert!(
            del.body
                .get("gracePeriodSeconds")
                .is_none_or(|g| g.is_null()),
            "{}",
            del.body
        );
        del.reply(StatusCode::OK, gone());
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[test]
fn only_the_node_controller_s_mark_reads_as_a_lost_node() {
    // The kubelet's own not-ready (both conditions False) is not a lost node.
    let mut kubelet = member(Role::Prefill, 1, "Running", false, None);
    kubelet
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()
        .push(PodCondition {
            type_: "Ready".into(),
            status: "False".into(),
            reason: Some("ContainersNotReady".into()),
            ..Default::default()
        });
    assert!(!observe_pod(&kubelet).unwrap().node_lost);
    // A closed readiness gate on a healthy decode is not one either.
    let gated = gated(member(Role::Decode, 1, "Running", true, Some(false)));
    let seen = observe_pod(&gated).unwrap();
    assert!(!seen.node_lost && seen.ready);
    let healthy = member(Role::Prefill, 1, "Running", true, None);
    assert!(!observe_pod(&healthy).unwrap().node_lost);
}
