//! The reconciler: observe what a `PDDeployment` owns, ask the planner what to do, do
//! it in the planner's order, and persist the planner's status.
//!
//! Reads go straight to the API server on every reconcile (one GET of the deployment,
//! then label-selected lists of its pods, Services, NetworkPolicies and Secrets; the
//! last three as metadata only, so Secret data is never read). Cached reads would make a
//! reconcile triggered by a pod event see the status from before the previous reconcile's
//! write, and the planner would take an already-handled deletion for a new one. The
//! deployment is read before the pods, so the pods are never older than the status, which
//! is the direction the planner recovers from (it trusts pod labels over the status).
//!
//! Owned objects are watched (metadata only) by the [`Controller`] just to trigger
//! reconciles.
//!
//! One more read is not from the API server: a decode pod that runs, has started and is
//! not ready is asked why, with `GET http://<podIP>:<http port>/ready` (at most
//! [`READY_READS_AT_ONCE`] at a time, each bounded by [`crate::ready::TIMEOUT`]); the
//! planner puts the answer in the group status and the `BootstrapHealthy` condition. A
//! read that fails is a reason of its own (`probe_unreachable`, …), never a failed
//! reconcile.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Future, StreamExt};
use k8s_openapi::api::core::v1::{ObjectReference, Pod, PodCondition, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, instrument, warn};

use crate::crd::{PDDeployment, PDDeploymentStatus, annotations, conditions, labels};
use crate::metrics::Metrics;
use crate::names;
use crate::planner::{
    self, EventKind, Observed, ObservedPod, PlanInput, PlannedAction, PlannedEvent, PodPhase, Role,
};
use crate::ready::{self, HttpFetcher, ReadyFetcher};
use crate::resources::{self, BuildError};

/// Field manager of every server-side apply.
pub const FIELD_MANAGER: &str = labels::MANAGER;
/// Reconcile at least this often even when nothing changes.
pub const DEFAULT_REQUEUE: Duration = Duration::from_secs(300);
const ERROR_BACKOFF_BASE: Duration = Duration::from_secs(5);
const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Kubernetes limits an event note to 1 kB.
const MAX_NOTE: usize = 1024;
/// Most `/ready` reads of decode pods in flight at once during one reconcile.
pub const READY_READS_AT_ONCE: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error("PDDeployment has no namespace")]
    NoNamespace,
    /// An object with a name this deployment uses belongs to someone else.
    #[error(
        "{kind} {name} exists and is not owned by this PDDeployment ({owner}); it is not taken over"
    )]
    Conflict {
        kind: &'static str,
        name: String,
        owner: String,
    },
}

impl Error {
    fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let action = action.into();
        move |source| Error::Kube { action, source }
    }

    /// Bounded label for `tandem_operator_reconcile_errors_total{reason}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube {
                source: kube::Error::Api(s),
                ..
            } => match s.code {
                403 => "forbidden",
                404 => "not_found",
                409 => "conflict",
                422 => "invalid",
                429 => "throttled",
                500..=599 => "server_error",
                _ => "api_error",
            },
            Error::Kube { .. } => "transport",
            Error::Build(_) => "build",
            Error::NoNamespace => "invalid_object",
            Error::Conflict { .. } => "object_conflict",
        }
    }

    /// What the user reads in the status and the Event: the action and the API server's
    /// own message, without the client library's wrapping.
    pub fn user_message(&self) -> String {
        match self {
            Error::Kube {
                action,
                source: kube::Error::Api(s),
            } => format!("{action}: {} ({} {})", s.message, s.code, s.reason),
            other => other.to_string(),
        }
    }

    /// The `Degraded` reason this failure is reported under.
    fn degraded_reason(&self) -> &'static str {
        match self {
            Error::Conflict { .. } => "ObjectConflict",
            _ => "ApplyFailed",
        }
    }
}

