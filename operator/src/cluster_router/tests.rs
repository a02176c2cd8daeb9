use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::*;
use crate::crd::{GroupStatus, PDDeploymentStatus};

fn group(index: i32, phase: GroupPhase, incarnation: i64) -> GroupStatus {
    GroupStatus {
        index,
        phase,
        incarnation,
        ..Default::default()
    }
}

fn status(groups: Vec<GroupStatus>) -> PDDeploymentStatus {
    PDDeploymentStatus {
        group_statuses: groups,
        ..Default::default()
    }
}

/// A decode pod of "demo" at `incarnation`, gate `gate`, IP `ip`, port named `http`.
fn decode(name: &str, g: i32, incarnation: i64, gate: bool, ip: Option<&str>) -> Arc<Pod> {
    Arc::new(Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                [
                    (labels::DEPLOYMENT, "demo"),
                    (labels::ROLE, "decode"),
                    (labels::GROUP, &g.to_string()),
                    (labels::INCARNATION, &incarnation.to_string()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: CONTAINER.into(),
                ports: Some(vec![ContainerPort {
                    name: Some("http".into()),
                    container_port: 8100,
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            pod_ip: ip.map(str::to_string),
            conditions: Some(vec![PodCondition {
                type_: conditions::GROUP_READY.into(),
                status: if gate { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    })
}

fn eligible(t: &Targets) -> Vec<(&str, String)> {
    t.targets
        .iter()
        .filter(|t| t.eligible())
        .map(|t| (t.pod.as_str(), t.addr.to_string()))
        .collect()
}

#[test]
fn only_decodes_of_groups_ready_at_their_incarnation_with_an_open_gate_and_an_ip() {
    let st = status(vec![
        group(0, GroupPhase::Ready, 2),
        group(1, GroupPhase::Restarting, 4),
        group(2, GroupPhase::Ready, 1),
        group(3, GroupPhase::Ready, 1),
    ]);
    let pods = vec![
        decode("demo-g0-i2-d0", 0, 2, true, Some("10.0.0.1")),
        // Ready phase, but an older incarnation still answering.
        decode("demo-g0-i1-d0", 0, 1, true, Some("10.0.0.9")),
        decode("demo-g1-i3-d0", 1, 3, true, Some("10.0.0.2")),
        decode("demo-g2-i1-d0", 2, 1, false, Some("10.0.0.3")),
        decode("demo-g3-i1-d0", 3, 1, true, None),
        {
            let mut other = (*decode("other-g0-i1-d0", 0, 1, true, Some("10.0.0.5"))).clone();
            other
                .metadata
                .labels
                .as_mut()
                .unwrap()
                .insert(labels::DEPLOYMENT.into(), "other".into());
            Arc::new(other)
        },
    ];
    let t = targets_from(Some(&st), &pods, "demo", 8000);
    assert_eq!(
        eligible(&t),
        vec![("demo-g0-i2-d0", "10.0.0.1:8100".to_string())]
    );
    // The old incarnation and the restarting group are listed but never chosen; the closed
    // gate, the missing IP and the other deployment's pod are not listed at all.
    let listed: Vec<&str> = t.targets.iter().map(|t| t.pod.as_str()).collect();
    assert_eq!(listed, ["demo-g0-i1-d0", "demo-g0-i2-d0", "demo-g1-i3-d0"]);
}

#[test]
fn a_terminating_pod_is_not_listed_and_the_spec_port_is_the_fallback() {
    let st = status(vec![group(0, GroupPhase::Ready, 1)]);
    let mut gone = (*decode("demo-g0-i1-d0", 0, 1, true, Some("10.0.0.1"))).clone();
    gone.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    let mut portless = (*decode("demo-g0-i1-d1", 0, 1, true, Some("10.0.0.2"))).clone();
    portless.spec.as_mut().unwrap().containers[0].ports = None;
    let t = targets_from(
        Some(&st),
        &[Arc::new(gone), Arc::new(portless)],
        "demo",
        8000,
    );
    assert_eq!(
        eligible(&t),
        vec![("demo-g0-i1-d1", "10.0.0.2:8000".to_string())]
    );
}

#[test]
fn nothing_eligible_says_why() {
    let t = targets_from(None, &[], "demo", 8000);
    assert_eq!(t.eligible(), 0);
    assert!(
        t.unavailable.contains("has no status yet"),
        "{}",
        t.unavailable
    );
    let st = status(vec![group(0, GroupPhase::Restarting, 3)]);
    let t = targets_from(
        Some(&st),
        &[decode("demo-g0-i2-d0", 0, 2, true, Some("10.0.0.1"))],
        "demo",
        8000,
    );
    assert_eq!(t.eligible(), 0);
    assert!(
        t.unavailable.contains(
            "group 0 is Restarting at incarnation 3 (decode demo-g0-i2-d0 serves at incarnation 2)"
        ),
        "{}",
        t.unavailable
    );
}

#[test]
fn api_keys_come_from_every_file_of_the_mounted_secret() {
    let dir = std::env::temp_dir().join(format!("tandem-router-keys-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("..data")).unwrap();
    std::fs::write(dir.join("alice"), "sk-alice-0123456789\n").unwrap();
    std::fs::write(dir.join("bob"), "sk-bob-0123456789").unwrap();
    std::fs::write(dir.join(".hidden"), "not a key").unwrap();
    let keys = api_keys_from_dir(&dir).unwrap();
    assert_eq!(keys.len(), 2);
    assert!(keys.check(Some(b"Bearer sk-bob-0123456789")).is_ok());
    assert!(keys.check(Some(b"Bearer not a key")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(api_keys_from_dir(&dir).is_err());
}

async fn body_of(r: Response<Body>) -> serde_json::Value {
    let b = http_body_util::BodyExt::collect(r.into_body())
        .await
        .unwrap()
        .to_bytes();
    serde_json::from_slice(&b).unwrap()
}

/// The router's readiness gates its own Service: it turns ready once it has read the
/// deployment and stays so while no group can take traffic (each request is then answered
/// 503 `no_ready_group` at once, which a Service without endpoints cannot do).
#[tokio::test]
async fn the_router_is_ready_once_synced_and_its_body_says_whether_a_group_can_serve() {
    let r = ClusterRouter::new(RouterConfig::default());
    let get = |path: &str| {
        Request::get(path)
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    };
    let chat = || {
        Request::post("/v1/chat/completions")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap()
    };
    assert_eq!(r.handle(get("/health")).await.status(), StatusCode::OK);
    let unsynced = r.handle(get("/ready")).await;
    assert_eq!(unsynced.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body_of(unsynced).await["error"]["code"], "not_synced");

    // Read: group 0 is restarting, its decode's gate closed.
    let restarting = status(vec![group(0, GroupPhase::Restarting, 2)]);
    r.set_targets(targets_from(
        Some(&restarting),
        &[decode("demo-g0-i2-d0", 0, 2, false, Some("127.0.0.1"))],
        "demo",
        8000,
    ));
    r.mark_synced();
    let ready = r.handle(get("/ready")).await;
    assert_eq!(ready.status(), StatusCode::OK);
    let body = body_of(ready).await;
    assert_eq!(body["ready"], true);
    assert_eq!(body["groupsReady"], false);
    assert_eq!(body["endpoints"], serde_json::json!([]));
    assert!(
        body["unavailable"]
            .as_str()
            .is_some_and(|u| u.contains("group 0 is Restarting")),
        "{body}"
    );
    let refused = r.handle(chat()).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body_of(refused).await["error"]["code"], "no_ready_group");

    let st = status(vec![group(0, GroupPhase::Ready, 1)]);
    r.set_targets(targets_from(
        Some(&st),
        &[decode("demo-g0-i1-d0", 0, 1, true, Some("127.0.0.1"))],
        "demo",
        8000,
    ));
    let ready = r.handle(get("/ready")).await;
    assert_eq!(ready.status(), StatusCode::OK);
    let body = body_of(ready).await;
    assert_eq!(body["groupsReady"], true);
    assert_eq!(body["endpoints"][0]["pod"], "demo-g0-i1-d0");
    assert!(body.get("unavailable").is_none(), "{body}");
    let m = r.handle(get("/metrics")).await;
    assert_eq!(m.status(), StatusCode::OK);
    assert_eq!(r.handle(get("/nope")).await.status(), StatusCode::NOT_FOUND);
}
