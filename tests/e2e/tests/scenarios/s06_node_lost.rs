//! Scenario 6: the node running a group stops heartbeating: its kubelet hangs (SIGSTOP),
//! its containers keep running. The node lifecycle controller marks the node NotReady and
//! the pods not Ready; the operator co-restarts the group; the deletions hang because
//! nobody on that node confirms them, so the operator force-deletes the pods once their
//! grace period and a margin have passed (the short grace of a member on a lost node,
//! `health.unresponsiveGraceSeconds`, not the pod's 30 s), and the group is rebuilt on the other node. When
//! the kubelet resumes, it stops the containers of the pods that were removed meanwhile.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use tandem_e2e::env::{Env, NODE_A, NODE_B};
use tandem_e2e::wait;

use crate::common::*;

fn node_of(p: &Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s06", "pd");
    env.namespace(ns).await?;

    // Place the group on node B.
    env.kubectl.ok(&["cordon", NODE_A]).await?;
    let placed = async {
        env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
        wait_ready(env, ns, name, 1, Duration::from_secs(180)).await
    }
    .await;
    env.kubectl.ok(&["uncordon", NODE_A]).await?;
    let p = placed?;
    let inc = p.status.as_ref().unwrap().group_statuses[0].incarnation;
    let old = pods(env, ns, name).await?;
    ensure!(
        old.iter().all(|p| node_of(p) == NODE_B),
        "pods not on {NODE_B}: {:?}",
        old.iter()
            .map(|p| (p.name_any(), node_of(p)))
            .collect::<Vec<_>>()
    );
    let old_pids: Vec<i32> = old.iter().filter_map(|p| env.container_pid(p)).collect();
    ensure!(old_pids.len() == 2, "both containers run");

    let rec = PodRecorder::start(env, ns).await;
    // A steady client through the client Service (the per-request columns of the recovery
    // table): the lost node's containers run on, unreachable to the control plane.
    let load = start_load_through(&service_ip(env, ns, name).await?).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at = load.now();
    let lost = Instant::now();
    env.node(NODE_B).freeze_kubelet()?;
    let result = async {
        wait::until(
            "node B to turn NotReady",
            Duration::from_secs(60),
            Duration::from_millis(500),
            || async {
                let n = env.kubectl.json(&["get", "node", NODE_B]).await?;
                let ready = n["status"]["conditions"]
                    .as_array()
                    .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
                    .map(|c| c["status"].as_str().unwrap_or("").to_string());
                Ok((ready.as_deref() != Some("True")).then_some(()))
            },
        )
        .await?;
        figure(
            "heartbeats stopped → node NotReady",
            format!("{:.1}s", lost.elapsed().as_secs_f64()),
        );

        wait::until(
            "the co-restart of the group on the lost node",
            Duration::from_secs(90),
            Duration::from_millis(500),
            || async {
                let p = get_pdd(env, ns, name).await?;
                let g = p
                    .status
                    .as_ref()
                    .and_then(|s| s.group_statuses.first().cloned());
                Ok(g.filter(|g| g.incarnation > inc).map(|_| ()))
            },
        )
        .await?;
        figure(
            "heartbeats stopped → co-restart decided",
            format!("{:.1}s", lost.elapsed().as_secs_f64()),
        );
        // What the operator saw of the lost node's pods when it decided (their readiness
        // conditions: a pod there counts as node-lost by them).
        for p in &old {
            let now = env
                .kubectl
                .json(&["get", "pod", &p.name_any(), "-n", ns])
                .await?;
            let conds: Vec<String> = now["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| format!("{}={} ({})", c["type"], c["status"], c["reason"]))
                .collect();
            say(format!(
                "    {} at the decision: {}",
                p.name_any(),
                conds.join(", ")
            ));
        }
        let p = wait_ready(env, ns, name, 1, Duration::from_secs(240)).await?;
        figure(
            "heartbeats stopped → group Ready on the other node",
            format!("{:.1}s", lost.elapsed().as_secs_f64()),
        );
        report_load(load, at, "node lost, requests through the client Service").await;
        let g = &p.status.as_ref().unwrap().group_statuses[0];
        ensure!(
            g.incarnation == inc + 1,
            "incarnation {} after the node loss",
            g.incarnation
        );
        let now = pods(env, ns, name).await?;
        ensure!(
            now.iter().all(|p| node_of(p) == NODE_A),
            "rebuilt pods not on {NODE_A}: {:?}",
            now.iter()
                .map(|p| (p.name_any(), node_of(p)))
                .collect::<Vec<_>>()
        );
        // The old pods were removed from the API while their node was still down.
        for p in &old {
            rec.first(|c| c.pod == p.name_any() && c.what == Change::Deleted)
                .with_context(|| format!("{} was never removed", p.name_any()))?;
        }
        let evs = events(env, ns, name).await?;
        ensure!(
            evs.iter()
                .any(|e| e.reason.as_deref() == Some("PodForceDeleted")),
            "no PodForceDeleted event: {:?}",
            evs.iter().map(|e| e.reason.clone()).collect::<Vec<_>>()
        );
        ensure!(
            evs.iter()
                .any(|e| e.reason.as_deref() == Some("UnresponsiveMemberDeleted")),
            "the lost node's pods were not deleted with the short grace: {:?}",
            evs.iter().map(|e| e.reason.clone()).collect::<Vec<_>>()
        );
        // The orphaned containers still run on the hung node…
        ensure!(
            old_pids
                .iter()
                .all(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists()),
            "the hung node's containers should still run"
        );
        anyhow::Ok(())
    }
    .await;

    // …until its kubelet resumes and stops them.
    env.node(NODE_B).thaw_kubelet()?;
    let resumed = Instant::now();
    result?;
    wait::until(
        "the resumed kubelet to stop the removed pods' containers",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || async {
            Ok(old_pids
                .iter()
                .all(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .map(|s| s.contains(") Z "))
                        .unwrap_or(true)
                })
                .then_some(()))
        },
    )
    .await?;
    figure(
        "kubelet resumed → orphaned containers stopped",
        format!("{:.1}s", resumed.elapsed().as_secs_f64()),
    );
    wait_ready(env, ns, name, 1, Duration::from_secs(30)).await?;

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