/// Shared state of every reconcile.
pub struct Context {
    /// For requests (bounded by a read timeout).
    pub client: Client,
    /// For the controller's watches (a watch may be quiet for minutes).
    pub watch_client: Client,
    pub metrics: Arc<Metrics>,
    /// Who publishes events.
    pub reporter: Reporter,
    /// The planner's notion of now (fixed in tests).
    pub clock: Arc<dyn Fn() -> Timestamp + Send + Sync>,
    /// Reads a not-ready decode pod's `/ready` (HTTP; canned in tests).
    pub ready: Arc<dyn ReadyFetcher>,
    /// Consecutive failed reconciles per `namespace/name`, for the error backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(client: Client, metrics: Arc<Metrics>, reporter: Reporter) -> Self {
        Self {
            watch_client: client.clone(),
            client,
            metrics,
            reporter,
            clock: Arc::new(Timestamp::now),
            ready: Arc::new(HttpFetcher::default()),
            failures: Mutex::default(),
        }
    }

    /// Read `/ready` bodies with `fetcher` (tests).
    pub fn with_ready_fetcher(mut self, fetcher: impl ReadyFetcher + 'static) -> Self {
        self.ready = Arc::new(fetcher);
        self
    }

    /// Use `client` for the watches (and the context's client for everything else).
    pub fn with_watch_client(mut self, client: Client) -> Self {
        self.watch_client = client;
        self
    }

    /// Same, with a fixed clock (tests).
    pub fn with_clock(mut self, clock: impl Fn() -> Timestamp + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.failures.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn key(pdd: &PDDeployment) -> String {
    format!("{}/{}", pdd.namespace().unwrap_or_default(), pdd.name_any())
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Read a pod into the planner's view. Errors name the label that could not be parsed.
pub fn observe_pod(pod: &Pod) -> Result<ObservedPod, String> {
    let name = pod.name_any();
    let l = pod.labels();
    let label = |k: &str| l.get(k).ok_or_else(|| format!("label {k} missing"));
    let group = label(labels::GROUP)?
        .parse::<i32>()
        .map_err(|e| format!("label {}: {e}", labels::GROUP))?;
    let role_s = label(labels::ROLE)?;
    let role = Role::parse(role_s).ok_or_else(|| format!("label {}: {role_s:?}", labels::ROLE))?;
    let incarnation = label(labels::INCARNATION)?
        .parse::<i64>()
        .map_err(|e| format!("label {}: {e}", labels::INCARNATION))?;
    let revision = label(labels::REVISION)?.clone();
    let status = pod.status.as_ref();
    let phase = match status.and_then(|s| s.phase.as_deref()) {
        None | Some("Pending") => PodPhase::Pending,
        Some("Running") => PodPhase::Running,
        Some("Succeeded") => PodPhase::Succeeded,
        Some("Failed") => PodPhase::Failed,
        Some(_) => PodPhase::Unknown,
    };
    let pod_conditions = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let cond = |t: &str| pod_conditions.iter().find(|c| c.type_ == t);
    let (ready, not_ready_since) = readiness(cond("ContainersReady"), cond("Ready"));
    let group_ready_gate = cond(conditions::GROUP_READY).is_some_and(|c| c.status == "True");
    Ok(ObservedPod {
        name,
        group,
        role,
        revision,
        incarnation,
        phase,
        terminating: pod.metadata.deletion_timestamp.is_some(),
        ready,
        not_ready_since,
        group_ready_gate,
        deletion_deadline: pod.metadata.deletion_timestamp.as_ref().map(|t| t.0),
        waiting: waiting_reason(pod),
        exit: exit_reason(pod),
        // Read from the pod itself over HTTP by `observe` (not from the API object).
        ready_detail: None,
    })
}

/// Where to ask a pod why it is not ready: a decode pod that runs, has passed its startup
/// probe (before that its port is closed while the model loads), is not ready and is not
/// being deleted; at its pod IP and its container's `http` port.
pub fn ready_target(pod: &Pod, observed: &ObservedPod) -> Option<SocketAddr> {
    if observed.role != Role::Decode
        || observed.phase != PodPhase::Running
        || observed.ready
        || observed.terminating
    {
        return None;
    }
    let status = pod.status.as_ref()?;
    let started = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == resources::CONTAINER)
        .and_then(|c| c.started);
    if started != Some(true) {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let port = pod
        .spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == resources::CONTAINER)?
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(resources::HTTP_PORT_NAME))?
        .container_port;
    Some(SocketAddr::new(ip, u16::try_from(port).ok()?))
}

