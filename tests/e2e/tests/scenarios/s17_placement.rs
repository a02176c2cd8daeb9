//! Scenario 17: scheduling fields of the pod template reach the pods and the real
//! scheduler acts on them. The prefills spread one per zone (topologySpreadConstraints,
//! DoNotSchedule) and are placed by a second scheduler profile (schedulerName); each
//! decode follows its own group's prefill into its zone (podAffinity with
//! matchLabelKeys on the group label); every pod gets the PriorityClass's priority.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::json;
use tandem_e2e::cluster::SECOND_SCHEDULER;
use tandem_e2e::env::{Env, ZONE_LABEL};

use crate::common::*;

const PRIORITY_CLASS: &str = "tandem-e2e-serving";
const PRIORITY: i32 = 100_000;

fn node_of(p: &Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s17", "pd");
    env.namespace(ns).await?;
    env.kubectl
        .apply(
            ns,
            &format!(
                "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata: {{name: {PRIORITY_CLASS}}}\nvalue: {PRIORITY}\ndescription: e2e scenario 17\n"
            ),
        )
        .await?;
    let mut s = spec(name, 2);
    let prefill_selector = json!({"matchLabels": {"tandem.dev/role": "prefill"}});
    s["spec"]["prefill"]["template"]["topologySpreadConstraints"] = json!([{
        "maxSkew": 1,
        "topologyKey": ZONE_LABEL,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": prefill_selector,
        "matchLabelKeys": ["tandem.dev/deployment"],
    }]);
    s["spec"]["prefill"]["template"]["schedulerName"] = json!(SECOND_SCHEDULER);
    s["spec"]["decode"]["template"]["affinity"] = json!({"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": prefill_selector,
            "matchLabelKeys": ["tandem.dev/deployment", "tandem.dev/group"],
            "topologyKey": ZONE_LABEL,
        }],
    }});
    s["spec"]["decode"]["template"]["schedulerName"] = json!("default-scheduler");
    for role in ["prefill", "decode"] {
        s["spec"][role]["template"]["priorityClassName"] = json!(PRIORITY_CLASS);
    }
    env.kubectl.apply(ns, &yaml(&s)).await?;
    wait_ready(env, ns, name, 2, Duration::from_secs(240)).await?;

    let nodes = env.kubectl.json(&["get", "nodes"]).await?;
    let zone_of: BTreeMap<String, String> = nodes["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|n| {
            (
                n["metadata"]["name"].as_str().unwrap_or("").to_string(),
                n["metadata"]["labels"][ZONE_LABEL]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
            )
        })
        .collect();
    let all = pods(env, ns, name).await?;
    let mut prefill_zones = Vec::new();
    for g in [0, 1] {
        let p = member(env, ns, name, g, "prefill").await?;
        let d = member(env, ns, name, g, "decode").await?;
        let (pz, dz) = (
            zone_of.get(&node_of(&p)).cloned().unwrap_or_default(),
            zone_of.get(&node_of(&d)).cloned().unwrap_or_default(),
        );
        figure(
            &format!("group {g} placement"),
            format!(
                "prefill on {} ({pz}), decode on {} ({dz})",
                node_of(&p),
                node_of(&d)
            ),
        );
        ensure!(
            !pz.is_empty() && pz == dz,
            "group {g}: decode in {dz:?}, its prefill in {pz:?}"
        );
        prefill_zones.push(pz);
        let sched = |p: &Pod| p.spec.as_ref().and_then(|s| s.scheduler_name.clone());
        ensure!(
            sched(&p).as_deref() == Some(SECOND_SCHEDULER)
                && sched(&d).as_deref() == Some("default-scheduler"),
            "schedulerName not passed through: prefill {:?}, decode {:?}",
            sched(&p),
            sched(&d)
        );
    }
    ensure!(
        prefill_zones[0] != prefill_zones[1],
        "the two prefills share zone {} despite the spread constraint",
        prefill_zones[0]
    );
    for p in &all {
        let spec = p.spec.as_ref().context("pod spec")?;
        ensure!(
            spec.priority == Some(PRIORITY)
                && spec.priority_class_name.as_deref() == Some(PRIORITY_CLASS),
            "pod {} has priority {:?} ({:?})",
            p.name_any(),
            spec.priority,
            spec.priority_class_name
        );
    }
    // The second profile placed the prefills: its Scheduled events say so.
    let evs = env
        .kubectl
        .json(&["get", "events.events.k8s.io", "-n", ns])
        .await?;
    for g in [0, 1] {
        let p = member(env, ns, name, g, "prefill").await?.name_any();
        let by = evs["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .find(|e| e["reason"] == "Scheduled" && e["regarding"]["name"] == p.as_str())
            .map(|e| e["reportingController"].as_str().unwrap_or("").to_string());
        ensure!(
            by.as_deref() == Some(SECOND_SCHEDULER),
            "prefill {p} was scheduled by {by:?}, not {SECOND_SCHEDULER}"
        );
    }
    for g in [0, 1] {
        let ip = pod_ip(&member(env, ns, name, g, "decode").await?).context("decode IP")?;
        chat(&ip, Duration::from_secs(60)).await?;
    }

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    env.kubectl
        .ok(&["delete", "priorityclass", PRIORITY_CLASS])
        .await?;
    Ok(())
}
