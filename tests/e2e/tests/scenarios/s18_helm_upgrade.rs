//! Scenario 18: an upgrade as a user runs it. `helm upgrade` moves the operator to a new
//! image tag (the Deployment rolls its two replicas; one leads again), then the
//! PDDeployment's dataplane image moves to the same tag: the groups roll one at a time,
//! prefill first within each (old decode gone before its prefill is deleted, new prefill
//! Ready before the new decode exists). A client calling the client Service's ClusterIP
//! (through kube-proxy) all along sees no failed request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::json;
use tandem_e2e::env::Env;
use tandem_e2e::images::UPGRADE_SUFFIX;
use tandem_e2e::operator;

use crate::common::*;

const GROUPS: i32 = 2;

fn image_of(p: &k8s_openapi::api::core::v1::Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s18", "pd");
    env.namespace(ns).await?;
    let mut pdd = spec(name, GROUPS);
    // As the example: the rebuilt group is in the client Service before the next goes.
    pdd["spec"]["rollout"]["minReadySeconds"] = json!(5);
    env.kubectl.apply(ns, &yaml(&pdd)).await?;
    wait_ready(env, ns, name, GROUPS, Duration::from_secs(240)).await?;
    wait_ready_endpoints(env, ns, name, GROUPS as usize).await?;
    let svc = env
        .kubectl
        .json(&["get", "service", name, "-n", ns])
        .await?;
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .context("the client Service has a ClusterIP")?
        .to_string();

    // A client of the Service all along.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let client = {
        let (stop, ok, failed, ip) = (stop.clone(), ok.clone(), failed.clone(), cluster_ip.clone());
        tokio::spawn(async move {
            let mut errors = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                match chat(&ip, Duration::from_secs(30)).await {
                    Ok(_) => ok.fetch_add(1, Ordering::SeqCst),
                    Err(e) => {
                        errors.push(format!("{e:#}"));
                        failed.fetch_add(1, Ordering::SeqCst)
                    }
                };
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            errors
        })
    };
    let rec = PodRecorder::start(env, ns).await;
    let outcome = async {
        // 1. The operator.
        let tag = format!("{}{UPGRADE_SUFFIX}", env!("CARGO_PKG_VERSION"));
        let started = Instant::now();
        env.helm
            .upgrade(&["--reuse-values", "--set", &format!("image.tag={tag}")])
            .await?;
        operator::wait_rolled_out(&env.cluster.client, 2, Duration::from_secs(120)).await?;
        let leader = operator::wait_leader(&env.cluster.client, Duration::from_secs(60)).await?;
        figure(
            "helm upgrade → operator rolled, one leader",
            format!("{:.1}s", started.elapsed().as_secs_f64()),
        );
        for p in operator::pods(&env.cluster.client).await? {
            ensure!(
                image_of(&p).ends_with(&format!(":{tag}")),
                "operator pod {} runs {}",
                p.metadata.name.clone().unwrap_or_default(),
                image_of(&p)
            );
        }
        ensure!(
            image_of(&leader).ends_with(&tag),
            "the leader runs {}",
            image_of(&leader)
        );

        // 2. The dataplane.
        let image = format!("{}{UPGRADE_SUFFIX}", dataplane_image());
        let patch = json!({"spec": {
            "prefill": {"template": {"image": image}},
            "decode": {"template": {"image": image}},
        }});
        let started = Instant::now();
        merge_patch_pdd(env, ns, name, &patch).await?;
        tandem_e2e::wait::until_seen(
            "every group at the new image, Ready",
            Duration::from_secs(300),
            Duration::from_millis(500),
            || async {
                let p = get_pdd(env, ns, name).await?;
                let st = p.status.clone().unwrap_or_default();
                let live: Vec<String> = pods(env, ns, name)
                    .await?
                    .iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .map(image_of)
                    .collect();
                let done = st.ready_groups == GROUPS
                    && st.updated_groups == GROUPS
                    && live.len() == 2 * GROUPS as usize
                    && live.iter().all(|i| *i == image);
                Ok(if done {
                    Ok(())
                } else {
                    Err((st.ready_groups, st.updated_groups, live))
                })
            },
        )
        .await?;
        figure(
            "dataplane image change → every group rolled and Ready",
            format!("{:.1}s", started.elapsed().as_secs_f64()),
        );
        anyhow::Ok(())
    }
    .await;
    // Let the client see the last group serve before stopping it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let errors = client.await?;
    outcome?;
    let (ok, failed) = (ok.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    figure(
        "requests through the client Service during the upgrade",
        format!("{ok} ok, {failed} failed"),
    );
    ensure!(
        failed == 0 && ok > 0,
        "{failed} requests failed during the upgrade ({ok} ok): {:?}",
        errors.iter().take(3).collect::<Vec<_>>()
    );

    // Order, per group and across groups, from the pod watch.
    let changes = rec.changes();
    let pos = |f: &dyn Fn(&PodChange) -> bool| changes.iter().position(f);
    let mut rolled = Vec::new();
    for g in 0..GROUPS {
        let at = |role: &str, what: Change, new: bool| {
            pos(&|c: &PodChange| {
                c.group == g && c.role == role && c.what == what && (c.incarnation > 1) == new
            })
            .with_context(|| {
                format!(
                    "group {g}: no {what:?} of the {} {role}",
                    if new { "new" } else { "old" }
                )
            })
        };
        let old_decode_gone = at("decode", Change::Deleted, false)?;
        let old_prefill_term = at("prefill", Change::Terminating, false)?;
        let new_prefill_ready = at("prefill", Change::ContainersReady(true), true)?;
        let new_decode_added = at("decode", Change::Added, true)?;
        let new_decode_ready = at("decode", Change::ContainersReady(true), true)?;
        let old_decode_term = at("decode", Change::Terminating, false)?;
        ensure!(
            old_decode_gone < old_prefill_term,
            "group {g}: prefill deleted before its decode was gone"
        );
        ensure!(
            new_prefill_ready < new_decode_added,
            "group {g}: decode created before the new prefill was Ready"
        );
        rolled.push((old_decode_term, new_decode_ready, g));
    }
    rolled.sort();
    ensure!(
        rolled[0].1 < rolled[1].0,
        "group {} went down before group {} was back: the groups did not roll one at a time",
        rolled[1].2,
        rolled[0].2
    );

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
