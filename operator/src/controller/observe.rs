//! What the reconcile sees: the pods, Services, NetworkPolicies and Secrets a
//! `PDDeployment` owns, read into the planner's [`Observed`], and the `/ready` answers of
//! not-ready decode pods.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod, PodCondition, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use tracing::{debug, warn};

use super::{Context, Error, READY_READS_AT_ONCE};
use crate::crd::{PDDeployment, annotations, conditions, labels};
use crate::names;
use crate::planner::{Observed, ObservedPod, PodPhase, Role};
use crate::ready;
use crate::resources::{self, BuildError};

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
    let index = crate::names::member_index(&name, role)
        .ok_or_else(|| format!("name {name:?} does not end in a member index"))?;
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
    let node_lost = node_lost(cond("ContainersReady"), cond("Ready"));
    let gate = cond(conditions::GROUP_READY);
    let group_ready_gate = gate.is_some_and(|c| c.status == "True");
    let gate_closed_since = gate
        .filter(|c| c.status == "False")
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| t.0);
    Ok(ObservedPod {
        name,
        group,
        role,
        index,
        revision,
        incarnation,
        phase,
        terminating: pod.metadata.deletion_timestamp.is_some(),
        ready,
        not_ready_since,
        group_ready_gate,
        gate_closed_since,
        deletion_deadline: pod.metadata.deletion_timestamp.as_ref().map(|t| t.0),
        node_lost,
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
    http_addr(pod)
}

/// A pod's HTTP address: its pod IP and its container's `http` port (the dataplane's
/// `/ready` and in-place reset call).
pub fn http_addr(pod: &Pod) -> Option<SocketAddr> {
    let ip: IpAddr = pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()?;
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
pub(super) async fn read_ready_details(
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
pub(super) fn readiness(
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

/// The pod's node stopped reporting: `Ready` is False for a reason other than the
/// readiness gates while `ContainersReady` is still True. Only the node lifecycle
/// controller writes that (it turns `Ready` alone False, keeping the reason, which was
/// empty for a Ready pod); the kubelet turns both False together (`ContainersNotReady`).
pub(super) fn node_lost(
    containers_ready: Option<&PodCondition>,
    ready: Option<&PodCondition>,
) -> bool {
    containers_ready.is_some_and(|c| c.status == "True")
        && ready.is_some_and(|r| {
            r.status == "False" && r.reason.as_deref() != Some("ReadinessGatesNotReady")
        })
}

/// The nodes among `names` whose `Ready` condition is not True: their kubelet stopped
/// reporting (the node lifecycle controller turns it Unknown after its grace period). The
/// pod conditions alone cannot tell once the operator has closed a decode's gate there:
/// its `Ready` then reads False for `ReadinessGatesNotReady`, as on a live node (seen in
/// the e2e suite's node-lost scenario, which then deleted that decode with its full
/// grace and waited 40 s for its force delete). A node that cannot be read is not taken
/// for lost (logged); the pod conditions still count.
pub(super) async fn lost_nodes(
    ctx: &Context,
    names: std::collections::BTreeSet<String>,
) -> std::collections::BTreeSet<String> {
    let api = Api::<Node>::all(ctx.client.clone());
    let mut lost = std::collections::BTreeSet::new();
    for name in names {
        match api.get(&name).await {
            Ok(node) => {
                let ready = node
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                    .map(|c| c.status.clone());
                if ready.as_deref() != Some("True") {
                    debug!(node = %name, ready = ?ready, "node not ready: its pods count as on a lost node");
                    lost.insert(name);
                }
            }
            Err(e) => {
                warn!(node = %name, "could not read the node of a member pod (RBAC get on nodes?); judging its pods by their conditions only: {e}");
                ctx.metrics.reconcile_failed("node_read");
            }
        }
    }
    lost
}

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

/// Why a pod does not run, when the scheduler or the kubelet said why.
pub(super) fn waiting_reason(pod: &Pod) -> Option<String> {
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

/// The HTTP address of each owned pod that has one, by pod name (for in-place resets).
pub(super) type PodAddrs = BTreeMap<String, SocketAddr>;

/// Read everything the deployment owns: pods by label, and every Service, NetworkPolicy
/// and Secret of the namespace by name (metadata only, so Secret data is never read).
/// Only objects whose controller owner reference carries this deployment's UID count as
/// ours; one with our name and another owner — a deployment of the same name deleted a
/// moment ago, or someone else's object — is reported in [`Foreign`] and left alone.
pub(super) async fn observe(
    ctx: &Context,
    pdd: &PDDeployment,
    ns: &str,
    name: &str,
) -> Result<(Observed, Foreign, PodAddrs), Error> {
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
    let mut addrs = PodAddrs::new();
    let mut nodes: Vec<(usize, String)> = Vec::new();
    let mut ask = Vec::new();
    for pod in &pods.items {
        if !ours(&pod.metadata) {
            foreign.insert(("pod", pod.name_any()), describe_owner(&pod.metadata));
            continue;
        }
        match observe_pod(pod) {
            Ok(p) => {
                if let Some(addr) = http_addr(pod) {
                    addrs.insert(p.name.clone(), addr);
                }
                if let Some(n) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
                    nodes.push((observed.pods.len(), n));
                }
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
    let lost = lost_nodes(ctx, nodes.iter().map(|(_, n)| n.clone()).collect()).await;
    for (i, n) in &nodes {
        if lost.contains(n) {
            // Whatever its conditions say: nobody there runs its probes.
            observed.pods[*i].node_lost = true;
            observed.pods[*i].ready = false;
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
        if sname == names::router_name(name) {
            if ours(&s.metadata) {
                observed.router = true;
            } else {
                foreign.insert(("service", sname), describe_owner(&s.metadata));
            }
            continue;
        }
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
    Ok((observed, foreign, addrs))
}
