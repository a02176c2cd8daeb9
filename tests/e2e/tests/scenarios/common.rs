//! What the scenarios share: the test PDDeployment, reading its status, pods and
//! endpoints, chat requests, and a recorder of every pod change in a namespace.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tandem_e2e::env::Env;
use tandem_e2e::{http, wait};
use tandem_operator::crd::PDDeployment;
use tokio::task::JoinHandle;

pub const MODEL_PATH: &str = "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_NAME: &str = "smollm2";
pub const HTTP_PORT: u16 = 8000;

pub fn init_logging(run_dir: &Path) {
    let file = std::fs::File::create(run_dir.join("harness.log")).expect("harness log");
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,kube=warn,hyper=warn,tower=warn")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Mutex::new(file))
        .with_ansi(false)
        .init();
}

/// The dataplane image every scenario's pods run: the chart's name and tag, imported into
/// each node from `target/images`.
pub fn dataplane_image() -> String {
    format!("ghcr.io/tandem/dataplane:{}", env!("CARGO_PKG_VERSION"))
}

/// The scenarios' PDDeployment: the example's shape with short probe periods and
/// windows, a small KV cache and one compute thread per process (two cores for the
/// whole suite). Requests are small: each node offers the machine's two CPUs, and up to
/// eight dataplane pods run at once.
pub fn spec(name: &str, groups: i32) -> Value {
    let role = json!({
        "replicas": 1,
        "template": {
            "image": dataplane_image(),
            "env": [{"name": "TANDEM_THREADS", "value": "1"}],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        },
        "args": ["--kv-blocks", "64", "--max-batch", "4", "--drain-seconds", "2"],
    });
    json!({
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "name": MODEL_NAME,
                "path": MODEL_PATH,
                "volume": {"claimName": "models", "mountPath": "/models"},
            },
            "groups": groups,
            "prefill": role.clone(),
            "decode": role,
            "transfer": {"bootstrapTimeoutSeconds": 5, "kvTimeoutSeconds": 10},
            "health": {"probePeriodSeconds": 1, "failureThreshold": 2, "coRestartAfterSeconds": 6},
            "restart": {"backoff": {"baseSeconds": 1, "maxSeconds": 4}},
            "rollout": {"maxUnavailableGroups": 1},
        },
    })
}

pub fn yaml(v: &Value) -> String {
    serde_yaml::to_string(v).expect("yaml")
}

pub async fn get_pdd(env: &Env, ns: &str, name: &str) -> Result<PDDeployment> {
    Ok(
        Api::<PDDeployment>::namespaced(env.cluster.client.clone(), ns)
            .get(name)
            .await?,
    )
}

/// `kubectl patch pdd NAME --type merge -p PATCH`, as a user edits a deployment.
pub async fn merge_patch_pdd(env: &Env, ns: &str, name: &str, patch: &Value) -> Result<()> {
    env.kubectl
        .ok(&[
            "patch",
            "pdd",
            name,
            "-n",
            ns,
            "--type",
            "merge",
            "-p",
            &patch.to_string(),
        ])
        .await?;
    Ok(())
}

fn condition<'a>(
    p: &'a PDDeployment,
    t: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    p.status.as_ref()?.conditions.iter().find(|c| c.type_ == t)
}

/// `(status, reason)` of a condition of the deployment.
pub fn cond(p: &PDDeployment, t: &str) -> Option<(String, String)> {
    condition(p, t).map(|c| (c.status.clone(), c.reason.clone()))
}

/// Wait until `groups` groups are Ready at the update revision and the rollout is complete.
pub async fn wait_ready(
    env: &Env,
    ns: &str,
    name: &str,
    groups: i32,
    within: Duration,
) -> Result<PDDeployment> {
    wait::until_seen(
        &format!("{ns}/{name}: {groups} groups Ready"),
        within,
        Duration::from_millis(500),
        || async {
            let p = get_pdd(env, ns, name).await?;
            let s = p.status.clone().unwrap_or_default();
            let done = s.ready_groups == groups
                && s.groups == groups
                && s.updated_groups == groups
                && cond(&p, "Progressing").map(|c| c.1).as_deref() == Some("Complete")
                && s.observed_generation == p.metadata.generation;
            let phases: Vec<String> = s
                .group_statuses
                .iter()
                .map(|g| {
                    format!(
                        "g{}:{:?}@{} {}",
                        g.index,
                        g.phase,
                        g.incarnation,
                        g.message.clone().unwrap_or_default()
                    )
                })
                .collect();
            Ok(if done { Ok(p) } else { Err(phases) })
        },
    )
    .await
}

pub async fn pods(env: &Env, ns: &str, name: &str) -> Result<Vec<Pod>> {
    let lp = ListParams::default().labels(&format!("tandem.dev/deployment={name}"));
    Ok(Api::<Pod>::namespaced(env.cluster.client.clone(), ns)
        .list(&lp)
        .await?
        .items)
}

