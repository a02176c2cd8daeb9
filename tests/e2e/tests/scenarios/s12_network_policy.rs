//! Scenario 12: the per-group NetworkPolicy, enforced on the real nodes by
//! kube-network-policies. From inside the pods' own network namespaces: a group's decode
//! opens its own prefill's KV port; it cannot open the other group's (the connection
//! attempt is dropped, not refused); a pod outside the deployment cannot open either KV
//! port, while the prefills' HTTP port (probes, metrics, API) stays open to it.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::ResourceExt;
use tandem_e2e::env::Env;
use tandem_e2e::wait;

use crate::common::*;

const KV_PORT: u16 = 5600;

/// A pod outside the deployment: the pause image, under the restricted profile.
fn outsider(ns: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: outsider, namespace: {ns}, labels: {{app: outsider}}}}
spec:
  automountServiceAccountToken: false
  securityContext:
    runAsNonRoot: true
    runAsUser: 65535
    seccompProfile: {{type: RuntimeDefault}}
  containers:
    - name: pause
      image: {pause}
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities: {{drop: [ALL]}}
      resources: {{requests: {{cpu: 10m, memory: 16Mi}}}}
"#,
        pause = tandem_e2e::node::config::PAUSE_IMAGE
    )
}

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s12", "pd");
    env.namespace(ns).await?;
    env.kubectl.apply(ns, &yaml(&spec(name, 2))).await?;
    env.kubectl.apply(ns, &outsider(ns)).await?;
    wait_ready(env, ns, name, 2, Duration::from_secs(240)).await?;
    env.kubectl
        .ok(&[
            "wait",
            "--for=condition=Ready",
            "pod/outsider",
            "-n",
            ns,
            "--timeout=120s",
        ])
        .await?;

    let d0 = member(env, ns, name, 0, "decode").await?.name_any();
    let p0 = member(env, ns, name, 0, "prefill").await?;
    let p1 = member(env, ns, name, 1, "prefill").await?;
    let kv = |p: &k8s_openapi::api::core::v1::Pod| -> Result<String> {
        Ok(format!("{}:{KV_PORT}", pod_ip(p).context("prefill IP")?))
    };
    let (kv0, kv1) = (kv(&p0)?, kv(&p1)?);
    let http0 = format!("{}:{HTTP_PORT}", pod_ip(&p0).context("prefill IP")?);

    // The allowed paths work (so a blocked one is the policy, not the network).
    ensure!(
        env.connect_from_pod(ns, &d0, &kv0).await?,
        "group 0's decode cannot open its own prefill's KV port {kv0}"
    );
    ensure!(
        env.connect_from_pod(ns, "outsider", &http0).await?,
        "a pod outside the deployment cannot open a prefill's HTTP port {http0}"
    );
    // The blocked ones: each attempt is dropped by the enforcer. Waited for a little: the
    // enforcer learns new pods' addresses from its watch.
    for (from, to, what) in [
        (
            d0.as_str(),
            &kv1,
            "group 0's decode → group 1's prefill KV port",
        ),
        ("outsider", &kv0, "outside pod → group 0's prefill KV port"),
        ("outsider", &kv1, "outside pod → group 1's prefill KV port"),
    ] {
        wait::until(
            &format!("{what} ({to}) to be blocked"),
            Duration::from_secs(20),
            Duration::from_millis(500),
            || async { Ok((!env.connect_from_pod(ns, from, to).await?).then_some(())) },
        )
        .await?;
        figure("NetworkPolicy blocks", what);
    }
    // And still: its own channel works, the group serves.
    ensure!(
        env.connect_from_pod(ns, &d0, &kv0).await?,
        "group 0's own KV channel stopped connecting"
    );
    let ip = pod_ip(&member(env, ns, name, 0, "decode").await?).context("decode IP")?;
    chat(&ip, Duration::from_secs(60)).await?;

    env.kubectl
        .ok(&["delete", "pod", "outsider", "-n", ns, "--wait=true"])
        .await?;
    env.kubectl
        .ok(&["delete", "pdd", name, "-n", ns, "--wait=true"])
        .await?;
    Ok(())
}
