//! Reconcile against a recorded mock API server (kube's tower-test pattern): every test
//! writes out the exact request sequence it expects and answers each request.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, StatusCode};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::json;

use super::mock_api::run;
use super::mock_api::*;
use super::*;
use crate::crd::{GroupPhase, PDDeploymentStatus, annotations, conditions};
use crate::planner::Role;

#[tokio::test]
async fn a_new_deployment_gets_its_objects_and_only_the_prefill_pod() {
    let (result, _) = run(pdd(None), |mut api| async move {
        api.reads(&pdd(None), &[], false).await;
        // Planner order: client Service; the group's Service, NetworkPolicy and Secret
        // (the pods need them); then the group's build step: the prefill pod only.
        let svc = api.apply(SERVICES, NAME).await;
        assert_eq!(svc["spec"]["selector"][labels::ROLE], "decode");
        let bootstrap = api.apply(SERVICES, "demo-g0-bootstrap").await;
        assert_eq!(bootstrap["spec"]["clusterIP"], "None");
        assert_eq!(
            bootstrap["spec"]["publishNotReadyAddresses"], true,
            "a prefill that is briefly not ready keeps its DNS name"
        );
        api.apply(POLICIES, "demo-g0-kv").await;
        let secret = api.next(Method::POST, &format!("{SECRETS}?")).await;
        assert_eq!(secret.body["metadata"]["name"], "demo-g0-key");
        let key = secret.body["data"]["key"].as_str().unwrap().to_string();
        assert!(!key.is_empty());
        secret.echo();
        let pod = api.create_pod("demo-g0-i1-p0").await;
        assert_eq!(pod["metadata"]["labels"][labels::ROLE], "prefill");
        assert_eq!(pod["metadata"]["labels"][labels::INCARNATION], "1");
        assert_eq!(pod["spec"]["restartPolicy"], "Never");
        assert_restricted_with_startup_probe(&pod);
        let ev = api.event().await;
        assert_eq!(ev["reason"], "GroupPhaseChanged");
        assert_eq!(ev["type"], "Normal");
        assert!(ev["note"].as_str().unwrap().contains("group 0"));
        let status = api.status().await;
        assert_eq!(status.observed_generation, Some(1));
        let g = &status.group_statuses[0];
        assert_eq!((g.incarnation, g.phase), (1, GroupPhase::StartingPrefill));
        api.done().await;
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(DEFAULT_REQUEUE));
}

#[tokio::test]
async fn services_and_the_policy_are_applied_every_reconcile_with_the_current_spec() {
    // The objects exist (built for the old ports, or edited by someone): they are applied
    // again anyway, which restores them; the Secret is not touched.
    let mut changed = pdd(None);
    changed.spec.transfer.kv_port = 5601;
    let (result, _) = run(changed.clone(), |mut api| async move {
        api.reads(&changed, &[], true).await;
        let svc = api.apply(SERVICES, NAME).await;
        assert_eq!(svc["metadata"]["labels"][labels::PORTS], "8000-5601");
        let bootstrap = api.apply(SERVICES, "demo-g0-bootstrap").await;
        assert_eq!(bootstrap["spec"]["ports"][0]["port"], 5601);
        let policy = api.apply(POLICIES, "demo-g0-kv").await;
        assert_eq!(policy["spec"]["ingress"][0]["ports"][0]["port"], 5601);
        api.create_pod("demo-g0-i1-p0").await;
        api.event().await;
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn a_secret_that_appears_between_list_and_create_is_a_conflict_never_overwritten() {
    let (result, _) = run(pdd(None), |mut api| async move {
        api.reads(&pdd(None), &[], false).await;
        api.objects().await;
        api.next(Method::POST, &format!("{SECRETS}?")).await.reply(
            StatusCode::CONFLICT,
            status_error(409, "AlreadyExists", "exists"),
        );
        // No pod without our key.
        let ev = api.event().await;
        assert_eq!(ev["reason"], "ObjectConflict");
        api.status().await;
        api.done().await;
    })
    .await;
    assert!(matches!(
        result.unwrap_err(),
        Error::Conflict { kind: "secret", .. }
    ));
}

#[tokio::test]
async fn objects_of_another_owner_with_our_names_are_never_taken_over() {
    // A deployment of the same name was deleted a moment ago: its Secret and pod are
    // still there, owned by the old UID. They are not counted as ours, not written, and
    // the conflict is reported; the pod is not created while the Secret is not ours.
    let old_pod = {
        let mut p = member(Role::Prefill, 1, "Running", true, None);
        p.metadata.owner_references.as_mut().unwrap()[0].uid = "uid-old".into();
        p
    };
    let (result, _) = run(pdd(None), |mut api| async move {
        api.reads_with(
            &pdd(None),
            &[old_pod],
            false,
            vec![owned_by("demo-g0-key", Some(0), "uid-old")],
        )
        .await;
        api.objects().await;
        // No POST of the Secret, no pod: a Warning, and the status says why.
        let ev = api.event().await;
        assert_eq!(ev["reason"], "ObjectConflict");
        assert_eq!(ev["type"], "Warning");
        let note = ev["note"].as_str().unwrap();
        assert!(
            note.contains("secret demo-g0-key") && note.contains("uid-old"),
            "{note}"
        );
        let status = api.status().await;
        let d = status
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::DEGRADED)
            .unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "ObjectConflict")
        );
        // The old pod is not ours: the group starts from scratch.
        assert_eq!(status.group_statuses[0].incarnation, 1);
        assert!(status.group_statuses[0].pods.is_empty());
        api.done().await;
    })
    .await;
    let err = result.unwrap_err();
    assert_eq!(err.metric_label(), "object_conflict");
}

#[tokio::test]
async fn a_pod_name_taken_by_another_owner_is_a_conflict_not_an_update() {
    let (result, _) = run(pdd(None), |mut api| async move {
        api.reads(&pdd(None), &[], true).await;
        api.objects().await;
        api.next(Method::POST, &format!("{PODS}?")).await.reply(
            StatusCode::CONFLICT,
            status_error(409, "AlreadyExists", "exists"),
        );
        let ev = api.event().await;
        assert_eq!(ev["reason"], "ObjectConflict");
        api.status().await;
        api.done().await;
    })
    .await;
    assert!(matches!(
        result.unwrap_err(),
        Error::Conflict { kind: "pod", .. }
    ));
}

#[tokio::test]
async fn a_ready_prefill_gets_its_decode() {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let prev = status_after(None, &[]);
    let trigger = pdd(Some(prev.clone()));
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
        api.objects().await;
        let pod = api.create_pod("demo-g0-i1-d0").await;
        assert_eq!(pod["metadata"]["labels"][labels::ROLE], "decode");
        assert_eq!(
            pod["spec"]["readinessGates"],
            json!([{"conditionType": "tandem.dev/group-ready"}])
        );
        let args = pod["spec"]["containers"][0]["args"].as_array().unwrap();
        assert!(
            args.contains(&json!(
                "--prefill=prefill-0.demo-g0-bootstrap.default.svc:5600"
            )),
            "{args:?}"
        );
        assert_restricted_with_startup_probe(&pod);
        let ev = api.event().await;
        assert_eq!(ev["reason"], "GroupPhaseChanged");
        let status = api.status().await;
        assert_eq!(status.group_statuses[0].incarnation, 1);
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn a_prefill_that_is_not_ready_gets_no_decode() {
    let prefill = member(Role::Prefill, 1, "Running", false, None);
    let trigger = pdd(Some(status_after(None, &[])));
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
        api.objects().await;
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn a_failed_decode_co_restarts_the_group_decode_first() {
    // A Ready group at incarnation 1, as the previous reconciles left it.
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let decode_ready = member(Role::Decode, 1, "Running", true, Some(true));
    let s1 = status_after(None, &[]);
    let s2 = status_after(Some(&s1), std::slice::from_ref(&prefill));
    let ready = status_after(Some(&s2), &[prefill.clone(), decode_ready]);
    assert_eq!(ready.group_statuses[0].phase, GroupPhase::Ready);

    // The decode fails: the gate closes, the decode is deleted, the incarnation bumps;
    // the prefill stays until the decode is gone.
    let decode_failed = member(Role::Decode, 1, "Failed", false, Some(true));
    let trigger = pdd(Some(ready.clone()));
    let pods = [prefill.clone(), decode_failed];
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &pods, true).await;
        api.objects().await;
        let ev = api.event().await;
        assert_eq!(ev["reason"], "MemberFailed");
        assert_eq!(ev["type"], "Warning");
        assert_eq!(ev["action"], "CoRestart");
        assert!(ev["note"].as_str().unwrap().contains("group 0"));
        let gate = api
            .next(Method::PATCH, &format!("{PODS}/demo-g0-i1-d0/status{GATE}"))
            .await;
        assert_eq!(
            gate.content_type.as_deref(),
            Some("application/strategic-merge-patch+json")
        );
        let cond = &gate.body["status"]["conditions"][0];
        assert_eq!(cond["type"], "tandem.dev/group-ready");
        assert_eq!(cond["status"], "False");
        let pod =
            serde_json::to_value(member(Role::Decode, 1, "Failed", false, Some(false))).unwrap();
        gate.reply(StatusCode::OK, pod.clone());
        // It has exited: nothing to drain, so the short grace (and an Event saying so).
        let ev = api.event().await;
        assert_eq!(ev["reason"], "UnresponsiveMemberDeleted");
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-d0?"))
            .await;
        assert_eq!(
            del.body["gracePeriodSeconds"],
            crate::crd::DEFAULT_UNRESPONSIVE_GRACE_SECONDS,
            "{}",
            del.body
        );
        del.reply(StatusCode::OK, pod);
        let ev = api.event().await;
        assert_eq!(ev["reason"], "GroupPhaseChanged");
        let status = api.status().await;
        let g = &status.group_statuses[0];
        assert_eq!((g.incarnation, g.phase), (2, GroupPhase::Restarting));
        assert_eq!(g.co_restarts, 1);
        api.done().await;
        tx.send(status).unwrap();
    })
    .await;
    result.unwrap();
    let restarted = rx.await.unwrap();
    assert!(
        metrics
            .encode()
            .contains("tandem_operator_co_restarts_total{reason=\"MemberFailed\"} 1")
    );

    // Next reconcile: the decode is gone, so now the prefill goes; nothing is built yet.
    let trigger = pdd(Some(restarted));
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
        api.objects().await;
        // The ready prefill was the healthy peer: its full grace (the pod's own).
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-p0?"))
            .await;
        assert!(del.body["gracePeriodSeconds"].is_null(), "{}", del.body);
        del.reply(
            StatusCode::OK,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}),
        );
        let status = api.status().await;
        assert_eq!(status.group_statuses[0].incarnation, 2);
        api.done().await;
    })
    .await;
    result.unwrap();
    assert!(
        !metrics.encode().contains("co_restarts_total{"),
        "no second co-restart"
    );
}

