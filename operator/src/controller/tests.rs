//! Reconcile against a recorded mock API server (kube's tower-test pattern): every test
//! writes out the exact request sequence it expects and answers each request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, Pod,
    PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::SignedDuration;
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
const GATE: &str = "?&fieldManager=tandem-operator";
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
    owned_by(name, group, "uid-demo")
}

/// Metadata of an object named `name` whose controller owner has `uid`.
fn owned_by(name: &str, group: Option<i32>, uid: &str) -> Value {
    let mut labels = json!({labels::DEPLOYMENT: NAME, labels::MANAGED_BY: labels::MANAGER,
                            labels::PORTS: "8000-5600"});
    if let Some(g) = group {
        labels[labels::GROUP] = json!(g.to_string());
    }
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
           "metadata": {"name": name, "namespace": NS, "labels": labels,
                        "ownerReferences": [{"apiVersion": "tandem.dev/v1alpha1",
                            "kind": "PDDeployment", "name": NAME, "uid": uid,
                            "controller": true, "blockOwnerDeletion": true}]}})
}

fn status_error(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "reason": reason, "code": code, "message": message})
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
        self.reads_with(pdd, pods, objects_exist, vec![]).await
    }

    /// Same, with `extra` metadata items appended to the Service, NetworkPolicy and Secret
    /// lists (each goes to the list whose kind its name's suffix says).
    async fn reads_with(
        &mut self,
        pdd: &PDDeployment,
        pods: &[Pod],
        objects_exist: bool,
        extra: Vec<Value>,
    ) {
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
        let of = |suffix: &str| -> Vec<Value> {
            extra
                .iter()
                .filter(|e| {
                    let n = e["metadata"]["name"].as_str().unwrap();
                    if suffix.is_empty() {
                        !n.ends_with("-kv") && !n.ends_with("-key")
                    } else {
                        n.ends_with(suffix)
                    }
                })
                .cloned()
                .collect()
        };
        let mut svcs = items(vec![
            meta_item(NAME, None),
            meta_item("demo-g0-bootstrap", Some(0)),
        ]);
        svcs.extend(of(""));
        // Objects of other deployments in the namespace are ignored.
        svcs.push(owned_by("unrelated", None, "uid-other"));
        let mut pols = items(vec![meta_item("demo-g0-kv", Some(0))]);
        pols.extend(of("-kv"));
        let mut secrets = items(vec![meta_item("demo-g0-key", Some(0))]);
        secrets.extend(of("-key"));
        for (path, items) in [(SERVICES, svcs), (POLICIES, pols), (SECRETS, secrets)] {
            let seen = self.next(Method::GET, &format!("{path}?")).await;
            seen.reply(StatusCode::OK, list("PartialObjectMetadataList", items));
        }
    }

    /// The Services and the NetworkPolicy every reconcile applies, in the planner's order.
    async fn objects(&mut self) {
        self.apply(SERVICES, NAME).await;
        self.apply(SERVICES, "demo-g0-bootstrap").await;
        self.apply(POLICIES, "demo-g0-kv").await;
    }

    /// A pod creation (POST); returns its body.
    async fn create_pod(&mut self, name: &str) -> Value {
        let seen = self.next(Method::POST, &format!("{PODS}?")).await;
        let body = seen.body.clone();
        assert_eq!(body["metadata"]["name"], name);
        let owner = &body["metadata"]["ownerReferences"][0];
        assert_eq!(owner["uid"], "uid-demo");
        assert_eq!(owner["controller"], true);
        seen.echo();
        body
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

/// Canned `/ready` answers by address (the HTTP read itself is tested against a real
/// server in `ready::tests`); an address without one is refused. Records who was asked.
#[derive(Clone, Default)]
struct FakeReady {
    answers: HashMap<SocketAddr, Result<(StatusCode, Bytes), String>>,
    asked: Arc<Mutex<Vec<SocketAddr>>>,
}

impl FakeReady {
    fn answer(mut self, addr: &str, status: StatusCode, body: Value) -> Self {
        let body = Bytes::from(serde_json::to_vec(&body).unwrap());
        self.answers
            .insert(addr.parse().unwrap(), Ok((status, body)));
        self
    }

    fn asked(&self) -> Vec<SocketAddr> {
        self.asked.lock().unwrap().clone()
    }
}

impl ReadyFetcher for FakeReady {
    fn fetch(&self, addr: SocketAddr) -> BoxFuture<'static, Result<(StatusCode, Bytes), String>> {
        self.asked.lock().unwrap().push(addr);
        let answer =
            self.answers.get(&addr).cloned().unwrap_or_else(|| {
                Err(format!("connect {addr}: Connection refused (os error 111)"))
            });
        Box::pin(async move { answer })
    }
}

fn context(ready: FakeReady) -> (Arc<Context>, MockApi) {
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
    .with_clock(now)
    .with_ready_fetcher(ready);
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
    run_with(trigger, FakeReady::default(), script).await
}

/// Same, with `ready` answering the decode pods' `/ready`.
async fn run_with<F>(
    trigger: PDDeployment,
    ready: FakeReady,
    script: impl FnOnce(MockApi) -> F,
) -> (Result<Action, Error>, Arc<Metrics>)
where
    F: Future<Output = ()> + Send + 'static,
{
    let (ctx, api) = context(ready);
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
        api.objects().await;
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
