//! Scenario 9: every manifest in `manifests/` and the rendered Helm chart pass a server-side
//! dry-run apply; the operator's ServiceAccount can do what the controller calls and
//! nothing beyond it; and the chart's operator replicas, which served every scenario before
//! this one under that account only, never met a `forbidden` answer (read from every
//! container instance's log the kubelets kept).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use tandem_e2e::env::{Env, OPERATOR_SA};
use tandem_e2e::operator::OPERATOR_NAMESPACE;
use tandem_e2e::repo_root;

use crate::common::*;

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            yaml_files(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
    out.sort();
    Ok(())
}

pub async fn run(env: &Env) -> Result<()> {
    env.namespace("s09").await?;
    let mut files = Vec::new();
    yaml_files(&repo_root().join("manifests"), &mut files)?;
    ensure!(!files.is_empty(), "no manifests");
    for f in &files {
        let out = env
            .kubectl
            .run(&["apply", "--dry-run=server", "-f", &f.display().to_string()])
            .await?;
        ensure!(
            out.success,
            "{}: server-side dry run failed: {}",
            f.display(),
            out.stderr.trim()
        );
    }
    figure("manifests dry-run applied", files.len());

    {
        let rendered = env.helm.template().await?;
        let out = env
            .kubectl
            .run_with(&["apply", "--dry-run=server", "-f", "-"], Some(&rendered))
            .await?;
        ensure!(
            out.success,
            "helm template | kubectl apply --dry-run=server: {}",
            out.stderr.trim()
        );
        figure("rendered chart dry-run applied", "ok");
    }

    // What the operator's account may and may not do.
    let who = format!("system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}");
    let can = |verb: &'static str, res: &'static str, ns: &'static str| {
        let who = who.clone();
        async move {
            let mut args = vec!["auth", "can-i", verb];
            match res.split_once('/') {
                // A named Lease: kubectl's TYPE/NAME form.
                Some((r, _)) if r.starts_with("leases") => args.push(res),
                Some((r, sub)) => args.extend([r, "--subresource", sub]),
                None => args.push(res),
            }
            args.extend(["-n", ns, "--as", &who]);
            let out = env.kubectl.run(&args).await?;
            Ok::<bool, anyhow::Error>(out.stdout.trim() == "yes")
        }
    };
    let allowed: &[(&str, &str, &str)] = &[
        ("list", "pddeployments.tandem.dev", "s09"),
        ("watch", "pddeployments.tandem.dev", "s09"),
        ("patch", "pddeployments.tandem.dev/status", "s09"),
        ("create", "pods", "s09"),
        ("delete", "pods", "s09"),
        ("patch", "pods/status", "s09"),
        ("patch", "services", "s09"),
        ("patch", "networkpolicies.networking.k8s.io", "s09"),
        ("create", "secrets", "s09"),
        // A group key, read to sign an in-place reset (docs/in-place-reset.md).
        ("get", "secrets", "s09"),
        // The node of a member pod: Ready not True means the node is lost.
        ("get", "nodes", "s09"),
        // A PDDeployment's router (spec.router): its Deployment, account and role.
        ("create", "deployments.apps", "s09"),
        ("create", "serviceaccounts", "s09"),
        ("create", "roles.rbac.authorization.k8s.io", "s09"),
        ("create", "rolebindings.rbac.authorization.k8s.io", "s09"),
        ("create", "events.events.k8s.io", "s09"),
        (
            "update",
            "leases.coordination.k8s.io/tandem-operator",
            OPERATOR_NAMESPACE,
        ),
    ];
    let denied: &[(&str, &str, &str)] = &[
        ("delete", "pddeployments.tandem.dev", "s09"),
        ("update", "pddeployments.tandem.dev", "s09"),
        ("patch", "nodes", "s09"),
        ("list", "nodes", "s09"),
        ("update", "secrets", "s09"),
        ("create", "daemonsets.apps", "s09"),
        ("create", "clusterroles.rbac.authorization.k8s.io", "s09"),
        (
            "update",
            "leases.coordination.k8s.io/tandem-operator",
            "s09",
        ),
        (
            "update",
            "leases.coordination.k8s.io/someone-else",
            OPERATOR_NAMESPACE,
        ),
        ("create", "pods/exec", "s09"),
    ];
    for (verb, res, ns) in allowed {
        ensure!(
            can(verb, res, ns).await?,
            "{who} cannot {verb} {res} in {ns}"
        );
    }
    for (verb, res, ns) in denied {
        ensure!(
            !can(verb, res, ns).await?,
            "{who} may {verb} {res} in {ns} (more than it needs)"
        );
    }

    // Every operator container so far ran under that account only: none was refused.
    let logs = env.kept_pod_logs(OPERATOR_NAMESPACE, "tandem-operator-");
    ensure!(
        !logs.is_empty(),
        "no operator container log under {}/nodes/*/pod-logs",
        env.run_dir.display()
    );
    let mut checked = 0;
    for p in &logs {
        checked += 1;
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        if let Some(line) = text
            .lines()
            .find(|l| l.contains("forbidden") || l.contains(" 403"))
        {
            bail!("{}: the operator was refused: {line}", p.display());
        }
    }
    figure("operator logs without a forbidden answer", checked);
    Ok(())
}