#[tokio::test]
async fn a_pod_stuck_terminating_on_a_lost_node_is_force_deleted() {
    // A co-restart is under way (incarnation 2) and the old decode's deletion was never
    // confirmed: its grace period ended long ago.
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let decode_ready = member(Role::Decode, 1, "Running", true, Some(true));
    let s1 = status_after(None, &[]);
    let s2 = status_after(Some(&s1), std::slice::from_ref(&prefill));
    let ready = status_after(Some(&s2), &[prefill.clone(), decode_ready]);
    let mut restarting = ready.clone();
    let g = &mut restarting.group_statuses[0];
    g.incarnation = 2;
    g.phase = GroupPhase::Restarting;
    let mut stuck = member(Role::Decode, 1, "Running", true, Some(false));
    let grace_end = now()
        .checked_sub(planner::FORCE_DELETE_MARGIN + Duration::from_secs(1))
        .unwrap();
    stuck.metadata.deletion_timestamp = Some(Time(grace_end));
    let trigger = pdd(Some(restarting));
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill, stuck], true).await;
        api.objects().await;
        let del = api
            .next(Method::DELETE, &format!("{PODS}/demo-g0-i1-d0?"))
            .await;
        assert_eq!(del.body["gracePeriodSeconds"], 0);
        del.reply(
            StatusCode::OK,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}),
        );
        let ev = api.event().await;
        assert_eq!(ev["reason"], "PodForceDeleted");
        assert_eq!(ev["type"], "Warning");
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
    assert!(
        metrics
            .encode()
            .contains("tandem_operator_force_deleted_pods_total 1")
    );
}

