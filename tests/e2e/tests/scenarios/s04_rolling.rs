//! Scenario 4: editing the pod template rolls the groups, one co-restart at a time
//! (maxUnavailableGroups 1): polled all along, the client Service never lists fewer than
//! `GROUPS - 1` ready endpoints. Then `partition` holds low groups at their revision and
//! `paused` starts no update at all, until unpaused.
//!
//! The deployment sets `rollout.minReadySeconds` ([`MIN_READY_SECONDS`]): the operator
//! judges a group Ready from its pods, while the kubelet folds the opened gate into the
//! pod's `Ready` (~2 s on the real node) and the endpoint controller then adds the rebuilt
//! decode to the client Service's EndpointSlice; 5 s leaves room for that on a loaded
//! machine (docs/operations.md).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Result, ensure};
use serde_json::json;
use tandem_e2e::env::Env;

use crate::common::*;

const GROUPS: i32 = 3;

/// `rollout.minReadySeconds` of the scenario's deployment (see the module header).
const MIN_READY_SECONDS: i64 = 5;

fn patch_env(value: &str) -> serde_json::Value {
    json!([{"name": "TANDEM_THREADS", "value": "1"}, {"name": "E2E_EDIT", "value": value}])
}

async fn revisions(env: &Env, ns: &str, name: &str) -> Result<Vec<(i32, String, i64)>> {
    let mut out: Vec<(i32, String, i64)> = pods(env, ns, name)
        .await?
        .iter()
        .filter(|p| role(p) == "decode" && p.metadata.deletion_timestamp.is_none())
        .map(|p| (group(p), label(p, "tandem.dev/revision"), incarnation(p)))
        .collect();
    out.sort();
    Ok(out)
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s04", "pd");
    env.namespace(ns).await?;
    let mut pdd = spec(name, GROUPS);
    pdd["spec"]["rollout"]["minReadySeconds"] = json!(MIN_READY_SECONDS);
    env.kubectl.apply(ns, &yaml(&pdd)).await?;
    let p0 = wait_ready(env, ns, name, GROUPS, Duration::from_secs(240)).await?;
    let rev0 = p0
        .status
        .as_ref()
        .unwrap()
        .update_revision
        .clone()
        .unwrap_or_default();

    // Every group in the client Service first: the kubelet folds each opened gate into the
    // pod's Ready a moment after the operator reports the groups Ready.
    wait_ready_endpoints(env, ns, name, GROUPS as usize).await?;
    // Sample the client Service all through the scenario.
    let stop = Arc::new(AtomicBool::new(false));
    let min_ready = Arc::new(AtomicUsize::new(usize::MAX));
    let samples = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (stop, min_ready, samples) = (stop.clone(), min_ready.clone(), samples.clone());
        let client = env.cluster.client.clone();
        let ns = ns.to_string();
        let began = std::time::Instant::now();
        tokio::spawn(async move {
            let mut worst = String::new();
            let mut dip_start: Option<std::time::Instant> = None;
            let mut longest_dip = Duration::ZERO;
            while !stop.load(Ordering::SeqCst) {
                let lp = kube::api::ListParams::default()
                    .labels(&format!("kubernetes.io/service-name={name}"));
                if let Ok(slices) =
                    kube::Api::<k8s_openapi::api::discovery::v1::EndpointSlice>::namespaced(
                        client.clone(),
                        &ns,
                    )
                    .list(&lp)
                    .await
                {
                    let ready: Vec<String> = slices
                        .items
                        .iter()
                        .flat_map(|s| s.endpoints.iter())
                        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
                        .filter_map(|e| e.target_ref.as_ref().and_then(|r| r.name.clone()))
                        .collect();
                    samples.fetch_add(1, Ordering::SeqCst);
                    if ready.len() < min_ready.load(Ordering::SeqCst) {
                        // The whole sample: every endpoint with its conditions.
                        let all: Vec<String> = slices
                            .items
                            .iter()
                            .flat_map(|s| s.endpoints.iter())
                            .map(|e| {
                                let c = e.conditions.clone().unwrap_or_default();
                                format!(
                                    "{} ready={:?} serving={:?} terminating={:?}",
                                    e.target_ref
                                        .as_ref()
                                        .and_then(|r| r.name.clone())
                                        .unwrap_or_default(),
                                    c.ready,
                                    c.serving,
                                    c.terminating
                                )
                            })
                            .collect();
                        worst = format!(
                            "{} slices at {:.1}s into the scenario: {all:?}",
                            slices.items.len(),
                            began.elapsed().as_secs_f64()
                        );
                    }
                    min_ready.fetch_min(ready.len(), Ordering::SeqCst);
                    if ready.len() < (GROUPS - 1) as usize {
                        let start = *dip_start.get_or_insert_with(std::time::Instant::now);
                        longest_dip = longest_dip.max(start.elapsed());
                    } else {
                        dip_start = None;
                    }
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            (worst, longest_dip)
        })
    };

    // 1. An edit rolls every group, one at a time.
    let edit = json!({"spec": {"decode": {"template": {"env": patch_env("1")}}}});
    merge_patch_pdd(env, ns, name, &edit).await?;
    let p1 = wait_ready(env, ns, name, GROUPS, Duration::from_secs(240)).await?;
    let rev1 = p1
        .status
        .as_ref()
        .unwrap()
        .update_revision
        .clone()
        .unwrap_or_default();
    ensure!(rev1 != rev0, "the edit did not change the revision");
    let st = p1.status.as_ref().unwrap();
    ensure!(
        st.current_revision.as_deref() == Some(rev1.as_str()),
        "current revision not advanced"
    );
    for (g, rev, inc) in revisions(env, ns, name).await? {
        ensure!(
            rev == rev1 && inc == 2,
            "group {g} at revision {rev}, incarnation {inc}"
        );
    }
    let lowest = min_ready.load(Ordering::SeqCst);
    figure(
        "rolling update: fewest ready client endpoints seen",
        format!(
            "{lowest} of {GROUPS} ({} samples)",
            samples.load(Ordering::SeqCst)
        ),
    );

    // 2. partition 2: only group 2 moves to the next revision.
    let edit = json!({"spec": {"rollout": {"partition": 2},
                               "decode": {"template": {"env": patch_env("2")}}}});
    merge_patch_pdd(env, ns, name, &edit).await?;
    let rev2 = tandem_e2e::wait::until_seen(
        "group 2 at the new revision, groups 0 and 1 held",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let p = get_pdd(env, ns, name).await?;
            let st = p.status.clone().unwrap_or_default();
            let rev2 = st.update_revision.clone().unwrap_or_default();
            let revs = revisions(env, ns, name).await?;
            let done = rev2 != rev1
                && st.updated_groups == 1
                && st.ready_groups == GROUPS
                && revs.len() == GROUPS as usize
                && revs
                    .iter()
                    .all(|(g, r, _)| if *g >= 2 { *r == rev2 } else { *r == rev1 });
            Ok(if done { Ok(rev2) } else { Err(revs) })
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    for (g, rev, inc) in revisions(env, ns, name).await? {
        if g < 2 {
            ensure!(
                rev == rev1 && inc == 2,
                "group {g} below the partition moved: {rev} @{inc}"
            );
        }
    }

    // 3. paused (and the partition lifted): nothing starts.
    let edit = json!({"spec": {"rollout": {"partition": 0, "paused": true}}});
    merge_patch_pdd(env, ns, name, &edit).await?;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let p = get_pdd(env, ns, name).await?;
    ensure!(
        cond(&p, "Progressing") == Some(("False".into(), "Paused".into())),
        "Progressing while paused: {:?}",
        cond(&p, "Progressing")
    );
    for (g, rev, _) in revisions(env, ns, name).await? {
        let want = if g >= 2 { &rev2 } else { &rev1 };
        ensure!(&rev == want, "group {g} rolled while paused");
    }

    // 4. unpaused: the held groups roll too.
    let edit = json!({"spec": {"rollout": {"paused": false}}});
    merge_patch_pdd(env, ns, name, &edit).await?;
    wait_ready(env, ns, name, GROUPS, Duration::from_secs(240)).await?;
    for (g, rev, _) in revisions(env, ns, name).await? {
        ensure!(rev == rev2, "group {g} at {rev} after unpausing");
    }

    stop.store(true, Ordering::SeqCst);
    let (worst, longest_dip) = sampler.await?;
    let lowest = min_ready.load(Ordering::SeqCst);
    figure(
        "whole scenario: fewest ready client endpoints seen",
        format!(
            "{lowest} of {GROUPS}; longest time below {}: {:.1}s",
            GROUPS - 1,
            longest_dip.as_secs_f64()
        ),
    );
    if lowest < (GROUPS - 1) as usize {
        // Why the kubelet took the endpoints out: a status code is the member's own
        // not-ready, a deadline a process that did not answer within the probe's timeout.
        let probes = probe_failures(env, ns).await.unwrap_or_default();
        anyhow::bail!(
            "more than one group was out of the client Service (for {:.1}s, with \
             minReadySeconds {MIN_READY_SECONDS}): {worst}; readiness probe failures: {probes:?}",
            longest_dip.as_secs_f64(),
        );
    }

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
