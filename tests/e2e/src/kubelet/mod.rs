//! The process kubelet: stands in for the kubelet and the container runtime on a set of
//! Nodes (and for the scheduler, see [`scheduler`]).
//!
//! Each [`Node`] registers a Node object (Ready, with capacity and addresses), renews its
//! Lease in `kube-node-lease` and refreshes its Ready heartbeat, watches the pods bound to
//! it and runs one [`pod::Worker`] per pod. [`Node::set_heartbeat`]`(false)` makes the
//! node behave like a hung kubelet: no Lease renewals, no status, no reaction to pod
//! changes — the processes keep running — so the node lifecycle controller marks it
//! NotReady; `true` brings it back, and it then stops the processes of pods that were
//! removed from the API meanwhile.

pub mod config;
pub mod pod;
pub mod probe;
pub mod scheduler;
pub mod status;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::K8S_VERSION;
use crate::net::PodNetwork;
use pod::{PodShared, Worker};

/// How often the Lease is renewed (the node lifecycle controller's grace is longer).
pub const LEASE_RENEW: Duration = Duration::from_secs(2);
/// How often the Ready condition's heartbeat is refreshed.
pub const STATUS_HEARTBEAT: Duration = Duration::from_secs(5);
const FIELD_MANAGER: &str = "tandem-e2e-kubelet";

/// Shared by a node and its pod workers.
pub struct NodeCtx {
    pub client: Client,
    pub node_name: String,
    pub host_ip: String,
    pub network: Arc<PodNetwork>,
    /// What every image runs (the locally built dataplane).
    pub entrypoint: PathBuf,
    pub pod_exec: PathBuf,
    pub run_dir: PathBuf,
    /// True while the kubelet "works" (heartbeats, status, reactions).
    pub alive: watch::Receiver<bool>,
}

impl NodeCtx {
    pub fn pod_dir(&self, uid: &str) -> PathBuf {
        self.run_dir.join("pods").join(uid)
    }
}

struct PodEntry {
    shared: Arc<PodShared>,
    tx: watch::Sender<Option<Arc<Pod>>>,
    task: JoinHandle<()>,
}

/// Settings of one node.
pub struct NodeSpec {
    pub name: String,
    /// Address reported as the node's InternalIP and the pods' hostIP.
    pub host_ip: String,
    pub labels: BTreeMap<String, String>,
    pub cpu: String,
    pub memory: String,
}

/// A running node.
pub struct Node {
    pub name: String,
    ctx: Arc<NodeCtx>,
    alive_tx: watch::Sender<bool>,
    pods: Arc<Mutex<BTreeMap<String, PodEntry>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Node {
    /// Register the node and start its heartbeats and pod sync.
    pub async fn start(
        client: Client,
        spec: NodeSpec,
        network: Arc<PodNetwork>,
        entrypoint: PathBuf,
        pod_exec: PathBuf,
        run_dir: PathBuf,
    ) -> Result<Node> {
        std::fs::create_dir_all(run_dir.join("pods"))?;
        let (alive_tx, alive_rx) = watch::channel(true);
        let ctx = Arc::new(NodeCtx {
            client: client.clone(),
            node_name: spec.name.clone(),
            host_ip: spec.host_ip.clone(),
            network,
            entrypoint,
            pod_exec,
            run_dir,
            alive: alive_rx,
        });
        register(&client, &spec).await?;
        post_status(&client, &spec.name, true).await?;
        renew_lease(&client, &spec.name).await?;

        let pods = Arc::new(Mutex::new(BTreeMap::new()));
        let (store, writer) = reflector::store::<Pod>();
        let watch = watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={}", spec.name)),
        )
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .for_each(|_| async {});
        let tasks = vec![
            tokio::spawn(watch),
            tokio::spawn(heartbeat(ctx.clone())),
            tokio::spawn(sync_loop(ctx.clone(), store, pods.clone())),
        ];
        info!(node = %spec.name, "node registered");
        Ok(Node {
            name: spec.name,
            ctx,
            alive_tx,
            pods,
            tasks,
        })
    }

    /// Stop (`false`) or resume (`true`) everything a kubelet does visibly.
    pub fn set_heartbeat(&self, on: bool) {
        info!(node = %self.name, on, "kubelet heartbeat");
        self.alive_tx.send_replace(on);
    }

    /// The pod workers of this node (running or finishing).
    pub fn pods(&self) -> Vec<Arc<PodShared>> {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.values().map(|e| e.shared.clone()).collect()
    }

    /// Stop every container now (SIGKILL) and remove the sandboxes; stop the loops.
    pub async fn shutdown(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let entries: Vec<PodEntry> = {
            let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut *pods).into_values().collect()
        };
        for e in entries {
            let pid = e.shared.pid.load(std::sync::atomic::Ordering::SeqCst);
            if pid > 0 {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            e.task.abort();
        }
        let _ = &self.ctx;
    }
}