/// Ask each `(index into pods, address)` why it is not ready, a few at a time, and put
/// the answer in the pod's `ready_detail`. Failures to read are reasons (logged and
/// counted), never errors.
async fn read_ready_details(
    ctx: &Context,
    pods: &mut [ObservedPod],
    targets: Vec<(usize, SocketAddr)>,
) {
    let answers: Vec<_> = futures::stream::iter(targets)
        .map(|(i, addr)| {
            let read = ctx.ready.fetch(addr);
            async move { (i, addr, read.await) }
        })
        .buffer_unordered(READY_READS_AT_ONCE)
        .collect()
        .await;
    for (i, addr, answer) in answers {
        let p = &mut pods[i];
        let detail = ready::detail(answer);
        let result = match &detail {
            None => "ready",
            Some(d) if ready::is_read_failure(&d.reason) => {
                warn!(pod = %p.name, group = p.group, %addr, reason = %d.reason, "could not read why the decode is not ready: {}", d.message);
                d.reason.as_str()
            }
            Some(d) => {
                debug!(pod = %p.name, group = p.group, reason = %d.reason, "decode not ready: {}", d.message);
                "not_ready"
            }
        };
        ctx.metrics.ready_read(result);
        p.ready_detail = detail;
    }
}

/// The dataplane's own readiness and, when not ready, since when.
///
/// `ContainersReady` is the kubelet's verdict on the readiness probe. `Ready` adds the
/// readiness gates — which this operator sets itself, so it must not count them — but
/// it is also what the node lifecycle controller turns False (and only it) when a node
/// stops reporting. So: not ready when `ContainersReady` is not True, or when `Ready` is
/// False for any reason other than the readiness gates (the kubelet's reason for a gate
/// is `ReadinessGatesNotReady`; the node controller keeps the previous reason, which
/// was empty for a Ready pod).
fn readiness(
    containers_ready: Option<&PodCondition>,
    ready: Option<&PodCondition>,
) -> (bool, Option<Timestamp>) {
    let since = |c: &PodCondition| c.last_transition_time.as_ref().map(|t| t.0);
    match containers_ready {
        Some(c) if c.status == "True" => {}
        Some(c) => return (false, since(c)),
        None => return (false, None),
    }
    match ready {
        Some(r) if r.status == "False" && r.reason.as_deref() != Some("ReadinessGatesNotReady") => {
            (false, since(r))
        }
        _ => (true, None),
    }
}

/// Why a pod does not run, when the scheduler or the kubelet said why.
/// How the dataplane container ended, as the kubelet reports it (`OOMKilled, exit code
/// 137`), once it has.
fn exit_reason(pod: &Pod) -> Option<String> {
    let t = pod
        .status
        .as_ref()?
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == resources::CONTAINER)?
        .state
        .as_ref()?
        .terminated
        .as_ref()?;
    Some(match t.reason.as_deref() {
        Some(r) if !r.is_empty() => format!("{r}, exit code {}", t.exit_code),
        _ => format!("exit code {}", t.exit_code),
    })
}

fn waiting_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let unscheduled = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    if let Some(c) = unscheduled {
        return Some(format!(
            "{}: {}",
            c.reason.as_deref().unwrap_or("Unschedulable"),
            c.message.as_deref().unwrap_or_default()
        ));
    }
    status
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|cs| cs.state.as_ref()?.waiting.as_ref())
        // Every container waits in ContainerCreating for a moment; that says nothing.
        .find(|w| {
            !matches!(
                w.reason.as_deref(),
                None | Some("ContainerCreating" | "PodInitializing")
            )
        })
        .map(|w| {
            format!(
                "{}: {}",
                w.reason.as_deref().unwrap_or_default(),
                w.message.as_deref().unwrap_or_default()
            )
        })
}

/// The `tandem.dev/restart-requested-at` annotation: absent, a time, or unparsable.
pub fn restart_requested_at(pdd: &PDDeployment) -> Result<Option<Timestamp>, String> {
    match pdd.annotations().get(annotations::RESTART_REQUESTED_AT) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v.trim().parse::<Timestamp>().map(Some).map_err(|e| {
            format!(
                "{}: {v:?} is not an RFC 3339 time: {e}",
                annotations::RESTART_REQUESTED_AT
            )
        }),
    }
}

