//! Reconcile against a recorded mock API server (kube's tower-test pattern): every test
//! writes out the exact request sequence it expects and answers each request.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::runtime::events::Reporter;
use kube::{Client, Resource};
use serde_json::{Value, json};
use tower_test::mock::{self, Handle};

use super::*;
use crate::crd::{GroupPhase, PDDeploymentStatus};
use crate::planner::{Observed, PlanInput, PodIntent};
use crate::testutil;

const NS: &str = "default";
const NAME: &str = "demo";
const PDD_PATH: &str = "/apis/tandem.dev/v1alpha1/namespaces/default/pddeployments/demo";
const SELECTOR: &str = "?&labelSelector=tandem.dev%2Fdeployment%3Ddemo";
const APPLY: &str = "?&force=true&fieldManager=tandem-operator";
const PODS: &str = "/api/v1/namespaces/default/pods";
const SERVICES: &str = "/api/v1/namespaces/default/services";
const POLICIES: &str = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies";
const SECRETS: &str = "/api/v1/namespaces/default/secrets";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

fn now() -> Timestamp {
    Timestamp::from_second(1_750_000_000).unwrap()
}

fn pdd(status: Option<PDDeploymentStatus>) -> PDDeployment {
    let mut p = PDDeployment::new(NAME, testutil::spec(1));
    p.metadata.namespace = Some(NS.into());
    p.metadata.uid = Some("uid-demo".into());
    p.metadata.generation = Some(1);
    p.metadata.resource_version = Some("100".into());
    p.status = status;
    p
}

/// The planner's status after a reconcile that observed `pods` (and every group object).
fn status_after(prev: Option<&PDDeploymentStatus>, pods: &[Pod]) -> PDDeploymentStatus {
    let p = pdd(None);
    let observed = Observed {
        pods: pods.iter().map(|p| observe_pod(p).unwrap()).collect(),
        client_service: true,
        group_services: [0].into(),
        network_policies: [0].into(),
        group_secrets: [0].into(),
    };
    planner::plan(&PlanInput {
        name: NAME,
        generation: Some(1),
        spec: &p.spec,
        status: prev,
        restart_requested_at: None,
        observed: &observed,
        now: now(),
    })
    .status
}

/// A pod as the operator builds it, with a status as the kubelet reports it.
fn member(role: Role, incarnation: i64, phase: &str, ready: bool, gate: Option<bool>) -> Pod {
    let p = pdd(None);
    let revision = crate::crd::RevisionedSpec::from_spec(&p.spec);
    let intent = PodIntent {
        name: names::pod_name(NAME, 0, incarnation, role, 0),
        group: 0,
        role,
        index: 0,
        incarnation,
        revision: revision.revision(),
        template: revision,
    };
    let mut pod = resources::pod(&p, &intent).unwrap();
    let cond = |t: &str, ok: bool| PodCondition {
        type_: t.into(),
        status: if ok { "True" } else { "False" }.into(),
        last_transition_time: Some(Time(now())),
        ..Default::default()
    };
    let mut pod_conditions = vec![cond("ContainersReady", ready)];
    if let Some(g) = gate {
        pod_conditions.push(cond(conditions::GROUP_READY, g));
    }
    pod.status = Some(PodStatus {
        phase: Some(phase.into()),
        conditions: Some(pod_conditions),
        ..Default::default()
    });
    pod
}

/// The applied pod, as it goes over the wire: probes with explicit timeouts (a startup
/// probe covering model loading) and the restricted security defaults.
fn assert_restricted_with_startup_probe(pod: &Value) {
    let spec = &pod["spec"];
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(
        spec["securityContext"],
        json!({"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
               "seccompProfile": {"type": "RuntimeDefault"}})
    );
    let c = &spec["containers"][0];
    assert_eq!(
        c["securityContext"],
        json!({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
               "capabilities": {"drop": ["ALL"]}})
    );
    let probe = |path: &str, period: i32, timeout: i32, threshold: i32| {
        json!({"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
               "timeoutSeconds": timeout, "failureThreshold": threshold})
    };
    assert_eq!(c["startupProbe"], probe("/health", 2, 2, 300));
    assert_eq!(c["readinessProbe"], probe("/ready", 2, 2, 3));
    assert_eq!(c["livenessProbe"], probe("/health", 10, 5, 3));
}

