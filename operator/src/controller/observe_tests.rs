//! Reading the cluster into the planner's view: pods, their readiness and gates, why they
//! do not run, and what a not-ready decode says about itself.

//! Reconcile against a recorded mock API server (kube's tower-test pattern): every test
//! writes out the exact request sequence it expects and answers each request.

use std::time::Duration;

use http::StatusCode;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, Pod,
    PodCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::SignedDuration;
use kube::Resource;
use serde_json::{Value, json};

use super::mock_api::*;
use super::*;
use crate::crd::{GroupPhase, PDDeploymentStatus, annotations, conditions};
use crate::planner::{PodPhase, Role};

/// A decode pod whose container has started (the startup probe passed) and is not
/// ready, at `ip`.
fn started_decode(ip: &str) -> Pod {
    let mut pod = member(Role::Decode, 1, "Running", false, Some(false));
    let status = pod.status.as_mut().unwrap();
    status.pod_ip = Some(ip.into());
    status.container_statuses = Some(vec![ContainerStatus {
        name: resources::CONTAINER.into(),
        started: Some(true),
        ready: false,
        ..Default::default()
    }]);
    pod
}

/// A format-1 `/ready` body as a decode whose handshake was refused sends it.
fn auth_failed_body() -> Value {
    let message = "handshake prefill-0.demo-g0-bootstrap.default.svc:5600: no authenticated session: we refused the prefill: WELCOME MAC does not verify with the group key (auth_failed)";
    json!({"format": 1, "ready": false, "role": "decode", "reason": "auth_failed",
           "message": message,
           "checks": [
               {"name": "engine_heartbeat", "ok": true, "reason": null, "detail": "engine loop last went round 3 ms ago (limit 10000 ms)"},
               {"name": "handshake prefill-0.demo-g0-bootstrap.default.svc:5600", "ok": false,
                "reason": "auth_failed", "detail": "no authenticated session: ..."}],
           "peers": []})
}

/// The status of a group whose prefill is Ready and whose decode was just created.
fn decode_created() -> PDDeploymentStatus {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    status_after(Some(&status_after(None, &[])), &[prefill])
}

#[tokio::test]
async fn a_not_ready_decode_says_why_in_the_group_status_and_the_condition() {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let decode = started_decode("10.1.2.3");
    let trigger = pdd(Some(decode_created()));
    let ready = FakeReady::default().answer(
        "10.1.2.3:8000",
        StatusCode::SERVICE_UNAVAILABLE,
        auth_failed_body(),
    );
    let asked = ready.clone();
    let (result, metrics) = run_with(trigger.clone(), ready, |mut api| async move {
        api.reads(&trigger, &[prefill, decode], true).await;
        api.objects().await;
        let status = api.status().await;
        let g = &status.group_statuses[0];
        assert_eq!(g.phase, GroupPhase::StartingDecode);
        let d = g.decode_not_ready.as_ref().expect("the decode's reason");
        assert_eq!(d.pod, "demo-g0-i1-d0");
        assert_eq!(d.reason, "auth_failed");
        let said = auth_failed_body()["message"].as_str().unwrap().to_string();
        assert_eq!(d.message, said);
        assert_eq!(
            g.message.as_deref(),
            Some(format!("decode pod demo-g0-i1-d0: auth_failed: {said}").as_str())
        );
        let c = status
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::BOOTSTRAP_HEALTHY)
            .unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "auth_failed"));
        assert_eq!(
            c.message,
            format!(
                "KV channel not healthy in groups 0; group 0 decode pod demo-g0-i1-d0: auth_failed: {said}"
            )
        );
        api.done().await;
    })
    .await;
    // Asked again soon: the reason may change without the pod's readiness changing.
    assert_eq!(
        result.unwrap(),
        Action::requeue(planner::READY_DETAIL_REFRESH)
    );
    // Only the decode was asked, at its pod IP and `http` container port.
    assert_eq!(asked.asked(), ["10.1.2.3:8000".parse().unwrap()]);
    assert!(
        metrics
            .encode()
            .contains("tandem_operator_decode_ready_reads_total{result=\"not_ready\"} 1")
    );
}