/// Objects with names this deployment uses that belong to someone else, by
/// `(kind, name)`, with a description of their owner. Never applied to or deleted.
pub type Foreign = BTreeMap<(&'static str, String), String>;

/// UID of an object's controller owner.
fn controller_uid(meta: &ObjectMeta) -> Option<&str> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true))
        .map(|r| r.uid.as_str())
}

fn describe_owner(meta: &ObjectMeta) -> String {
    match meta
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true))
    {
        Some(r) => format!("controlled by {} {} uid {}", r.kind, r.name, r.uid),
        None => "no controller".to_string(),
    }
}

/// Read everything the deployment owns: pods by label, and every Service, NetworkPolicy
/// and Secret of the namespace by name (metadata only, so Secret data is never read).
/// Only objects whose controller owner reference carries this deployment's UID count as
/// ours; one with our name and another owner — a deployment of the same name deleted a
/// moment ago, or someone else's object — is reported in [`Foreign`] and left alone.
async fn observe(
    ctx: &Context,
    pdd: &PDDeployment,
    ns: &str,
    name: &str,
) -> Result<(Observed, Foreign), Error> {
    let client = &ctx.client;
    let uid = pdd
        .metadata
        .uid
        .as_deref()
        .ok_or(Error::Build(BuildError::Missing("metadata.uid")))?;
    let ours = |m: &ObjectMeta| controller_uid(m) == Some(uid);
    let mut foreign = Foreign::new();
    let lp = ListParams::default().labels(&format!("{}={name}", labels::DEPLOYMENT));
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&lp)
        .await
        .map_err(Error::kube("listing pods"))?;
    let mut observed = Observed::default();
    let mut ask = Vec::new();
    for pod in &pods.items {
        if !ours(&pod.metadata) {
            foreign.insert(("pod", pod.name_any()), describe_owner(&pod.metadata));
            continue;
        }
        match observe_pod(pod) {
            Ok(p) => {
                if let Some(addr) = ready_target(pod, &p) {
                    ask.push((observed.pods.len(), addr));
                }
                observed.pods.push(p);
            }
            Err(why) => {
                ctx.metrics.unparsable_pods.inc();
                warn!(pod = %pod.name_any(), deployment = name, namespace = ns, "skipping pod: {why}");
            }
        }
    }
    read_ready_details(ctx, &mut observed.pods, ask).await;
    let all = ListParams::default();
    let services = Api::<Service>::namespaced(client.clone(), ns)
        .list_metadata(&all)
        .await
        .map_err(Error::kube("listing services"))?;
    for s in &services.items {
        let sname = s.name_any();
        let group = names::group_of(name, &sname, "-bootstrap");
        if sname != name && group.is_none() {
            continue;
        }
        if !ours(&s.metadata) {
            foreign.insert(("service", sname), describe_owner(&s.metadata));
        } else if let Some(g) = group {
            observed.group_services.insert(g);
        } else {
            observed.client_service = true;
        }
    }
    let policies = Api::<NetworkPolicy>::namespaced(client.clone(), ns)
        .list_metadata(&all)
        .await
        .map_err(Error::kube("listing network policies"))?;
    for p in &policies.items {
        let Some(g) = names::group_of(name, &p.name_any(), "-kv") else {
            continue;
        };
        if ours(&p.metadata) {
            observed.network_policies.insert(g);
        } else {
            foreign.insert(("networkpolicy", p.name_any()), describe_owner(&p.metadata));
        }
    }
    let secrets = Api::<Secret>::namespaced(client.clone(), ns)
        .list_metadata(&all)
        .await
        .map_err(Error::kube("listing secrets"))?;
    for s in &secrets.items {
        let Some(g) = names::group_of(name, &s.name_any(), "-key") else {
            continue;
        };
        if ours(&s.metadata) {
            observed.group_secrets.insert(g);
        } else {
            foreign.insert(("secret", s.name_any()), describe_owner(&s.metadata));
        }
    }
    Ok((observed, foreign))
}