type ApiHandle = Handle<Request<Body>, Response<Body>>;

struct MockApi {
    handle: ApiHandle,
}

/// One received request.
struct Seen {
    content_type: Option<String>,
    body: Value,
    respond: mock::SendResponse<Response<Body>>,
}

impl Seen {
    fn reply(self, status: StatusCode, body: Value) {
        self.respond.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
    }

    /// Answer with the request's own body (what an apply or create returns, roughly).
    fn echo(self) {
        let body = self.body.clone();
        self.reply(StatusCode::OK, body);
    }
}

fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "1"}, "items": items})
}

fn meta_item(name: &str, group: Option<i32>) -> Value {
    let mut labels = json!({labels::DEPLOYMENT: NAME, labels::MANAGED_BY: labels::MANAGER,
                            labels::PORTS: "8000-5600"});
    if let Some(g) = group {
        labels[labels::GROUP] = json!(g.to_string());
    }
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
           "metadata": {"name": name, "namespace": NS, "labels": labels}})
}

impl MockApi {
    async fn next(&mut self, method: Method, uri: &str) -> Seen {
        let (req, respond) =
            tokio::time::timeout(Duration::from_secs(5), self.handle.next_request())
                .await
                .unwrap_or_else(|_| panic!("timed out waiting for {method} {uri}"))
                .unwrap_or_else(|| panic!("client gone; expected {method} {uri}"));
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        assert_eq!(
            (parts.method.clone(), parts.uri.to_string()),
            (method, uri.to_string()),
            "unexpected request; body: {body}"
        );
        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string());
        // Every request the controller makes is one the chart's RBAC allows.
        testutil::rbac::assert_allowed(
            &parts.method,
            &parts.uri.to_string(),
            content_type.as_deref(),
            &body,
        );
        Seen {
            content_type,
            body,
            respond,
        }
    }

    /// The reads every reconcile starts with: the deployment, then what it owns.
    async fn reads(&mut self, pdd: &PDDeployment, pods: &[Pod], objects_exist: bool) {
        self.next(Method::GET, PDD_PATH)
            .await
            .reply(StatusCode::OK, serde_json::to_value(pdd).unwrap());
        let pods: Vec<Value> = pods
            .iter()
            .map(|p| serde_json::to_value(p).unwrap())
            .collect();
        self.next(Method::GET, &format!("{PODS}{SELECTOR}"))
            .await
            .reply(StatusCode::OK, list("PodList", pods));
        let items = |v: Vec<Value>| if objects_exist { v } else { vec![] };
        let lists = [
            (
                SERVICES,
                items(vec![
                    meta_item(NAME, None),
                    meta_item("demo-g0-bootstrap", Some(0)),
                ]),
            ),
            (POLICIES, items(vec![meta_item("demo-g0-kv", Some(0))])),
            (SECRETS, items(vec![meta_item("demo-g0-key", Some(0))])),
        ];
        for (path, items) in lists {
            let seen = self.next(Method::GET, &format!("{path}{SELECTOR}")).await;
            seen.reply(StatusCode::OK, list("PartialObjectMetadataList", items));
        }
    }

    /// A server-side apply of `path`/`name`; returns its body.
    async fn apply(&mut self, path: &str, name: &str) -> Value {
        let seen = self
            .next(Method::PATCH, &format!("{path}/{name}{APPLY}"))
            .await;
        assert_eq!(
            seen.content_type.as_deref(),
            Some("application/apply-patch+yaml")
        );
        let body = seen.body.clone();
        assert_eq!(body["metadata"]["name"], name);
        let owner = &body["metadata"]["ownerReferences"][0];
        assert_eq!(owner["uid"], "uid-demo");
        assert_eq!(owner["controller"], true);
        seen.echo();
        body
    }

    /// An event POST; returns its body.
    async fn event(&mut self) -> Value {
        let seen = self.next(Method::POST, &format!("{EVENTS}?")).await;
        let body = seen.body.clone();
        assert_eq!(body["regarding"]["kind"], "PDDeployment");
        assert_eq!(body["regarding"]["name"], NAME);
        assert_eq!(body["reportingController"], "tandem-operator");
        seen.echo();
        body
    }

    /// The status write; returns the status it carried.
    async fn status(&mut self) -> PDDeploymentStatus {
        let seen = self
            .next(Method::PATCH, &format!("{PDD_PATH}/status{APPLY}"))
            .await;
        assert_eq!(
            seen.content_type.as_deref(),
            Some("application/apply-patch+yaml")
        );
        assert_eq!(seen.body["apiVersion"], "tandem.dev/v1alpha1");
        assert_eq!(seen.body["kind"], "PDDeployment");
        let status: PDDeploymentStatus =
            serde_json::from_value(seen.body["status"].clone()).unwrap();
        let mut obj = serde_json::to_value(pdd(None)).unwrap();
        obj["status"] = seen.body["status"].clone();
        seen.reply(StatusCode::OK, obj);
        status
    }

    /// Nothing else was asked once the client is gone.
    async fn done(mut self) {
        let next = tokio::time::timeout(Duration::from_secs(5), self.handle.next_request())
            .await
            .expect("client still alive");
        if let Some((req, _)) = next {
            panic!("unexpected extra request {} {}", req.method(), req.uri());
        }
    }
}