pub fn label(p: &Pod, k: &str) -> String {
    p.labels().get(k).cloned().unwrap_or_default()
}

pub fn role(p: &Pod) -> String {
    label(p, "tandem.dev/role")
}

pub fn group(p: &Pod) -> i32 {
    label(p, "tandem.dev/group").parse().unwrap_or(-1)
}

pub fn incarnation(p: &Pod) -> i64 {
    label(p, "tandem.dev/incarnation").parse().unwrap_or(-1)
}

pub fn pod_ip(p: &Pod) -> Option<String> {
    p.status.as_ref()?.pod_ip.clone()
}

/// The kubelet's account of the pod's ended container: (reason, exit code).
pub fn terminated(p: &Pod) -> Option<(String, i32)> {
    let t = p
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .terminated
        .clone()?;
    Some((t.reason.unwrap_or_default(), t.exit_code))
}

pub fn pod_condition(p: &Pod, t: &str) -> Option<String> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == t)
        .map(|c| c.status.clone())
}

/// The one live (not terminating) pod of `role` in `group`.
pub async fn member(env: &Env, ns: &str, name: &str, g: i32, r: &str) -> Result<Pod> {
    let all = pods(env, ns, name).await?;
    let live: Vec<Pod> = all
        .into_iter()
        .filter(|p| group(p) == g && role(p) == r && p.metadata.deletion_timestamp.is_none())
        .collect();
    match live.as_slice() {
        [p] => Ok(p.clone()),
        _ => bail!(
            "expected one live {r} pod in group {g}, found {:?}",
            live.iter().map(|p| p.name_any()).collect::<Vec<_>>()
        ),
    }
}

/// The key of group `g` of deployment `name`, as the operator keeps it in the group's
/// Secret (what signs the admin calls of an in-place reset).
pub async fn group_key(env: &Env, ns: &str, name: &str, g: i32) -> Result<String> {
    let key = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(env.cluster.client.clone(), ns)
        .get(&format!("{name}-g{g}-key"))
        .await?
        .data
        .and_then(|d| d.get("key").cloned())
        .context("the group key")?;
    String::from_utf8(key.0).context("the group key is text")
}

/// The ClusterIP of Service `svc`.
pub async fn service_ip(env: &Env, ns: &str, svc: &str) -> Result<String> {
    let v = env.kubectl.json(&["get", "service", svc, "-n", ns]).await?;
    Ok(v["spec"]["clusterIP"]
        .as_str()
        .with_context(|| format!("Service {ns}/{svc} has a ClusterIP"))?
        .to_string())
}

/// Once the router of `spec.router` has a Ready pod and, through its Service, routes to
/// `groups` Ready groups (its `/ready` body's endpoints; the router is Ready as soon as it
/// has read the deployment, Ready groups or not): its Service's ClusterIP.
pub async fn router_ip(env: &Env, ns: &str, name: &str, groups: usize) -> Result<String> {
    let api: Api<Pod> = Api::namespaced(env.cluster.client.clone(), ns);
    let lp = ListParams::default().labels(&format!("tandem.dev/router={name}"));
    wait::until(
        "the router pod to be Ready",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let pods = api.list(&lp).await?;
            Ok(pods
                .items
                .iter()
                .any(|p| pod_condition(p, "Ready").as_deref() == Some("True"))
                .then_some(()))
        },
    )
    .await?;
    let ip = service_ip(env, ns, &format!("{name}-router")).await?;
    let addr = format!("{ip}:{HTTP_PORT}");
    wait::until(
        &format!("the router to route to {groups} Ready group(s)"),
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let Ok(r) = http::get(&addr, "/ready", Duration::from_secs(2)).await else {
                return Ok(None);
            };
            let v: Value = serde_json::from_str(&r.body).unwrap_or_default();
            let routed = v["endpoints"].as_array().map_or(0, Vec::len);
            Ok((r.status == 200 && routed >= groups).then_some(()))
        },
    )
    .await?;
    Ok(ip)
}

/// An endpoint of a Service as the EndpointSlice controller publishes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    pub ip: String,
    pub pod: String,
    pub ready: bool,
}