/// Reconcile one `PDDeployment`.
#[instrument(skip_all, fields(deployment = %trigger.name_any(), namespace = trigger.namespace().unwrap_or_default()))]
pub async fn reconcile(trigger: Arc<PDDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started();
    let ns = trigger.namespace().ok_or(Error::NoNamespace)?;
    let name = trigger.name_any();
    let api: Api<PDDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(pdd) = api
        .get_opt(&name)
        .await
        .map_err(Error::kube("reading the PDDeployment"))?
    else {
        return Ok(Action::await_change());
    };
    if pdd.metadata.deletion_timestamp.is_some() {
        // Owner references let the garbage collector remove the children.
        return Ok(Action::await_change());
    }
    let now = (ctx.clock)();
    let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
    let invalid = names::validate_deployment_name(&name)
        .map_err(|why| ("InvalidName", why))
        .and_then(|()| resources::check_role_args(&pdd.spec).map_err(|why| ("InvalidArgs", why)));
    if let Err((reason, why)) = invalid {
        // Children could never be created (the API server refuses their names) or would
        // exit at once (the dataplane refuses their command line): say so once, and
        // wait for the user instead of retrying forever.
        warn!("{why}");
        let mut status = pdd.status.clone().unwrap_or_default();
        status.observed_generation = pdd.metadata.generation;
        report_once(&recorder, &pdd, &mut status, reason, &why, now).await;
        write_status(&api, &name, &status).await?;
        return Ok(Action::await_change());
    }
    let (observed, foreign) = observe(&ctx, &pdd, &ns, &name).await?;
    let (restart_requested_at, bad_annotation) = match restart_requested_at(&pdd) {
        Ok(t) => (t, None),
        Err(why) => (None, Some(why)),
    };
    let plan = planner::plan(&PlanInput {
        name: &name,
        generation: pdd.metadata.generation,
        spec: &pdd.spec,
        status: pdd.status.as_ref(),
        restart_requested_at,
        observed: &observed,
        now,
    });
    debug!(actions = plan.actions.len(), "planned");

    // A fresh recorder per reconcile: kube's recorder folds events with the same
    // (type, reason, action, related) into a series for 6 minutes and keeps the first
    // note, which would hide a group's later phase changes.
    let mut result = Ok(());
    for action in &plan.actions {
        // Stop at the first failure: later actions may depend on earlier ones (decode
        // pods are removed before prefill pods, the Secret is made before the pods).
        if let Err(e) = apply(&ctx, &pdd, &foreign, &recorder, action).await {
            result = Err(e);
            break;
        }
    }
    let mut status = plan.status.clone();
    if let Some(why) = &bad_annotation {
        warn!("{why}");
        report_once(
            &recorder,
            &pdd,
            &mut status,
            "InvalidRestartRequest",
            why,
            now,
        )
        .await;
    }
    if let Err(e) = &result {
        // The API server's answer goes where the user looks: the Degraded condition and a
        // Warning Event (once per distinct message).
        let reason = e.degraded_reason();
        let message = e.user_message();
        warn!(reason, "{message}");
        report_once(&recorder, &pdd, &mut status, reason, &message, now).await;
    }
    // The status is written even after a failed action: it carries the planner's memory
    // (a co-restart's new incarnation), which must not be decided twice.
    write_status(&api, &name, &status).await?;
    ctx.metrics.plan_applied(&plan);
    result?;
    ctx.failures().remove(&key(&pdd));
    Ok(Action::requeue(
        plan.requeue_after.unwrap_or(DEFAULT_REQUEUE),
    ))
}

/// Mark `Degraded` True with `reason` unless the planner already reports a degradation,
/// in which case the message is appended.
fn degrade(
    status: &mut PDDeploymentStatus,
    prev: Option<&PDDeploymentStatus>,
    reason: &str,
    message: &str,
    now: Timestamp,
) {
    let generation = status.observed_generation;
    let idx = match status
        .conditions
        .iter()
        .position(|c| c.type_ == conditions::DEGRADED)
    {
        Some(i) => i,
        None => {
            status.conditions.push(Condition {
                type_: conditions::DEGRADED.into(),
                status: "False".into(),
                reason: "AsExpected".into(),
                message: String::new(),
                last_transition_time: Time(now),
                observed_generation: generation,
            });
            status.conditions.len() - 1
        }
    };
    let c = &mut status.conditions[idx];
    if c.status == "True" {
        if !c.message.contains(message) {
            c.message = format!("{}; {message}", c.message);
        }
        return;
    }
    let since = prev
        .and_then(|p| {
            p.conditions
                .iter()
                .find(|c| c.type_ == conditions::DEGRADED)
        })
        .filter(|c| c.status == "True")
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    *c = Condition {
        type_: conditions::DEGRADED.into(),
        status: "True".into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: since,
        observed_generation: c.observed_generation,
    };
}