fn context() -> (Arc<Context>, MockApi) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, NS);
    let ctx = Context::new(
        client,
        Arc::new(Metrics::new()),
        Reporter {
            controller: "tandem-operator".into(),
            instance: Some("test".into()),
        },
    )
    .with_clock(now);
    (Arc::new(ctx), MockApi { handle })
}

/// Run one reconcile while `script` plays the API server; returns the reconcile result.
async fn run<F>(
    trigger: PDDeployment,
    script: impl FnOnce(MockApi) -> F,
) -> (Result<Action, Error>, Arc<Metrics>)
where
    F: Future<Output = ()> + Send + 'static,
{
    let (ctx, api) = context();
    let metrics = ctx.metrics.clone();
    let server = tokio::spawn(script(api));
    let result = tokio::time::timeout(Duration::from_secs(10), reconcile(Arc::new(trigger), ctx))
        .await
        .expect("reconcile hung");
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("mock server hung")
        .expect("mock server assertions");
    (result, metrics)
}

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
        api.apply(POLICIES, "demo-g0-kv").await;
        let secret = api.next(Method::POST, &format!("{SECRETS}?")).await;
        assert_eq!(secret.body["metadata"]["name"], "demo-g0-key");
        let key = secret.body["data"]["key"].as_str().unwrap().to_string();
        assert!(!key.is_empty());
        secret.echo();
        let pod = api.apply(PODS, "demo-g0-i1-p0").await;
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
async fn a_port_change_re_applies_services_and_network_policy_but_not_the_secret() {
    let mut changed = pdd(None);
    changed.spec.transfer.kv_port = 5601;
    let (result, _) = run(changed.clone(), |mut api| async move {
        // The objects exist, labelled for ports 8000-5600.
        api.reads(&changed, &[], true).await;
        let svc = api.apply(SERVICES, NAME).await;
        assert_eq!(svc["metadata"]["labels"][labels::PORTS], "8000-5601");
        let bootstrap = api.apply(SERVICES, "demo-g0-bootstrap").await;
        assert_eq!(bootstrap["spec"]["ports"][0]["port"], 5601);
        let policy = api.apply(POLICIES, "demo-g0-kv").await;
        assert_eq!(policy["metadata"]["labels"][labels::PORTS], "8000-5601");
        api.apply(PODS, "demo-g0-i1-p0").await;
        api.event().await;
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn an_existing_secret_is_not_an_error() {
    let (result, _) = run(pdd(None), |mut api| async move {
        api.reads(&pdd(None), &[], false).await;
        api.apply(SERVICES, NAME).await;
        api.apply(SERVICES, "demo-g0-bootstrap").await;
        api.apply(POLICIES, "demo-g0-kv").await;
        api.next(Method::POST, &format!("{SECRETS}?")).await.reply(
            StatusCode::CONFLICT,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                   "reason": "AlreadyExists", "code": 409, "message": "exists"}),
        );
        api.apply(PODS, "demo-g0-i1-p0").await;
        api.event().await;
        api.status().await;
        api.done().await;
    })
    .await;
    result.unwrap();
}

#[tokio::test]
async fn a_ready_prefill_gets_its_decode() {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let prev = status_after(None, &[]);
    let trigger = pdd(Some(prev.clone()));
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
        let pod = api.apply(PODS, "demo-g0-i1-d0").await;
        assert_eq!(pod["metadata"]["labels"][labels::ROLE], "decode");
        assert_eq!(
            pod["spec"]["readinessGates"],
            json!([{"conditionType": "tandem.dev/group-ready"}])
        );
        let env = pod["spec"]["containers"][0]["env"].as_array().unwrap();
        let peers = env
            .iter()
            .find(|e| e["name"] == "TANDEM_PREFILL_PEERS")
            .unwrap();
        assert_eq!(
            peers["value"],
            "prefill-0.demo-g0-bootstrap.default.svc:5600"
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
        let ev = api.event().await;
        assert_eq!(ev["reason"], "MemberFailed");
        assert_eq!(ev["type"], "Warning");
        assert_eq!(ev["action"], "CoRestart");
        assert!(ev["note"].as_str().unwrap().contains("group 0"));
        let gate = api
            .next(Method::PATCH, &format!("{PODS}/demo-g0-i1-d0/status?"))
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
        api.next(Method::DELETE, &format!("{PODS}/demo-g0-i1-d0?"))
            .await
            .reply(StatusCode::OK, pod);
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
        api.next(Method::DELETE, &format!("{PODS}/demo-g0-i1-p0?"))
            .await
            .reply(
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
async fn an_api_error_still_persists_the_status_and_is_counted() {
    let prefill = member(Role::Prefill, 1, "Running", true, None);
    let trigger = pdd(Some(status_after(None, &[])));
    let (result, metrics) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
        api.next(Method::PATCH, &format!("{PODS}/demo-g0-i1-d0{APPLY}"))
            .await
            .reply(
                StatusCode::FORBIDDEN,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                       "reason": "Forbidden", "code": 403, "message": "quota"}),
            );
        api.status().await;
        api.done().await;
    })
    .await;
    let err = result.unwrap_err();
    assert_eq!(err.metric_label(), "forbidden");
    assert!(
        err.to_string().contains("applying pod demo-g0-i1-d0"),
        "{err}"
    );
    let ctx = context().0;
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
}

#[tokio::test]
async fn an_invalid_restart_annotation_warns_and_degrades() {
    let mut trigger = pdd(Some(status_after(None, &[])));
    trigger
        .annotations_mut()
        .insert(annotations::RESTART_REQUESTED_AT.into(), "yesterday".into());
    let prefill = member(Role::Prefill, 1, "Running", false, None);
    let (result, _) = run(trigger.clone(), |mut api| async move {
        api.reads(&trigger, &[prefill], true).await;
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
    })
    .await;
    result.unwrap();
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