#[tokio::test]
async fn a_decode_that_cannot_be_read_is_a_reason_not_a_failed_reconcile() {
    let format_2 = json!({"format": 2, "ready": false, "reason": "auth_failed"});
    for (ready, reason, says) in [
        (
            FakeReady::default(),
            "probe_unreachable",
            "connect 10.1.2.3:8000: Connection refused (os error 111)",
        ),
        (
            FakeReady::default().answer("10.1.2.3:8000", StatusCode::SERVICE_UNAVAILABLE, format_2),
            "probe_unknown_format",
            "/ready body has format 2; this operator reads format 1 (answered 503 Service Unavailable)",
        ),
    ] {
        let prefill = member(Role::Prefill, 1, "Running", true, None);
        let decode = started_decode("10.1.2.3");
        let trigger = pdd(Some(decode_created()));
        let (result, metrics) = run_with(trigger.clone(), ready, |mut api| async move {
            api.reads(&trigger, &[prefill, decode], true).await;
            api.objects().await;
            let status = api.status().await;
            let d = status.group_statuses[0].decode_not_ready.clone().unwrap();
            assert_eq!((d.reason.as_str(), d.message.as_str()), (reason, says));
            let c = status
                .conditions
                .iter()
                .find(|c| c.type_ == conditions::BOOTSTRAP_HEALTHY)
                .unwrap();
            assert_eq!(c.reason, reason);
            api.done().await;
        })
        .await;
        result.unwrap();
        let text = metrics.encode();
        let line = format!("tandem_operator_decode_ready_reads_total{{result=\"{reason}\"}} 1");
        assert!(text.contains(&line), "{line} in\n{text}");
        assert!(
            !text.contains("tandem_operator_reconcile_errors_total{"),
            "{text}"
        );
    }
}

#[test]
fn only_started_running_not_ready_decode_pods_are_asked_why() {
    let target = |pod: &Pod| ready_target(pod, &observe_pod(pod).unwrap());
    assert_eq!(
        target(&started_decode("10.1.2.3")),
        Some("10.1.2.3:8000".parse().unwrap())
    );
    assert_eq!(
        target(&started_decode("fd00::5")),
        Some("[fd00::5]:8000".parse().unwrap())
    );
    // The container's `http` port, not a fixed one.
    let mut other_port = started_decode("10.1.2.3");
    other_port.spec.as_mut().unwrap().containers[0]
        .ports
        .as_mut()
        .unwrap()[0]
        .container_port = 9000;
    assert_eq!(target(&other_port), Some("10.1.2.3:9000".parse().unwrap()));

    // Still loading the model (startup probe not passed): its port is closed.
    let mut loading = started_decode("10.1.2.3");
    loading
        .status
        .as_mut()
        .unwrap()
        .container_statuses
        .as_mut()
        .unwrap()[0]
        .started = Some(false);
    assert_eq!(target(&loading), None);
    // No IP yet, being deleted, ready, or a prefill: not asked.
    let mut no_ip = started_decode("10.1.2.3");
    no_ip.status.as_mut().unwrap().pod_ip = None;
    assert_eq!(target(&no_ip), None);
    let mut deleting = started_decode("10.1.2.3");
    deleting.metadata.deletion_timestamp = Some(Time(now()));
    assert_eq!(target(&deleting), None);
    let mut ready = started_decode("10.1.2.3");
    for c in ready.status.as_mut().unwrap().conditions.as_mut().unwrap() {
        c.status = "True".into();
    }
    assert_eq!(target(&ready), None);
    let mut prefill = member(Role::Prefill, 1, "Running", false, None);
    prefill.status.as_mut().unwrap().pod_ip = Some("10.1.2.4".into());
    prefill.status.as_mut().unwrap().container_statuses = started_decode("10.1.2.3")
        .status
        .unwrap()
        .container_statuses;
    assert_eq!(target(&prefill), None);
}

#[test]
fn pods_with_bad_labels_are_rejected_with_a_reason() {
    let mut pod = member(Role::Prefill, 1, "Running", true, None);
    pod.meta_mut()
        .labels
        .as_mut()
        .unwrap()
        .insert(labels::GROUP.into(), "x".into());
    assert!(observe_pod(&pod).unwrap_err().contains("tandem.dev/group"));
    let mut pod = member(Role::Prefill, 1, "Running", true, None);
    pod.meta_mut()
        .labels
        .as_mut()
        .unwrap()
        .insert(labels::ROLE.into(), "both".into());
    assert!(observe_pod(&pod).unwrap_err().contains("tandem.dev/role"));
}