/// Put `message` in the `Degraded` condition and publish it as a Warning Event, unless
/// the previous status already carried it (one Event per distinct message, not one per
/// reconcile).
async fn report_once(
    recorder: &Recorder,
    pdd: &PDDeployment,
    status: &mut PDDeploymentStatus,
    reason: &str,
    message: &str,
    now: Timestamp,
) {
    let prev = pdd.status.as_ref();
    let already = prev
        .and_then(|p| {
            p.conditions
                .iter()
                .find(|c| c.type_ == conditions::DEGRADED)
        })
        .is_some_and(|c| c.status == "True" && c.message.contains(message));
    if !already {
        publish(
            recorder,
            pdd,
            &PlannedEvent {
                type_: EventKind::Warning,
                reason: reason.into(),
                group: -1,
                message: message.into(),
            },
        )
        .await;
    }
    degrade(status, prev, reason, message, now);
}

async fn write_status(
    api: &Api<PDDeployment>,
    name: &str,
    status: &PDDeploymentStatus,
) -> Result<(), Error> {
    let patch = json!({
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDDeployment",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(Error::kube("writing status"))?;
    Ok(())
}

fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

async fn server_side_apply<K>(api: &Api<K>, obj: &K, what: &str) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(&name, &apply_params(), &Patch::Apply(obj))
        .await
        .map_err(Error::kube(format!("applying {what} {name}")))?;
    Ok(())
}

/// Delete, treating "already gone" as success.
async fn delete<K>(api: &Api<K>, name: &str, what: &str, dp: &DeleteParams) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, dp).await {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 404) => Ok(()),
        Err(e) => Err(Error::kube(format!("deleting {what} {name}"))(e)),
    }
}

/// Refuse to touch `(kind, name)` when it belongs to someone else.
fn check_not_foreign(foreign: &Foreign, kind: &'static str, name: &str) -> Result<(), Error> {
    match foreign.get(&(kind, name.to_string())) {
        Some(owner) => Err(Error::Conflict {
            kind,
            name: name.to_string(),
            owner: owner.clone(),
        }),
        None => Ok(()),
    }
}

/// Create `obj`, never overwriting: the planner only creates what the fresh lists did not
/// show as ours, so an object that already exists belongs to someone else (listed reads
/// are consistent, and one reconcile runs at a time per deployment). That is a reported
/// conflict, not a success and not a takeover.
async fn create_if_missing<K>(api: &Api<K>, obj: &K, kind: &'static str) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 409) => Err(Error::Conflict {
            kind,
            name,
            owner: "it appeared after this reconcile listed the namespace".into(),
        }),
        Err(e) => Err(Error::kube(format!("creating {kind} {name}"))(e)),
    }
}

