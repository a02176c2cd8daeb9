//! Scenario 19 (runs last: it removes the operator): `helm uninstall` does what the chart
//! documents (docs/install.md): the operator's Deployment, pods and RBAC go;
//! the CRD and every PDDeployment — and the pods they own — stay, serving, and nobody
//! reconciles them any more.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use tandem_e2e::env::Env;
use tandem_e2e::operator::{self, DEPLOYMENT, OPERATOR_NAMESPACE};
use tandem_e2e::wait;

use crate::common::*;

pub async fn run(env: &Env) -> Result<()> {
    let (ns, name) = ("s19", "pd");
    env.namespace(ns).await?;
    env.kubectl.apply(ns, &yaml(&spec(name, 1))).await?;
    wait_ready(env, ns, name, 1, Duration::from_secs(180)).await?;
    let before = pods(env, ns, name).await?;

    env.helm.uninstall().await?;
    wait::until(
        "the operator's pods to be gone",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || async {
            Ok(operator::pods(&env.cluster.client)
                .await?
                .is_empty()
                .then_some(()))
        },
    )
    .await?;
    for (kind, obj) in [
        ("deployment", DEPLOYMENT.to_string()),
        ("serviceaccount", "tandem-operator".to_string()),
        ("role", "tandem-operator-leader-election".to_string()),
    ] {
        let out = env
            .kubectl
            .run(&["get", kind, &obj, "-n", OPERATOR_NAMESPACE])
            .await?;
        ensure!(
            !out.success,
            "{kind}/{obj} is still there after helm uninstall"
        );
    }
    let out = env
        .kubectl
        .run(&["get", "clusterrole", "tandem-operator"])
        .await?;
    ensure!(!out.success, "the operator's ClusterRole is still there");

    // Kept: the CRD, the PDDeployment, its pods (same ones), and they serve.
    env.kubectl
        .ok(&["get", "crd", "pddeployments.tandem.dev"])
        .await
        .context("the CRD must stay after helm uninstall")?;
    get_pdd(env, ns, name)
        .await
        .context("the PDDeployment must stay after helm uninstall")?;
    let after = pods(env, ns, name).await?;
    let names = |v: &[k8s_openapi::api::core::v1::Pod]| {
        let mut n: Vec<String> = v
            .iter()
            .map(|p| p.metadata.name.clone().unwrap_or_default())
            .collect();
        n.sort();
        n
    };
    ensure!(
        names(&after) == names(&before),
        "the PDDeployment's pods changed: {:?} → {:?}",
        names(&before),
        names(&after)
    );
    let ip = pod_ip(&member(env, ns, name, 0, "decode").await?).context("decode IP")?;
    chat(&ip, Duration::from_secs(60)).await?;
    figure(
        "helm uninstall",
        "operator gone; CRD, PDDeployment and its pods kept and serving",
    );
    Ok(())
}
