//! A small scheduler (there is no kube-scheduler in the harness): binds each pending pod
//! to a node through the `pods/binding` subresource, as kube-scheduler does.
//!
//! A node is feasible when its `Ready` condition is True, it is not cordoned, every
//! NoSchedule/NoExecute taint is tolerated, the pod's `nodeSelector` matches its labels,
//! and the CPU and memory requests of its pods plus this one fit its allocatable. The
//! feasible node with the fewest pods wins (ties by name). A pod that fits nowhere gets
//! `PodScheduled=False` reason `Unschedulable` with a message per rejected node, and is
//! retried. Node affinity, pod (anti-)affinity and topology spread are not evaluated.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Result;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::task::JoinHandle;
use tracing::{info, warn};

pub struct Scheduler {
    tasks: Vec<JoinHandle<()>>,
}

impl Scheduler {
    pub async fn start(client: Client) -> Result<Scheduler> {
        let (nodes, node_writer) = reflector::store::<Node>();
        let (pods, pod_writer) = reflector::store::<Pod>();
        let nw = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .reflect(node_writer)
            .applied_objects()
            .for_each(|_| async {});
        let pw = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .reflect(pod_writer)
            .applied_objects()
            .for_each(|_| async {});
        let tasks = vec![
            tokio::spawn(nw),
            tokio::spawn(pw),
            tokio::spawn(schedule_loop(client, nodes, pods)),
        ];
        Ok(Scheduler { tasks })
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// CPU in millicores or memory in bytes.
pub fn parse_quantity(q: &Quantity, cpu: bool) -> Option<u128> {
    let s = q.0.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let n: f64 = num.parse().ok()?;
    let mult: f64 = match suffix {
        "" => 1.0,
        "m" => 0.001,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0f64.powi(4),
        _ => return None,
    };
    let v = n * mult * if cpu { 1000.0 } else { 1.0 };
    Some(v.ceil() as u128)
}

fn requests(pod: &Pod) -> (u128, u128) {
    let mut cpu = 0;
    let mut mem = 0;
    for c in pod.spec.iter().flat_map(|s| s.containers.iter()) {
        if let Some(r) = c.resources.as_ref().and_then(|r| r.requests.as_ref()) {
            cpu += r
                .get("cpu")
                .and_then(|q| parse_quantity(q, true))
                .unwrap_or(0);
            mem += r
                .get("memory")
                .and_then(|q| parse_quantity(q, false))
                .unwrap_or(0);
        }
    }
    (cpu, mem)
}

fn tolerates(tolerations: &[Toleration], taint: &Taint) -> bool {
    tolerations.iter().any(|t| {
        let key_ok = match (&t.key, t.operator.as_deref()) {
            (None, Some("Exists")) => true,
            (Some(k), _) => k == &taint.key,
            (None, _) => false,
        };
        let value_ok = t.operator.as_deref() == Some("Exists")
            || t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("");
        let effect_ok = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        key_ok && value_ok && effect_ok
    })
}

/// Why `node` cannot take `pod`, or `None` when it can.
pub fn reject(node: &Node, pod: &Pod, on_node: &[&Pod]) -> Option<String> {
    let status = node.status.clone().unwrap_or_default();
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return Some("node(s) were not ready".into());
    }
    let spec = node.spec.clone().unwrap_or_default();
    if spec.unschedulable == Some(true) {
        return Some("node(s) were unschedulable".into());
    }
    let pspec = pod.spec.clone().unwrap_or_default();
    let tolerations = pspec.tolerations.clone().unwrap_or_default();
    for taint in spec.taints.iter().flatten() {
        if (taint.effect == "NoSchedule" || taint.effect == "NoExecute")
            && !tolerates(&tolerations, taint)
        {
            return Some(format!(
                "node(s) had untolerated taint {{{}: {}}}",
                taint.key,
                taint.value.clone().unwrap_or_default()
            ));
        }
    }
    let labels = node.labels();
    for (k, v) in pspec.node_selector.iter().flatten() {
        if labels.get(k) != Some(v) {
            return Some("node(s) didn't match Pod's node affinity/selector".into());
        }
    }
    let alloc = status.allocatable.unwrap_or_default();
    let cap_cpu = alloc.get("cpu").and_then(|q| parse_quantity(q, true));
    let cap_mem = alloc.get("memory").and_then(|q| parse_quantity(q, false));
    let (mut cpu, mut mem) = requests(pod);
    for p in on_node {
        let (c, m) = requests(p);
        cpu += c;
        mem += m;
    }
    if cap_cpu.is_some_and(|cap| cpu > cap) {
        return Some("Insufficient cpu".into());
    }
    if cap_mem.is_some_and(|cap| mem > cap) {
        return Some("Insufficient memory".into());
    }
    None
}

fn is_active(p: &Pod) -> bool {
    !matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

async fn schedule_loop(client: Client, nodes: Store<Node>, pods: Store<Pod>) {
    if nodes.wait_until_ready().await.is_err() || pods.wait_until_ready().await.is_err() {
        return;
    }
    // Pods reported unschedulable, with the message written (written again only on change).
    let mut reported: BTreeMap<String, String> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let all_pods = pods.state();
        let mut all_nodes = nodes.state();
        all_nodes.sort_by_key(|n| n.name_any());
        let mut placed: BTreeMap<String, Vec<&Pod>> = BTreeMap::new();
        for p in &all_pods {
            if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone())
                && is_active(p)
            {
                placed.entry(n).or_default().push(p);
            }
        }
        for pod in all_pods.iter().filter(|p| {
            let spec = p.spec.as_ref();
            spec.is_some_and(|s| s.node_name.is_none())
                && spec
                    .and_then(|s| s.scheduler_name.as_deref())
                    .is_none_or(|n| n == "default-scheduler")
                && p.metadata.deletion_timestamp.is_none()
                && is_active(p)
        }) {
            let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
            let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
            let mut best: Option<(usize, String)> = None;
            for node in &all_nodes {
                let name = node.name_any();
                let on = placed.get(&name).cloned().unwrap_or_default();
                match reject(node, pod, &on) {
                    Some(why) => *reasons.entry(why).or_default() += 1,
                    None => {
                        if best.as_ref().is_none_or(|(n, _)| on.len() < *n) {
                            best = Some((on.len(), name));
                        }
                    }
                }
            }
            let api: Api<Pod> =
                Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
            match best {
                Some((_, node)) => {
                    let binding = json!({
                        "apiVersion": "v1", "kind": "Binding",
                        "metadata": {"name": pod.name_any(), "namespace": pod.namespace()},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                    });
                    match api
                        .create_subresource::<_, serde_json::Value>(
                            "binding",
                            &pod.name_any(),
                            &PostParams::default(),
                            &binding,
                        )
                        .await
                    {
                        Ok(_) => {
                            info!(pod = %key, %node, "bound");
                            reported.remove(&key);
                        }
                        Err(e) => warn!(pod = %key, %node, "binding failed: {e}"),
                    }
                }
                None => {
                    let detail: Vec<String> = reasons
                        .iter()
                        .map(|(why, n)| format!("{n} {why}"))
                        .collect();
                    let message = format!(
                        "0/{} nodes are available: {}.",
                        all_nodes.len(),
                        detail.join(", ")
                    );
                    if reported.get(&key) == Some(&message) {
                        continue;
                    }
                    let patch = json!({"status": {"conditions": [{
                        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": message,
                        "lastTransitionTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
                    }]}});
                    match api
                        .patch_status(
                            &pod.name_any(),
                            &PatchParams::default(),
                            &Patch::Strategic(&patch),
                        )
                        .await
                    {
                        Ok(_) => {
                            info!(pod = %key, "unschedulable: {message}");
                            reported.insert(key, message);
                        }
                        Err(e) => warn!(pod = %key, "reporting unschedulable: {e}"),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_like_the_api() {
        let q = |s: &str| Quantity(s.into());
        assert_eq!(parse_quantity(&q("2"), true), Some(2000));
        assert_eq!(parse_quantity(&q("500m"), true), Some(500));
        assert_eq!(parse_quantity(&q("1Gi"), false), Some(1 << 30));
        assert_eq!(parse_quantity(&q("512Mi"), false), Some(512 << 20));
        assert_eq!(parse_quantity(&q("1G"), false), Some(1_000_000_000));
        assert_eq!(parse_quantity(&q("nonsense"), false), None);
    }
}