/// Carry out one planned action. Objects of [`Foreign`] are never written.
async fn apply(
    ctx: &Context,
    pdd: &PDDeployment,
    foreign: &Foreign,
    recorder: &Recorder,
    action: &PlannedAction,
) -> Result<(), Error> {
    let ns = pdd.namespace().ok_or(Error::NoNamespace)?;
    let name = pdd.name_any();
    let client = ctx.client.clone();
    match action {
        PlannedAction::ApplyClientService => {
            check_not_foreign(foreign, "service", &name)?;
            let api = Api::<Service>::namespaced(client, &ns);
            server_side_apply(&api, &resources::client_service(pdd)?, "service").await
        }
        PlannedAction::ApplyGroupService { group } => {
            check_not_foreign(
                foreign,
                "service",
                &names::group_service_name(&name, *group),
            )?;
            let api = Api::<Service>::namespaced(client, &ns);
            server_side_apply(&api, &resources::group_service(pdd, *group)?, "service").await
        }
        PlannedAction::ApplyNetworkPolicy { group } => {
            check_not_foreign(
                foreign,
                "networkpolicy",
                &names::network_policy_name(&name, *group),
            )?;
            let api = Api::<NetworkPolicy>::namespaced(client, &ns);
            let np = resources::network_policy(pdd, *group)?;
            server_side_apply(&api, &np, "network policy").await
        }
        PlannedAction::CreateGroupSecret { group } => {
            check_not_foreign(foreign, "secret", &names::group_secret_name(&name, *group))?;
            let api = Api::<Secret>::namespaced(client, &ns);
            let secret = resources::group_secret(pdd, *group, &resources::random_group_key())?;
            // Never overwrite an existing key: pods may be using it.
            create_if_missing(&api, &secret, "secret").await
        }
        PlannedAction::CreatePod(intent) => {
            check_not_foreign(foreign, "pod", &intent.name)?;
            info!(pod = %intent.name, group = intent.group, role = intent.role.as_str(), incarnation = intent.incarnation, "creating pod");
            let api = Api::<Pod>::namespaced(client, &ns);
            // Created, never applied: a pod of another owner with this name (a deployment
            // of the same name being deleted) must not be taken over.
            create_if_missing(&api, &resources::pod(pdd, intent)?, "pod").await
        }
        PlannedAction::DeletePod {
            name: pod,
            group,
            role,
            reason,
        } => {
            info!(pod, group, role = role.as_str(), ?reason, "deleting pod");
            delete(
                &Api::<Pod>::namespaced(client, &ns),
                pod,
                "pod",
                &DeleteParams::default(),
            )
            .await
        }
        PlannedAction::ForceDeletePod {
            name: pod,
            group,
            role,
        } => {
            warn!(
                pod,
                group,
                role = role.as_str(),
                "pod still terminating past its grace period: deleting it with grace 0"
            );
            ctx.metrics.force_deleted_pods.inc();
            delete(
                &Api::<Pod>::namespaced(client, &ns),
                pod,
                "pod",
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..Default::default()
                },
            )
            .await
        }
        PlannedAction::SetGroupReadyGate { pod, ready } => {
            set_gate(
                &Api::<Pod>::namespaced(client, &ns),
                pod,
                *ready,
                (ctx.clock)(),
            )
            .await
        }
        PlannedAction::DeleteGroupResources { group } => {
            let g = *group;
            let dp = DeleteParams::default();
            let svc = names::group_service_name(&name, g);
            if !foreign.contains_key(&("service", svc.clone())) {
                delete(
                    &Api::<Service>::namespaced(client.clone(), &ns),
                    &svc,
                    "service",
                    &dp,
                )
                .await?;
            }
            let np = names::network_policy_name(&name, g);
            if !foreign.contains_key(&("networkpolicy", np.clone())) {
                delete(
                    &Api::<NetworkPolicy>::namespaced(client.clone(), &ns),
                    &np,
                    "network policy",
                    &dp,
                )
                .await?;
            }
            let secret = names::group_secret_name(&name, g);
            if !foreign.contains_key(&("secret", secret.clone())) {
                delete(
                    &Api::<Secret>::namespaced(client, &ns),
                    &secret,
                    "secret",
                    &dp,
                )
                .await?;
            }
            Ok(())
        }
        PlannedAction::Event(ev) => {
            publish(recorder, pdd, ev).await;
            Ok(())
        }
    }
}

/// Set the `tandem.dev/group-ready` condition of a decode pod.
///
/// A strategic merge patch of the `status` subresource: `PodStatus.conditions` has
/// patch strategy `merge` keyed by `type`, so the API server merges our one condition
/// into the kubelet's list instead of replacing it. This is how readiness-gate
/// controllers set their conditions; JSON merge patch would replace the whole list, and
/// the kubelet never touches conditions it does not own.
async fn set_gate(api: &Api<Pod>, pod: &str, ready: bool, now: Timestamp) -> Result<(), Error> {
    let (status, reason, message) = if ready {
        (
            "True",
            "GroupReady",
            "every member of the group is ready at one incarnation",
        )
    } else {
        ("False", "GroupNotReady", "the group is not ready")
    };
    let patch = json!({
        "status": {
            "conditions": [{
                "type": conditions::GROUP_READY,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": Time(now),
            }]
        }
    });
    match api
        .patch_status(
            pod,
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            },
            &Patch::Strategic(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 404) => Ok(()),
        Err(e) => Err(Error::kube(format!("setting the group gate of pod {pod}"))(
            e,
        )),
    }
}

