//! The controller tests' harness: a recorded mock API server (kube's tower-test pattern)
//! that answers each request a test expects, canned `/ready` answers, and builders of the
//! objects a reconcile reads.

//! Reconcile against a recorded mock API server (kube's tower-test pattern): every test
//! writes out the exact request sequence it expects and answers each request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::client::Body;
use kube::runtime::events::Reporter;
use serde_json::{Value, json};
use tower_test::mock::{self, Handle};

use super::*;
use crate::crd::{PDDeploymentStatus, conditions};
use crate::planner::{Observed, PlanInput, PodIntent, Role};
use crate::testutil;

pub(super) const NS: &str = "default";
pub(super) const NAME: &str = "demo";
pub(super) const PDD_PATH: &str = "/apis/tandem.dev/v1alpha1/namespaces/default/pddeployments/demo";
pub(super) const SELECTOR: &str = "?&labelSelector=tandem.dev%2Fdeployment%3Ddemo";
pub(super) const APPLY: &str = "?&force=true&fieldManager=tandem-operator";
pub(super) const GATE: &str = "?&fieldManager=tandem-operator";
pub(super) const PODS: &str = "/api/v1/namespaces/default/pods";
pub(super) const SERVICES: &str = "/api/v1/namespaces/default/services";
pub(super) const POLICIES: &str = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies";
pub(super) const SECRETS: &str = "/api/v1/namespaces/default/secrets";
pub(super) const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

pub(super) fn now() -> Timestamp {
    Timestamp::from_second(1_750_000_000).unwrap()
}

pub(super) fn pdd(status: Option<PDDeploymentStatus>) -> PDDeployment {
    let mut p = PDDeployment::new(NAME, testutil::spec(1));
    p.metadata.namespace = Some(NS.into());
    p.metadata.uid = Some("uid-demo".into());
    p.metadata.generation = Some(1);
    p.metadata.resource_version = Some("100".into());
    p.status = status;
    p
}

/// The planner's status after a reconcile that observed `pods` (and every group object).
pub(super) fn status_after(prev: Option<&PDDeploymentStatus>, pods: &[Pod]) -> PDDeploymentStatus {
    let p = pdd(None);
    let observed = Observed {
        pods: pods.iter().map(|p| observe_pod(p).unwrap()).collect(),
        client_service: true,
        router: false,
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
pub(super) fn member(
    role: Role,
    incarnation: i64,
    phase: &str,
    ready: bool,
    gate: Option<bool>,
) -> Pod {
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
pub(super) fn assert_restricted_with_startup_probe(pod: &Value) {
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

pub(super) struct MockApi {
    handle: ApiHandle,
}

/// One received request.
pub(super) struct Seen {
    pub(super) content_type: Option<String>,
    pub(super) body: Value,
    respond: mock::SendResponse<Response<Body>>,
}

impl Seen {
    pub(super) fn reply(self, status: StatusCode, body: Value) {
        self.respond.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
    }

    /// Answer with the request's own body (what an apply or create returns, roughly).
    pub(super) fn echo(self) {
        let body = self.body.clone();
        self.reply(StatusCode::OK, body);
    }
}

pub(super) fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "1"}, "items": items})
}

pub(super) fn meta_item(name: &str, group: Option<i32>) -> Value {
    owned_by(name, group, "uid-demo")
}

/// Metadata of an object named `name` whose controller owner has `uid`.
pub(super) fn owned_by(name: &str, group: Option<i32>, uid: &str) -> Value {
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

pub(super) fn status_error(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "reason": reason, "code": code, "message": message})
}