#[test]
fn pod_observation_reads_phase_readiness_and_gate() {
    let mut pod = member(Role::Decode, 3, "Running", false, Some(true));
    pod.metadata.deletion_timestamp = Some(Time(now()));
    let o = observe_pod(&pod).unwrap();
    assert_eq!((o.group, o.role, o.incarnation), (0, Role::Decode, 3));
    assert_eq!(o.phase, PodPhase::Running);
    assert!(!o.ready);
    assert_eq!(o.not_ready_since, Some(now()));
    assert!(o.group_ready_gate);
    assert!(o.terminating);
    let ready = observe_pod(&member(Role::Prefill, 1, "Running", true, None)).unwrap();
    assert!(ready.ready && !ready.group_ready_gate);
    assert_eq!(ready.not_ready_since, None);
}

#[test]
fn a_pod_on_a_lost_node_is_not_ready_though_its_containers_were() {
    // The node lifecycle controller turns only `Ready` False (keeping its old, empty
    // reason); `ContainersReady` stays True because nobody updates it any more.
    let mut pod = member(Role::Prefill, 1, "Running", true, None);
    let later = now().checked_add(SignedDuration::from_secs(40)).unwrap();
    pod.status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()
        .push(PodCondition {
            type_: "Ready".into(),
            status: "False".into(),
            last_transition_time: Some(Time(later)),
            ..Default::default()
        });
    let o = observe_pod(&pod).unwrap();
    assert!(!o.ready);
    assert_eq!(o.not_ready_since, Some(later));

    // A decode held only by its readiness gate (the kubelet's own reason) is ready: the
    // gate is the operator's to open.
    let mut pod = member(Role::Decode, 1, "Running", true, Some(false));
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
    assert!(observe_pod(&pod).unwrap().ready);
}

#[test]
fn why_a_pod_does_not_run_is_read_from_the_scheduler_and_the_kubelet() {
    let mut pod = member(Role::Prefill, 1, "Pending", false, None);
    pod.status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()
        .push(PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some("0/2 nodes are available: 2 Insufficient cpu.".into()),
            ..Default::default()
        });
    assert_eq!(
        observe_pod(&pod).unwrap().waiting.as_deref(),
        Some("Unschedulable: 0/2 nodes are available: 2 Insufficient cpu.")
    );
    let waiting = |reason: &str| {
        let mut pod = member(Role::Decode, 1, "Pending", false, None);
        pod.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            name: "dataplane".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.into()),
                    message: Some("details".into()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]);
        observe_pod(&pod).unwrap().waiting
    };
    assert_eq!(
        waiting("ImagePullBackOff").as_deref(),
        Some("ImagePullBackOff: details")
    );
    assert_eq!(
        waiting("ContainerCreating"),
        None,
        "the normal wait says nothing"
    );
}

#[test]
fn restart_annotation_parsing() {
    let mut p = pdd(None);
    assert_eq!(restart_requested_at(&p), Ok(None));
    p.annotations_mut().insert(
        annotations::RESTART_REQUESTED_AT.into(),
        "2025-06-15T10:00:00Z".into(),
    );
    assert_eq!(
        restart_requested_at(&p),
        Ok(Some("2025-06-15T10:00:00Z".parse().unwrap()))
    );
    p.annotations_mut()
        .insert(annotations::RESTART_REQUESTED_AT.into(), "soon".into());
    assert!(restart_requested_at(&p).is_err());
}

#[test]
fn error_backoff_doubles_and_caps() {
    assert_eq!(backoff(1), Duration::from_secs(5));
    assert_eq!(backoff(2), Duration::from_secs(10));
    assert_eq!(backoff(7), Duration::from_secs(300));
    assert_eq!(backoff(u32::MAX), Duration::from_secs(300));
}

#[test]
fn an_ended_container_tells_how_it_ended() {
    let ended = |reason: Option<&str>, code: i32| {
        let mut pod = member(Role::Decode, 1, "Failed", false, None);
        pod.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            name: "dataplane".into(),
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    reason: reason.map(Into::into),
                    exit_code: code,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]);
        observe_pod(&pod).unwrap().exit
    };
    assert_eq!(
        ended(Some("OOMKilled"), 137).as_deref(),
        Some("OOMKilled, exit code 137")
    );
    assert_eq!(ended(None, 1).as_deref(), Some("exit code 1"));
    let running = member(Role::Decode, 1, "Running", true, None);
    assert_eq!(observe_pod(&running).unwrap().exit, None);
}
