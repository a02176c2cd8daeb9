//! The in-place reset on the API server: the group key read from its Secret to sign the
//! call, the call to the pod's IP, and the pod's incarnation label and annotation moved on
//! once the member says it is ready there — and nothing written when it does not.

use http::{Method, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::mock_api::*;
use crate::crd::{CoRestartReason, CoRestartRecord, GroupPhase, InPlaceReset, PDDeploymentStatus};
use crate::planner::Role;
use crate::reset_call::ResetReply;

/// A Ready group at incarnation 1 whose in-place reset to 2 an earlier reconcile began.
fn resetting() -> PDDeploymentStatus {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let decode = member(Role::Decode, 1, "Running", true, Some(true));
    let s1 = status_after(None, &[]);
    let s2 = status_after(Some(&s1), std::slice::from_ref(&prefill));
    let mut st = status_after(Some(&s2), &[prefill, decode]);
    let g = &mut st.group_statuses[0];
    assert_eq!(g.phase, GroupPhase::Ready);
    g.incarnation = 2;
    g.phase = GroupPhase::Resetting;
    g.reset = Some(InPlaceReset {
        from_incarnation: 1,
        started: Time(now()),
    });
    g.last_co_restart = Some(CoRestartRecord {
        time: Time(now()),
        reason: CoRestartReason::MemberNotReady,
        in_place: true,
    });
    st
}

fn at(mut pod: Pod, ip: &str) -> Pod {
    pod.status.as_mut().unwrap().pod_ip = Some(ip.into());
    pod
}

fn key_secret() -> serde_json::Value {
    let secret = k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("demo-g0-key".into()),
            namespace: Some(NS.into()),
            ..Default::default()
        },
        data: Some(
            [(
                "key".to_string(),
                k8s_openapi::ByteString(b"group-key-hex".to_vec()),
            )]
            .into(),
        ),
        ..Default::default()
    };
    serde_json::to_value(secret).unwrap()
}

fn ready_reply() -> ResetReply {
    ResetReply::Ready {
        reset: true,
        incarnation: "0011223344556677".into(),
        took_ms: 120,
    }
}

#[tokio::test]
async fn the_prefill_is_asked_with_the_group_key_and_its_label_moves_on() {
    let prefill = at(member(Role::Prefill, 1, "Running", true, None), "10.1.2.4");
    let decode = at(
        member(Role::Decode, 1, "Running", false, Some(false)),
        "10.1.2.3",
    );
    let trigger = pdd(Some(resetting()));
    let mut resetter = FakeResetter::default();
    resetter
        .answers
        .insert("10.1.2.4:8000".parse().unwrap(), ready_reply());
    let calls = resetter.calls.clone();
    let (result, metrics) = run_with_resetter(trigger.clone(), resetter, |mut api| async move {
        api.reads(&trigger, &[prefill, decode], true).await;
        api.objects().await;
        api.next(Method::GET, &format!("{SECRETS}/demo-g0-key"))
            .await
            .reply(StatusCode::OK, key_secret());
        let patch = api
            .next(Method::PATCH, &format!("{PODS}/demo-g0-i1-p0?"))
            .await;
        assert_eq!(
            patch.content_type.as_deref(),
            Some("application/merge-patch+json")
        );
        let meta = &patch.body["metadata"];
        assert_eq!(
            meta["labels"]["tandem.dev/incarnation"], "2",
            "{}",
            patch.body
        );
        assert_eq!(meta["annotations"]["tandem.dev/incarnation"], "2");
        assert!(meta["annotations"]["tandem.dev/reset-at"].is_string());
        patch.echo();
        let status = api.status().await;
        assert_eq!(status.group_statuses[0].phase, GroupPhase::Resetting);
        api.done().await;
    })
    .await;
    result.unwrap();
    let calls = calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        vec![(
            "10.1.2.4:8000".parse().unwrap(),
            Role::Prefill,
            2,
            "group-key-hex".to_string()
        )],
        "only the prefill, first"
    );
    let text = metrics.encode();
    assert!(
        text.contains("tandem_operator_reset_calls_total{outcome=\"ready\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_member_that_does_not_answer_keeps_its_label_and_the_reconcile_succeeds() {
    let prefill = at(member(Role::Prefill, 1, "Running", true, None), "10.1.2.4");
    let decode = at(
        member(Role::Decode, 1, "Running", false, Some(false)),
        "10.1.2.3",
    );
    let trigger = pdd(Some(resetting()));
    let (result, metrics) = run_with_resetter(
        trigger.clone(),
        FakeResetter::default(),
        |mut api| async move {
            api.reads(&trigger, &[prefill, decode], true).await;
            api.objects().await;
            api.next(Method::GET, &format!("{SECRETS}/demo-g0-key"))
                .await
                .reply(StatusCode::OK, key_secret());
            // No patch of the pod: straight to the status.
            api.status().await;
            api.done().await;
        },
    )
    .await;
    result.unwrap();
    assert!(
        metrics
            .encode()
            .contains("tandem_operator_reset_calls_total{outcome=\"no_answer\"} 1")
    );
}

#[tokio::test]
async fn the_decode_follows_once_the_prefill_serves_the_new_incarnation() {
    let mut prefill = at(member(Role::Prefill, 2, "Running", true, None), "10.1.2.4");
    // It reset in place: its name keeps incarnation 1, its label says 2.
    prefill.metadata.name = Some("demo-g0-i1-p0".into());
    let decode = at(
        member(Role::Decode, 1, "Running", false, Some(false)),
        "10.1.2.3",
    );
    let trigger = pdd(Some(resetting()));
    let mut resetter = FakeResetter::default();
    resetter
        .answers
        .insert("10.1.2.3:8000".parse().unwrap(), ready_reply());
    let calls = resetter.calls.clone();
    let (result, _) = run_with_resetter(trigger.clone(), resetter, |mut api| async move {
        api.reads(&trigger, &[prefill, decode], true).await;
        api.objects().await;
        api.next(Method::GET, &format!("{SECRETS}/demo-g0-key"))
            .await
            .reply(StatusCode::OK, key_secret());
        api.next(Method::PATCH, &format!("{PODS}/demo-g0-i1-d0?"))
            .await
            .echo();
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0].1, calls[0].2), (Role::Decode, 2));
}