fn event_action(reason: &str) -> &'static str {
    match reason {
        "GroupPhaseChanged" => "UpdateGroupPhase",
        "ScalingDown" => "ScaleDown",
        "InvalidRestartRequest" => "ParseAnnotation",
        "ApplyFailed" | "ObjectConflict" => "Apply",
        "InvalidName" | "InvalidArgs" => "Validate",
        "PodForceDeleted" => "ForceDelete",
        r if crate::crd::CoRestartReason::ALL
            .iter()
            .any(|c| c.as_str() == r) =>
        {
            "CoRestart"
        }
        _ => "Reconcile",
    }
}

/// Publish an event on the deployment. Events are best effort: a failure is logged and
/// never fails the reconcile.
async fn publish(recorder: &Recorder, pdd: &PDDeployment, ev: &PlannedEvent) {
    let mut note = ev.message.clone();
    if note.len() > MAX_NOTE {
        let mut cut = MAX_NOTE;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    // The group's bootstrap Service stands for the group, so that events of different
    // groups are never folded together by the recorder.
    let secondary = (ev.group >= 0).then(|| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        name: Some(names::group_service_name(&pdd.name_any(), ev.group)),
        namespace: pdd.namespace(),
        ..Default::default()
    });
    let event = Event {
        type_: match ev.type_ {
            EventKind::Normal => EventType::Normal,
            EventKind::Warning => EventType::Warning,
        },
        reason: ev.reason.clone(),
        note: Some(note),
        action: event_action(&ev.reason).into(),
        secondary,
    };
    if let Err(e) = recorder.publish(&event, &pdd.object_ref(&())).await {
        warn!(reason = %ev.reason, group = ev.group, "publishing event failed: {e}");
    }
}

/// Log, count and requeue with a per-object exponential backoff.
pub fn error_policy(pdd: Arc<PDDeployment>, error: &Error, ctx: Arc<Context>) -> Action {
    let reason = error.metric_label();
    ctx.metrics.reconcile_failed(reason);
    let n = {
        let mut failures = ctx.failures();
        let n = failures.entry(key(&pdd)).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay = backoff(n);
    warn!(
        deployment = %pdd.name_any(),
        namespace = pdd.namespace().unwrap_or_default(),
        reason,
        attempt = n,
        retry_in_s = delay.as_secs(),
        "reconcile failed: {error}"
    );
    Action::requeue(delay)
}

/// Retry delay after `n` consecutive failures: 5 s × 2^(n-1), at most 5 min.
pub fn backoff(n: u32) -> Duration {
    let shift = n.saturating_sub(1).min(16);
    ERROR_BACKOFF_BASE
        .saturating_mul(1 << shift)
        .min(ERROR_BACKOFF_MAX)
}

/// Run the controller until `shutdown` resolves (then finish running reconciles).
/// `namespace: None` watches every namespace.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), Error> {
    let client = ctx.watch_client.clone();
    fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let pdds: Api<PDDeployment> = api(&client, namespace);
    // Fail fast with a clear message when the CRD is missing or RBAC forbids listing.
    pdds.list(&ListParams::default().limit(1))
        .await
        .map_err(Error::kube("listing PDDeployments (is the CRD installed?)"))?;
    let owned =
        watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, labels::MANAGER));
    Controller::new(pdds, watcher::Config::default().any_semantic())
        .owns(api::<Pod>(&client, namespace), owned.clone())
        .owns(api::<Service>(&client, namespace), owned.clone())
        .owns(api::<NetworkPolicy>(&client, namespace), owned.clone())
        .owns(api::<Secret>(&client, namespace), owned)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(object = %obj, "reconciled"),
                Err(kube::runtime::controller::Error::ReconcilerFailed(..)) => {
                    // Already logged and counted by error_policy.
                }
                Err(e) => warn!("controller: {e}"),
            }
        })
        .await;
    info!("controller stopped");
    Ok(())
}

#[cfg(test)]
mod tests;