pub async fn endpoints(env: &Env, ns: &str, service: &str) -> Result<Vec<Endpoint>> {
    let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={service}"));
    let slices = Api::<EndpointSlice>::namespaced(env.cluster.client.clone(), ns)
        .list(&lp)
        .await?;
    let mut out = Vec::new();
    for s in slices.items {
        for e in s.endpoints {
            let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            let pod = e
                .target_ref
                .as_ref()
                .and_then(|r| r.name.clone())
                .unwrap_or_default();
            for ip in e.addresses {
                out.push(Endpoint {
                    ip,
                    pod: pod.clone(),
                    ready,
                });
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Ready endpoints' pod names.
pub async fn ready_endpoint_pods(env: &Env, ns: &str, service: &str) -> Result<Vec<String>> {
    Ok(endpoints(env, ns, service)
        .await?
        .into_iter()
        .filter(|e| e.ready)
        .map(|e| e.pod)
        .collect())
}

/// Wait (at most 15 s) until `service` lists exactly `n` ready endpoints. The endpoint
/// controller publishes a group's decode a moment after the operator opens its gate (the
/// lag `rollout.minReadySeconds` covers in scenario 4), so a check right after the groups
/// turn Ready can see one fewer.
pub async fn wait_ready_endpoints(env: &Env, ns: &str, service: &str, n: usize) -> Result<()> {
    wait::until_seen(
        &format!("{n} ready endpoints in Service {service}"),
        Duration::from_secs(15),
        Duration::from_millis(200),
        || async {
            let ready = ready_endpoint_pods(env, ns, service).await?;
            Ok(if ready.len() == n { Ok(()) } else { Err(ready) })
        },
    )
    .await
}

/// One chat completion against `ip:8000` for the scenarios' model name.
pub async fn chat(ip: &str, timeout: Duration) -> Result<String> {
    chat_model(ip, MODEL_NAME, timeout).await
}

/// One chat completion against `ip:8000`; returns the answer's text.
pub async fn chat_model(ip: &str, model: &str, timeout: Duration) -> Result<String> {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let r = http::post_json(
        &format!("{ip}:{HTTP_PORT}"),
        "/v1/chat/completions",
        &body,
        timeout,
    )
    .await?;
    ensure!(
        r.status == 200,
        "chat at {ip}: HTTP {}: {}",
        r.status,
        r.body
    );
    let v: Value = serde_json::from_str(&r.body).context("chat response")?;
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    ensure!(
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0) > 0,
        "chat at {ip}: no tokens generated: {}",
        r.body
    );
    Ok(text)
}

/// The steady client of the recovery figures: a chat every 0.5 s, 15 s timeout each (a
/// lighter load than the local benchmark's: the cluster shares two cores with the
/// scenarios beside it).
pub const LOAD_PERIOD: Duration = Duration::from_millis(500);
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(15);

/// A steady client (see [`tandem_e2e::load`]) of short chats against `ip:8000`. Each
/// chat's prompt begins with its own number, so no two share a first block: a router
/// balances them by load (shared prefixes would keep them on the decode that holds them).
pub fn start_load(ip: &str) -> tandem_e2e::load::Load {
    let chat = |n: u64| {
        json!({
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": format!("Request {n}.")},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            "max_tokens": 4,
            "temperature": 0,
        })
    };
    tandem_e2e::load::Load::start(
        &format!("{ip}:{HTTP_PORT}"),
        "/v1/chat/completions",
        chat,
        LOAD_PERIOD,
        LOAD_TIMEOUT,
    )
}

/// A steady client through `ip` (a Service's ClusterIP), started once a chat through it
/// has been answered: a Service routes only once its EndpointSlice lists a ready pod and
/// kube-proxy has followed, which can lag the group's Ready by a moment.
pub async fn start_load_through(ip: &str) -> Result<tandem_e2e::load::Load> {
    wait::until(
        &format!("a chat through {ip}"),
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async { Ok(chat(ip, Duration::from_secs(10)).await.ok()) },
    )
    .await?;
    Ok(start_load(ip))
}

/// Stop `load` 2 s from now (served again for a while) and print the per-request columns
/// of the requests `fault` (an offset on its clock) could touch as a figure, with how the
/// requests answered before it went (they should all have been served).
pub async fn report_load(load: tandem_e2e::load::Load, fault: Duration, what: &str) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let samples = load.stop().await;
    let before: Vec<_> = samples.iter().filter(|s| s.ended < fault).collect();
    let ok = before
        .iter()
        .filter(|s| s.outcome == tandem_e2e::load::Outcome::Ok)
        .count();
    figure(
        what,
        format!(
            "{} (before the fault: {ok} of {} answered)",
            tandem_e2e::load::recovery(&samples, fault, LOAD_TIMEOUT),
            before.len()
        ),
    );
}

/// Events (events.k8s.io) about the deployment, oldest first.
pub async fn events(env: &Env, ns: &str, name: &str) -> Result<Vec<Event>> {
    let mut evs: Vec<Event> = Api::<Event>::namespaced(env.cluster.client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect();
    evs.sort_by_key(|e| {
        e.event_time
            .as_ref()
            .map(|t| t.0)
            .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0))
    });
    Ok(evs)
}

/// The kubelet's readiness-probe failures in `ns` (its `Unhealthy` Events), oldest first,
/// one line each: the pod, how many times, and what the probe got — a status code
/// (the member said not ready) or a deadline (the process did not answer in time).
pub async fn probe_failures(env: &Env, ns: &str) -> Result<Vec<String>> {
    let mut evs: Vec<Event> = Api::<Event>::namespaced(env.cluster.client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Unhealthy"))
        .collect();
    evs.sort_by_key(|e| e.metadata.creation_timestamp.as_ref().map(|t| t.0));
    Ok(evs
        .iter()
        .map(|e| {
            format!(
                "{} ×{}: {}",
                e.regarding
                    .as_ref()
                    .and_then(|r| r.name.clone())
                    .unwrap_or_default(),
                e.deprecated_count
                    .or(e.series.as_ref().map(|s| s.count))
                    .unwrap_or(1),
                e.note.as_deref().unwrap_or_default()
            )
        })
        .collect())
}

/// One observed pod change.
#[derive(Debug, Clone)]
pub struct PodChange {
    pub pod: String,
    pub group: i32,
    pub role: String,
    pub incarnation: i64,
    pub what: Change,
    /// When the watch delivered it.
    pub at: std::time::Instant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Added,
    /// `deletionTimestamp` first seen.
    Terminating,
    /// `ContainersReady` turned True / False.
    ContainersReady(bool),
    /// The kubelet reported the container terminated: reason, exit code.
    Terminated(String, i32),
    /// Gone from the API.
    Deleted,
}

/// Records every pod change in a namespace from a watch, in order.
pub struct PodRecorder {
    pub log: Arc<Mutex<Vec<PodChange>>>,
    task: JoinHandle<()>,
}

impl PodRecorder {
    /// Start watching; returns once the initial list has been recorded.
    pub async fn start(env: &Env, ns: &str) -> PodRecorder {
        let api = Api::<Pod>::namespaced(env.cluster.client.clone(), ns);
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut synced_tx = Some(synced_tx);
            let mut seen: BTreeMap<String, (bool, Option<bool>, bool)> = BTreeMap::new();
            let mut stream = watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = stream.next().await {
                let (pod, deleted) = match ev {
                    Ok(watcher::Event::Apply(p)) | Ok(watcher::Event::InitApply(p)) => (p, false),
                    Ok(watcher::Event::Delete(p)) => (p, true),
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = synced_tx.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    _ => continue,
                };
                let push = |what| {
                    sink.lock().unwrap().push(PodChange {
                        pod: pod.name_any(),
                        group: group(&pod),
                        role: role(&pod),
                        incarnation: incarnation(&pod),
                        what,
                        at: std::time::Instant::now(),
                    })
                };
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let entry = seen.entry(uid.clone());
                let state = match entry {
                    std::collections::btree_map::Entry::Vacant(v) => {
                        push(Change::Added);
                        v.insert((false, None, false))
                    }
                    std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                };
                if pod.metadata.deletion_timestamp.is_some() && !state.0 {
                    state.0 = true;
                    push(Change::Terminating);
                }
                let cr = pod_condition(&pod, "ContainersReady").map(|s| s == "True");
                if cr.is_some() && cr != state.1 {
                    state.1 = cr;
                    push(Change::ContainersReady(cr.unwrap_or(false)));
                }
                if !state.2
                    && let Some((reason, code)) = terminated(&pod)
                {
                    state.2 = true;
                    push(Change::Terminated(reason, code));
                }
                if deleted {
                    push(Change::Deleted);
                }
            }
        });
        let _ = tokio::time::timeout(Duration::from_secs(30), synced_rx).await;
        PodRecorder { log, task }
    }

    pub fn changes(&self) -> Vec<PodChange> {
        self.log.lock().unwrap().clone()
    }

    /// First change matching `f` (index and change).
    pub fn first(&self, f: impl Fn(&PodChange) -> bool) -> Option<(usize, PodChange)> {
        self.changes().into_iter().enumerate().find(|(_, c)| f(c))
    }
}

impl Drop for PodRecorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a scenario says (figures, events), kept until it ends: two lanes of scenarios run
/// side by side, and each scenario's lines are printed together with its result.
#[derive(Default, Clone)]
pub struct Said(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Said {
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

tokio::task_local! {
    static SAID: Said;
}

/// Run `f` with what it says kept in `said` (see [`say`]).
pub async fn capture<F: std::future::Future>(said: &Said, f: F) -> F::Output {
    SAID.scope(said.clone(), f).await
}

/// One line of the suite's report: kept with the scenario that says it (printed when it
/// ends), printed at once outside a scenario (or from a task it spawned).
pub fn say(line: String) {
    let kept = SAID.try_with(|s| {
        s.0.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(line.clone())
    });
    if kept.is_err() {
        println!("{line}");
    }
}

/// A figure line the report quotes (stdout of the suite).
pub fn figure(what: &str, value: impl std::fmt::Display) {
    say(format!("    figure: {what}: {value}"));
}
