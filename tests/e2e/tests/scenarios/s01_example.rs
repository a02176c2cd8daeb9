//! Scenario 1: a user applies the CRD and the example manifest. Every group becomes Ready,
//! `kubectl get pdd` shows the right columns, the conditions are right, pod DNS resolves
//! the bootstrap names the decode pods were given, a chat request through each of the
//! client Service's endpoints answers, and that EndpointSlice lists only decode pods of
//! Ready groups.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use tandem_e2e::env::Env;
use tandem_e2e::repo_root;

use crate::common::*;

/// The example a user starts from (the packaging work moves it under `examples/`).
fn example_manifest() -> std::path::PathBuf {
    let moved = repo_root().join("manifests/examples/smollm2.yaml");
    if moved.exists() {
        moved
    } else {
        repo_root().join("manifests/smollm2-pd.yaml")
    }
}

pub async fn run(env: &Env) -> Result<()> {
    let ns = "default";
    let manifest = example_manifest();
    let doc: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&manifest)?)?;
    let name = doc["metadata"]["name"]
        .as_str()
        .context("example has a name")?
        .to_string();
    let groups = doc["spec"]["groups"].as_i64().unwrap_or(1) as i32;
    let model = doc["spec"]["model"]["name"]
        .as_str()
        .context("example has a model name")?
        .to_string();

    env.namespace(ns).await?;
    let example = Example {
        ns,
        manifest: &manifest,
        name: &name,
        groups,
        model: &model,
    };
    let checked = serve_and_check(env, &example).await;
    // Pass or fail, leave `default` as a user's cluster was before the example: later
    // scenarios (s09 dry-runs the examples there) must not meet its claim.
    let cleaned = remove(env, &example).await;
    checked?;
    cleaned
}

/// The example as applied.
struct Example<'a> {
    ns: &'a str,
    manifest: &'a std::path::Path,
    name: &'a str,
    groups: i32,
    model: &'a str,
}