#[tokio::test]
async fn an_api_error_reaches_the_status_and_an_event_once() {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let trigger = pdd(Some(status_after(None, &[])));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let p2 = prefill.clone();
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
        api.objects().await;
        api.next(Method::POST, &format!("{PODS}?")).await.reply(
            StatusCode::FORBIDDEN,
            status_error(403, "Forbidden", "exceeded quota: pods=10"),
        );
        let ev = api.event().await;
        assert_eq!(ev["reason"], "ApplyFailed");
        assert_eq!(ev["type"], "Warning");
        assert!(
            ev["note"].as_str().unwrap().contains("exceeded quota"),
            "{ev}"
        );
        let status = api.status().await;
        let d = status
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::DEGRADED)
            .unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "ApplyFailed")
        );
        assert!(
            d.message
                .contains("creating pod demo-g0-i1-d0: exceeded quota: pods=10 (403 Forbidden)"),
            "{}",
            d.message
        );
        api.done().await;
        tx.send(status).unwrap();
    })
    .await;
    let err = result.unwrap_err();
    assert_eq!(err.metric_label(), "forbidden");
    assert!(
        err.to_string().contains("creating pod demo-g0-i1-d0"),
        "{err}"
    );
    let ctx = context(FakeReady::default()).0;
    let requeue = error_policy(Arc::new(pdd(None)), &err, ctx.clone());
    assert_eq!(requeue, Action::requeue(Duration::from_secs(5)));
    let requeue = error_policy(Arc::new(pdd(None)), &err, ctx.clone());
    assert_eq!(requeue, Action::requeue(Duration::from_secs(10)));
    assert!(
        ctx.metrics
            .encode()
            .contains("tandem_operator_reconcile_errors_total{reason=\"forbidden\"} 2")
    );
    drop(metrics);

    // The same failure again: the status says it still, but no second Event.
    let trigger = pdd(Some(rx.await.unwrap()));
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[p2], true).await;
        api.objects().await;
        api.next(Method::POST, &format!("{PODS}?")).await.reply(
            StatusCode::FORBIDDEN,
            status_error(403, "Forbidden", "exceeded quota: pods=10"),
        );
        let status = api.status().await;
        let d = status
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::DEGRADED)
            .unwrap();
        assert_eq!(d.reason, "ApplyFailed");
        api.done().await;
    })
    .await;
    assert!(result.is_err());
}

