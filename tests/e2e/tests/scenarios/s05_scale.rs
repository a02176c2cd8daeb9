//! Scenario 5: `kubectl scale pdd --replicas 3` adds groups; `--replicas 1` removes the
//! highest ones, decode before prefill, then their Service, NetworkPolicy and Secret.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s05", "pd");
    env.namespace(ns).await?;
    env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;

    env.kubectl
        .ok(&["scale", "pdd", name, "-n", ns, "--replicas", "3"])
        .await?;
    wait_ready(env, ns, name, 3, Duration::from_secs(240)).await?;
    let raw = env
        .kubectl
        .ok(&[
            "get",
            "--raw",
            &format!("/apis/tandem.dev/v1alpha1/namespaces/{ns}/pddeployments/{name}/scale"),
        ])
        .await
        .context("reading the scale subresource")?;
    let scale: serde_json::Value = serde_json::from_str(&raw)?;
    ensure!(
        scale["spec"]["replicas"] == 3 && scale["status"]["replicas"] == 3,
        "scale subresource: {scale}"
    );
    ensure!(
        scale["status"]["selector"]
            .as_str()
            .is_some_and(|s| s.contains("tandem.dev/role=decode")),
        "scale selector: {scale}"
    );
    // All three decodes in the client Service (waited for: the endpoint controller lags
    // the gate).
    wait_ready_endpoints(env, ns, name, 3).await?;

    let rec = PodRecorder::start(env, ns).await;
    let before = pods(env, ns, name).await?;
    env.kubectl
        .ok(&["scale", "pdd", name, "-n", ns, "--replicas", "1"])
        .await?;
    wait::until_seen(
        "groups 1 and 2 and their objects to be gone",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let left: Vec<String> = pods(env, ns, name)
                .await?
                .iter()
                .filter(|p| group(p) > 0)
                .map(|p| p.name_any())
                .collect();
            let mut objects = Vec::new();
            for (kind, obj) in [
                ("service", "bootstrap"),
                ("networkpolicy", "kv"),
                ("secret", "key"),
            ] {
                for g in [1, 2] {
                    let n = format!("{name}-g{g}-{obj}");
                    let out = env.kubectl.run(&["get", kind, &n, "-n", ns]).await?;
                    if out.success {
                        objects.push(format!("{kind}/{n}"));
                    }
                }
            }
            let p = get_pdd(env, ns, name).await?;
            let st = p.status.clone().unwrap_or_default();
            let done = left.is_empty()
                && objects.is_empty()
                && st.groups == 1
                && st.group_statuses.len() == 1;
            Ok(if done {
                Ok(())
            } else {
                Err((left, objects, st.groups))
            })
        },
    )
    .await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(30)).await?;
    // Decode before prefill, per group.
    let changes = rec.changes();
    for g in [1, 2] {
        let of = |r: &str| {
            before
                .iter()
                .find(|p| group(p) == g && role(p) == r)
                .map(|p| p.name_any())
                .with_context(|| format!("group {g} had no {r}"))
        };
        let (d, p) = (of("decode")?, of("prefill")?);
        let pos =
            |pod: &str, what: Change| changes.iter().position(|c| c.pod == pod && c.what == what);
        let d_gone = pos(&d, Change::Deleted).with_context(|| format!("{d} not deleted"))?;
        let p_term = pos(&p, Change::Terminating).with_context(|| format!("{p} not deleted"))?;
        ensure!(
            d_gone < p_term,
            "group {g}: prefill deleted before its decode was gone"
        );
    }
    let table = env
        .kubectl
        .ok(&["get", "pdd", name, "-n", ns, "--no-headers"])
        .await?;
    let row: Vec<&str> = table.split_whitespace().collect();
    ensure!(
        row.get(1..3) == Some(&["1", "1"][..]),
        "kubectl get pdd: {table}"
    );

    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