/// Applies the example and checks what a user sees of it.
async fn serve_and_check(env: &Env, ex: &Example<'_>) -> Result<()> {
    let Example {
        ns,
        manifest,
        name,
        groups,
        model,
    } = *ex;

    let crd = repo_root().join("crds/pddeployment.yaml");
    env.kubectl
        .ok(&["apply", "--server-side", "-f", &crd.display().to_string()])
        .await?;
    env.kubectl
        .ok(&["apply", "-f", &manifest.display().to_string()])
        .await
        .context("applying the example")?;

    let p = wait_ready(env, ns, name, groups, Duration::from_secs(180)).await?;

    // Conditions.
    for (t, want) in [
        ("Available", ("True", "MinimumGroupsAvailable")),
        ("Progressing", ("False", "Complete")),
        ("Degraded", ("False", "AsExpected")),
        ("BootstrapHealthy", ("True", "AllChannelsHealthy")),
    ] {
        let got = cond(&p, t).with_context(|| format!("condition {t} missing"))?;
        ensure!(
            (got.0.as_str(), got.1.as_str()) == want,
            "condition {t}: {got:?}, want {want:?}"
        );
    }

    // `kubectl get pdd` columns and values.
    let table = env.kubectl.ok(&["get", "pdd", "-n", ns]).await?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(
        header == ["NAME", "GROUPS", "READY", "UPDATED", "AVAILABLE", "AGE"],
        "kubectl get pdd header: {header:?}"
    );
    let row: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let g = groups.to_string();
    ensure!(
        row.len() == 6 && row[..5] == [name, &g, &g, &g, "True"],
        "kubectl get pdd row: {row:?}"
    );

    // Pod DNS: each decode was told its prefill by name, and that name resolves as the
    // decode resolves it (its resolv.conf from the kubelet, through the kube-dns Service
    // and kube-proxy, from inside its network namespace) to the prefill pod's address.
    let all = pods(env, ns, name).await?;
    for d in all.iter().filter(|p| role(p) == "decode") {
        let args = d.spec.as_ref().unwrap().containers[0]
            .args
            .clone()
            .unwrap_or_default();
        // The operator renders its settings as `--flag=value` (tandem-contract); a
        // separate value after `--prefill` is what a user's extra args could add.
        let peers = args
            .iter()
            .find_map(|a| a.strip_prefix("--prefill="))
            .or_else(|| {
                args.iter()
                    .skip_while(|a| *a != "--prefill")
                    .nth(1)
                    .map(String::as_str)
            })
            .with_context(|| format!("decode has --prefill (args {args:?})"))?;
        let prefill = member(env, ns, name, group(d), "prefill").await?;
        let want_ip = pod_ip(&prefill).context("prefill IP")?;
        for peer in peers.split(',') {
            let host = peer.rsplit_once(':').map(|(h, _)| h).unwrap_or(peer);
            ensure!(
                host.starts_with("prefill-") && host.parse::<std::net::IpAddr>().is_err(),
                "decode {} was given {peer:?}, not a DNS name",
                d.name_any()
            );
            let got = env
                .resolve_in_pod(ns, &d.name_any(), host)
                .await
                .with_context(|| format!("resolving {host} inside {}", d.name_any()))?;
            ensure!(
                got.first() == Some(&want_ip),
                "{host} resolved to {got:?} inside {}, want {want_ip}",
                d.name_any()
            );
        }
    }

    // The client Service's EndpointSlice: exactly the decode pods of Ready groups, each
    // answering a chat request (waited for: the endpoint controller lags the gate).
    wait_ready_endpoints(env, ns, name, groups as usize).await?;
    let eps = endpoints(env, ns, name).await?;
    let ready: Vec<&Endpoint> = eps.iter().filter(|e| e.ready).collect();
    let mut first_token = None;
    let decode_pods: Vec<String> = all
        .iter()
        .filter(|p| role(p) == "decode")
        .map(|p| p.name_any())
        .collect();
    ensure!(
        ready.len() as i32 == groups,
        "{} ready endpoints for {groups} Ready groups: {eps:?}",
        ready.len()
    );
    for e in &ready {
        ensure!(
            decode_pods.contains(&e.pod),
            "endpoint {e:?} is not a decode pod"
        );
        let text = chat_model(&e.ip, model, Duration::from_secs(60)).await?;
        if first_token.is_none() {
            first_token = Some(env.installed_at.elapsed());
        }
        figure(
            &format!("chat via endpoint {} ({})", e.ip, e.pod),
            format!("{text:?}"),
        );
    }
    if let Some(t) = first_token {
        figure(
            "helm install → first served token",
            format!(
                "{:.1}s (helm install → a leading operator {:.1}s; the example applied right after)",
                t.as_secs_f64(),
                env.install_took.as_secs_f64()
            ),
        );
    }
    // And through the Service's ClusterIP, as a client in the cluster reaches it
    // (kube-proxy picks a ready endpoint).
    let svc = env
        .kubectl
        .json(&["get", "service", name, "-n", ns])
        .await?;
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .context("the client Service has a ClusterIP")?;
    let text = chat_model(cluster_ip, model, Duration::from_secs(60)).await?;
    figure(
        &format!("chat via the client Service {cluster_ip}"),
        format!("{text:?}"),
    );

    Ok(())
}

/// Deletes the example, then the claim and the volume the harness provided, once the
/// garbage collector has removed the pods.
async fn remove(env: &Env, ex: &Example<'_>) -> Result<()> {
    let (ns, manifest, name) = (ex.ns, ex.manifest, ex.name);
    env.kubectl
        .ok(&[
            "delete",
            "-f",
            &manifest.display().to_string(),
            "--wait=true",
        ])
        .await?;
    tandem_e2e::wait::until(
        "the example's pods to be gone",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || async { Ok(pods(env, ns, name).await?.is_empty().then_some(())) },
    )
    .await?;
    env.kubectl
        .ok(&["delete", "pvc", "models", "-n", ns, "--timeout=60s"])
        .await?;
    env.kubectl
        .ok(&["delete", "pv", "e2e-models-default", "--timeout=60s"])
        .await?;
    Ok(())
}