#[tokio::test]
async fn an_invalid_restart_annotation_warns_once_and_degrades() {
    let mut trigger = pdd(Some(status_after(None, &[])));
    trigger
        .annotations_mut()
        .insert(annotations::RESTART_REQUESTED_AT.into(), "yesterday".into());
    let prefill = member(Role::Prefill, 1, "Running", false, None);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (t2, p2) = (trigger.clone(), prefill.clone());
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
        api.objects().await;
        let ev = api.event().await;
        assert_eq!(ev["reason"], "InvalidRestartRequest");
        assert_eq!(ev["type"], "Warning");
        let status = api.status().await;
        let degraded = status
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::DEGRADED)
            .unwrap();
        assert_eq!(degraded.status, "True");
        assert_eq!(degraded.reason, "InvalidRestartRequest");
        assert!(degraded.message.contains("yesterday"));
        api.done().await;
        tx.send(status).unwrap();
    })
    .await;
    result.unwrap();
    // Next reconcile, same value: no second Event.
    let mut again = t2;
    again.status = Some(rx.await.unwrap());
    let (result, _) = run(again.clone(), |mut api| async move {
        api.reads(&again, &[p2], true).await;
        api.objects().await;
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn a_name_that_cannot_make_child_names_is_reported_not_retried() {
    let mut bad = pdd(None);
    bad.metadata.name = Some("llama-3.1-8b".into());
    let path = "/apis/tandem.dev/v1alpha1/namespaces/default/pddeployments/llama-3.1-8b";
    let (result, _) = run(bad.clone(), |mut api| async move {
        api.next(Method::GET, path)
            .await
            .reply(StatusCode::OK, serde_json::to_value(&bad).unwrap());
        // No list, no child: a Warning and the status.
        let ev = api.next(Method::POST, &format!("{EVENTS}?")).await;
        assert_eq!(ev.body["reason"], "InvalidName");
        assert_eq!(ev.body["type"], "Warning");
        ev.echo();
        let seen = api
            .next(Method::PATCH, &format!("{path}/status{APPLY}"))
            .await;
        let status: PDDeploymentStatus =
            serde_json::from_value(seen.body["status"].clone()).unwrap();
        let d = status
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::DEGRADED)
            .unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "InvalidName")
        );
        assert!(d.message.contains("DNS-1035"), "{}", d.message);
        let mut obj = serde_json::to_value(&bad).unwrap();
        obj["status"] = seen.body["status"].clone();
        seen.reply(StatusCode::OK, obj);
        api.done().await;
    })
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

#[tokio::test]
async fn args_that_repeat_an_operator_flag_are_reported_not_run() {
    // `--port` in the decode's args: the dataplane would refuse the pod's command line
    // (the flag twice) and the pod would exit at once, group after group.
    let mut bad = pdd(None);
    bad.spec.decode.args = vec!["--port".into(), "9000".into()];
    let (result, _) = run(bad.clone(), |mut api| async move {
        api.next(Method::GET, PDD_PATH)
            .await
            .reply(StatusCode::OK, serde_json::to_value(&bad).unwrap());
        let ev = api.next(Method::POST, &format!("{EVENTS}?")).await;
        assert_eq!(ev.body["reason"], "InvalidArgs");
        assert_eq!(ev.body["action"], "Validate");
        ev.echo();
        let status = api.status().await;
        let d = status
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::DEGRADED)
            .unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "InvalidArgs")
        );
        assert!(
            d.message
                .starts_with("spec.decode.args[0]: --port is set by the operator"),
            "{}",
            d.message
        );
        api.done().await;
    })
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

#[tokio::test]
async fn a_deleted_deployment_is_left_to_the_garbage_collector() {
    let (result, _) = run(pdd(None), |mut api| async move {
        api.next(Method::GET, PDD_PATH).await.reply(
            StatusCode::NOT_FOUND,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                   "reason": "NotFound", "code": 404, "message": "gone"}),
        );
        api.done().await;
    })
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}