impl MockApi {
    pub(super) async fn next(&mut self, method: Method, uri: &str) -> Seen {
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
    pub(super) async fn reads(&mut self, pdd: &PDDeployment, pods: &[Pod], objects_exist: bool) {
        self.reads_with(pdd, pods, objects_exist, vec![]).await
    }

    /// Same, with `extra` metadata items appended to the Service, NetworkPolicy and Secret
    /// lists (each goes to the list whose kind its name's suffix says).
    pub(super) async fn reads_with(
        &mut self,
        pdd: &PDDeployment,
        pods: &[Pod],
        objects_exist: bool,
        extra: Vec<Value>,
    ) {
        self.reads_all(pdd, pods, &[], objects_exist, extra).await
    }

    /// The reads, the pods' nodes answered with `(name, Ready status)` in between.
    pub(super) async fn reads_all(
        &mut self,
        pdd: &PDDeployment,
        pods: &[Pod],
        nodes: &[(&str, &str)],
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
        for (node, ready) in nodes {
            self.next(Method::GET, &format!("/api/v1/nodes/{node}"))
                .await
                .reply(
                    StatusCode::OK,
                    serde_json::json!({"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": node},
                        "status": {"conditions": [{"type": "Ready", "status": ready}]}}),
                );
        }
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
    pub(super) async fn objects(&mut self) {
        self.apply(SERVICES, NAME).await;
        self.apply(SERVICES, "demo-g0-bootstrap").await;
        self.apply(POLICIES, "demo-g0-kv").await;
    }

    /// A pod creation (POST); returns its body.
    pub(super) async fn create_pod(&mut self, name: &str) -> Value {
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
    pub(super) async fn apply(&mut self, path: &str, name: &str) -> Value {
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
    pub(super) async fn event(&mut self) -> Value {
        let seen = self.next(Method::POST, &format!("{EVENTS}?")).await;
        let body = seen.body.clone();
        assert_eq!(body["regarding"]["kind"], "PDDeployment");
        assert_eq!(body["regarding"]["name"], NAME);
        assert_eq!(body["reportingController"], "tandem-operator");
        seen.echo();
        body
    }

    /// The status write; returns the status it carried.
    pub(super) async fn status(&mut self) -> PDDeploymentStatus {
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
    pub(super) async fn done(mut self) {
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
pub(super) struct FakeReady {
    pub(super) answers: HashMap<SocketAddr, Result<(StatusCode, Bytes), String>>,
    pub(super) asked: Arc<Mutex<Vec<SocketAddr>>>,
}

impl FakeReady {
    pub(super) fn answer(mut self, addr: &str, status: StatusCode, body: Value) -> Self {
        let body = Bytes::from(serde_json::to_vec(&body).unwrap());
        self.answers
            .insert(addr.parse().unwrap(), Ok((status, body)));
        self
    }

    pub(super) fn asked(&self) -> Vec<SocketAddr> {
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

/// Canned answers of in-place reset calls by address; an address without one does not
/// answer. Records every call (address, role, incarnation, key).
#[derive(Clone, Default)]
pub(super) struct FakeResetter {
    pub(super) answers: HashMap<SocketAddr, crate::reset_call::ResetReply>,
    pub(super) calls: Arc<Mutex<Vec<ResetCall>>>,
}

/// One recorded reset call: address, role, incarnation, key.
pub(super) type ResetCall = (SocketAddr, Role, i64, String);

impl crate::reset_call::ResetCaller for FakeResetter {
    fn call(
        &self,
        addr: SocketAddr,
        role: Role,
        to_incarnation: i64,
        key: String,
        _timeout: Duration,
    ) -> BoxFuture<'static, crate::reset_call::ResetReply> {
        self.calls
            .lock()
            .unwrap()
            .push((addr, role, to_incarnation, key));
        let answer = self.answers.get(&addr).cloned().unwrap_or_else(|| {
            crate::reset_call::ResetReply::Failed(format!("connect {addr}: refused"))
        });
        Box::pin(async move { answer })
    }
}

/// Run one reconcile whose in-place reset calls `resetter` answers.
pub(super) async fn run_with_resetter<F>(
    trigger: PDDeployment,
    resetter: FakeResetter,
    script: impl FnOnce(MockApi) -> F,
) -> (Result<Action, Error>, Arc<Metrics>)
where
    F: Future<Output = ()> + Send + 'static,
{
    let (ctx, api) = context(FakeReady::default());
    let ctx = Arc::new(Arc::into_inner(ctx).unwrap().with_reset_caller(resetter));
    run_in(ctx, api, trigger, script).await
}

/// One reconcile with `ctx` while `script` plays the API server behind it.
async fn run_in<F>(
    ctx: Arc<Context>,
    api: MockApi,
    trigger: PDDeployment,
    script: impl FnOnce(MockApi) -> F,
) -> (Result<Action, Error>, Arc<Metrics>)
where
    F: Future<Output = ()> + Send + 'static,
{
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

pub(super) fn context(ready: FakeReady) -> (Arc<Context>, MockApi) {
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
pub(super) async fn run<F>(
    trigger: PDDeployment,
    script: impl FnOnce(MockApi) -> F,
) -> (Result<Action, Error>, Arc<Metrics>)
where
    F: Future<Output = ()> + Send + 'static,
{
    run_with(trigger, FakeReady::default(), script).await
}

/// Same, with `ready` answering the decode pods' `/ready`.
pub(super) async fn run_with<F>(
    trigger: PDDeployment,
    ready: FakeReady,
    script: impl FnOnce(MockApi) -> F,
) -> (Result<Action, Error>, Arc<Metrics>)
where
    F: Future<Output = ()> + Send + 'static,
{
    let (ctx, api) = context(ready);
    run_in(ctx, api, trigger, script).await
}