async fn register(client: &Client, spec: &NodeSpec) -> Result<()> {
    let mut labels = spec.labels.clone();
    labels.insert("kubernetes.io/hostname".into(), spec.name.clone());
    labels.insert("kubernetes.io/os".into(), "linux".into());
    labels.insert("kubernetes.io/arch".into(), "amd64".into());
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {},
    });
    let api: Api<NodeObject> = Api::all(client.clone());
    api.patch(
        &spec.name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&node),
    )
    .await
    .with_context(|| format!("registering node {}", spec.name))?;
    let resources = json!({"cpu": spec.cpu, "memory": spec.memory, "pods": "110"});
    let status = json!({"status": {
        "capacity": resources,
        "allocatable": resources,
        "addresses": [
            {"type": "InternalIP", "address": spec.host_ip},
            {"type": "Hostname", "address": spec.name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": spec.name, "systemUUID": spec.name, "bootID": spec.name,
            "kernelVersion": "", "osImage": "tandem e2e process kubelet",
            "containerRuntimeVersion": "e2e-process://1",
            "kubeletVersion": K8S_VERSION, "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64",
        },
    }});
    api.patch_status(&spec.name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .with_context(|| format!("node {} status", spec.name))?;
    Ok(())
}

/// Refresh the node's conditions (`Ready` True with a fresh heartbeat).
async fn post_status(client: &Client, name: &str, first: bool) -> Result<()> {
    let api: Api<NodeObject> = Api::all(client.clone());
    let now = Time(Timestamp::now());
    // Keep the transition time while Ready stays True.
    let current = api.get_status(name).await.ok();
    let ready_since = current
        .and_then(|n| n.status)
        .and_then(|s| s.conditions)
        .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
        .filter(|c| c.status == "True" && !first)
        .and_then(|c| c.last_transition_time)
        .unwrap_or_else(|| now.clone());
    let cond = |t: &str, status: &str, reason: &str, message: &str, since: &Time| {
        json!({"type": t, "status": status, "reason": reason, "message": message,
               "lastHeartbeatTime": now, "lastTransitionTime": since})
    };
    let patch = json!({"status": {"conditions": [
        cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available", &now),
        cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure", &now),
        cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available", &now),
        cond("Ready", "True", "KubeletReady", "kubelet is posting ready status", &ready_since),
    ]}});
    api.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .with_context(|| format!("node {name} heartbeat"))?;
    Ok(())
}

async fn renew_lease(client: &Client, node: &str) -> Result<()> {
    let api: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let now = MicroTime(Timestamp::now());
    match api.get_opt(node).await? {
        Some(mut lease) => {
            let spec = lease.spec.get_or_insert_with(Default::default);
            spec.renew_time = Some(now);
            spec.holder_identity = Some(node.to_string());
            spec.lease_duration_seconds = Some(40);
            api.replace(node, &PostParams::default(), &lease).await?;
        }
        None => {
            let lease: Lease = serde_json::from_value(json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": node, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": now},
            }))?;
            api.create(&PostParams::default(), &lease).await?;
        }
    }
    Ok(())
}

async fn heartbeat(ctx: Arc<NodeCtx>) {
    let mut last_status = tokio::time::Instant::now();
    let mut was_alive = true;
    loop {
        tokio::time::sleep(LEASE_RENEW).await;
        let alive = *ctx.alive.borrow();
        if !alive {
            was_alive = false;
            continue;
        }
        if let Err(e) = renew_lease(&ctx.client, &ctx.node_name).await {
            warn!(node = %ctx.node_name, "lease renewal failed: {e:#}");
        }
        if !was_alive || last_status.elapsed() >= STATUS_HEARTBEAT {
            match post_status(&ctx.client, &ctx.node_name, false).await {
                Ok(()) => {
                    last_status = tokio::time::Instant::now();
                    was_alive = true;
                }
                Err(e) => warn!(node = %ctx.node_name, "node status failed: {e:#}"),
            }
        }
    }
}

/// Start a worker per bound pod, feed workers their pod's latest object, and tell them
/// when it is gone. Nothing happens while the node is down.
async fn sync_loop(
    ctx: Arc<NodeCtx>,
    store: Store<Pod>,
    pods: Arc<Mutex<BTreeMap<String, PodEntry>>>,
) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if !*ctx.alive.borrow() {
            continue;
        }
        let current: BTreeMap<String, Arc<Pod>> = store
            .state()
            .into_iter()
            .filter_map(|p| p.metadata.uid.clone().map(|u| (u, p)))
            .collect();
        let mut pods = pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.retain(|_, e| !e.task.is_finished());
        for (uid, entry) in pods.iter() {
            match current.get(uid) {
                Some(p) => {
                    let changed = entry.tx.borrow().as_ref().map(|o| o.resource_version())
                        != Some(p.resource_version());
                    if changed {
                        entry.tx.send_replace(Some(p.clone()));
                    }
                }
                None => {
                    if entry.tx.borrow().is_some() {
                        entry.tx.send_replace(None);
                    }
                }
            }
        }
        for (uid, p) in &current {
            if pods.contains_key(uid) {
                continue;
            }
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            let finished = matches!(phase, Some("Succeeded" | "Failed"));
            if finished && p.metadata.deletion_timestamp.is_none() {
                // Terminal and not ours to run again.
                continue;
            }
            let ns = p.namespace().unwrap_or_default();
            let name = p.name_any();
            let dir = ctx.pod_dir(uid);
            let _ = std::fs::create_dir_all(&dir);
            let shared = Arc::new(PodShared {
                namespace: ns.clone(),
                name: name.clone(),
                uid: uid.clone(),
                pid: Default::default(),
                log: dir.join(format!("{ns}_{name}.log")),
            });
            let (tx, rx) = watch::channel(Some(p.clone()));
            let worker = Worker::new(ctx.clone(), shared.clone(), rx, p.clone());
            let task = tokio::spawn(worker.run());
            pods.insert(uid.clone(), PodEntry { shared, tx, task });
        }
    }
}
