//! Tandem as a user installs it: `helm install` of `charts/tandem` into `tandem-system`
//! (the chart's CRD, RBAC, the operator Deployment with 2 replicas, leader election,
//! probes, PodDisruptionBudget and restricted Pod Security), from the images imported into
//! the nodes. Helpers find the operator's pods, the leader, and read each replica's
//! metrics at its pod address.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use crate::{http, proc, repo_root, wait};

/// Namespace of the release, the operator's ServiceAccount and its Lease.
pub const OPERATOR_NAMESPACE: &str = "tandem-system";
/// The Helm release (so the objects are `tandem-operator`, as the docs name them).
pub const RELEASE: &str = "tandem";
/// The chart's Deployment and ServiceAccount.
pub const DEPLOYMENT: &str = "tandem-operator";
/// The Lease the replicas elect their leader through.
pub const LEASE: &str = "tandem-operator";
/// The operator pods' labels (the chart's selector labels).
pub const SELECTOR: &str = "app.kubernetes.io/name=tandem,app.kubernetes.io/instance=tandem,app.kubernetes.io/component=operator";
/// The chart's metrics port.
pub const METRICS_PORT: u16 = 8080;

/// `helm` with the admin kubeconfig.
#[derive(Debug, Clone)]
pub struct Helm {
    pub bin: PathBuf,
    pub kubeconfig: PathBuf,
}

impl Helm {
    pub fn new(bin: &Path, kubeconfig: &Path) -> Helm {
        Helm {
            bin: bin.to_path_buf(),
            kubeconfig: kubeconfig.to_path_buf(),
        }
    }

    /// Run helm; a failure carries its stderr.
    pub async fn run(&self, args: &[&str]) -> Result<String> {
        let out = tokio::process::Command::new(&self.bin)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .context("running helm")?;
        if !out.status.success() {
            bail!(
                "helm {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn chart() -> String {
        repo_root().join("charts/tandem").display().to_string()
    }

    /// `helm install tandem charts/tandem -n tandem-system --wait` with `extra` values.
    pub async fn install(&self, extra: &[&str]) -> Result<String> {
        let chart = Self::chart();
        let mut args = vec![
            "install",
            RELEASE,
            chart.as_str(),
            "--namespace",
            OPERATOR_NAMESPACE,
            "--wait",
            "--timeout",
            "5m",
        ];
        args.extend_from_slice(extra);
        self.run(&args).await
    }

    /// `helm upgrade tandem charts/tandem -n tandem-system --wait` with `extra` values.
    pub async fn upgrade(&self, extra: &[&str]) -> Result<String> {
        let chart = Self::chart();
        let mut args = vec![
            "upgrade",
            RELEASE,
            chart.as_str(),
            "--namespace",
            OPERATOR_NAMESPACE,
            "--wait",
            "--timeout",
            "5m",
        ];
        args.extend_from_slice(extra);
        self.run(&args).await
    }

    /// `helm uninstall tandem -n tandem-system --wait`.
    pub async fn uninstall(&self) -> Result<String> {
        self.run(&[
            "uninstall",
            RELEASE,
            "--namespace",
            OPERATOR_NAMESPACE,
            "--wait",
            "--timeout",
            "3m",
        ])
        .await
    }

    /// `helm template` of the chart, as `kubectl apply` of the rendered chart would see it.
    pub async fn template(&self) -> Result<String> {
        proc::run(
            &self.bin.display().to_string(),
            &[
                "template",
                RELEASE,
                &Self::chart(),
                "--namespace",
                OPERATOR_NAMESPACE,
            ],
        )
        .await
        .context("rendering charts/tandem")
    }
}

/// The operator's live (not terminating) pods, by name.
pub async fn pods(client: &Client) -> Result<Vec<Pod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    let mut pods: Vec<Pod> = api
        .list(&ListParams::default().labels(SELECTOR))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    pods.sort_by_key(|p| p.name_any());
    Ok(pods)
}

/// The Lease's holder identity (`<pod name>-<random>`), if anyone holds it.
pub async fn lease_holder(client: &Client) -> Result<Option<String>> {
    let api: Api<Lease> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    Ok(api
        .get_opt(LEASE)
        .await?
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty()))
}

/// A replica's Prometheus text, at its pod address.
pub async fn metrics(pod: &Pod) -> Result<String> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .with_context(|| format!("operator pod {} has no IP", pod.name_any()))?;
    let r = http::get(
        &format!("{ip}:{METRICS_PORT}"),
        "/metrics",
        Duration::from_secs(3),
    )
    .await?;
    Ok(r.body)
}

/// Whether the replica in `pod` reports `tandem_operator_is_leader 1`.
pub async fn is_leader(pod: &Pod) -> Result<bool> {
    let m = metrics(pod).await?;
    Ok(m.lines().any(|l| l.trim() == "tandem_operator_is_leader 1"))
}

/// Wait until exactly one running replica leads (by its own metrics); returns its pod.
pub async fn wait_leader(client: &Client, within: Duration) -> Result<Pod> {
    wait::until_seen(
        "one operator replica to lead",
        within,
        Duration::from_millis(500),
        || async {
            let mut leaders = Vec::new();
            let mut seen = Vec::new();
            for p in pods(client).await? {
                let leads = is_leader(&p).await.unwrap_or(false);
                seen.push((p.name_any(), leads));
                if leads {
                    leaders.push(p);
                }
            }
            Ok(match leaders.len() {
                1 => Ok(leaders.remove(0)),
                _ => Err(seen),
            })
        },
    )
    .await
}

/// Wait until the Deployment has `replicas` available replicas of the current template.
pub async fn wait_rolled_out(client: &Client, replicas: i32, within: Duration) -> Result<Duration> {
    let started = Instant::now();
    let api: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    wait::until_seen(
        &format!("deployment {DEPLOYMENT} to have {replicas} updated available replicas"),
        within,
        Duration::from_millis(500),
        || async {
            let d = api.get(DEPLOYMENT).await?;
            let s = d.status.clone().unwrap_or_default();
            let done = d.metadata.generation == s.observed_generation
                && s.updated_replicas == Some(replicas)
                && s.available_replicas == Some(replicas)
                && s.replicas == Some(replicas);
            Ok(if done {
                Ok(())
            } else {
                Err((
                    s.updated_replicas,
                    s.available_replicas,
                    s.replicas,
                    s.observed_generation,
                ))
            })
        },
    )
    .await?;
    Ok(started.elapsed())
}
