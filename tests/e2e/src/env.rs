//! The whole test environment, started once for the suite: the pod network, the control
//! plane, cluster DNS, the scheduler, two nodes, the operator's ServiceAccount with the
//! chart's RBAC (and a kubeconfig for it), and `kubectl` with the admin kubeconfig.
//!
//! One run at a time per machine (a lock in /tmp), because the pod network's bridge and
//! addresses are machine-wide.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use nix::fcntl::{Flock, FlockArg};
use tracing::info;

use crate::cluster::{Cluster, Credentials, write_kubeconfig};
use crate::dns::DnsServer;
use crate::kubectl::Kubectl;
use crate::kubelet::scheduler::Scheduler;
use crate::kubelet::{Node, NodeSpec};
use crate::net::{GATEWAY, PodNetwork};
use crate::operator::{OPERATOR_NAMESPACE, Operator};
use crate::repo_root;

/// Nodes of the harness. Scenarios cordon and stop them by these names.
pub const NODE_A: &str = "e2e-node-a";
pub const NODE_B: &str = "e2e-node-b";
/// The ServiceAccount the operator runs as (the chart's, or the fallback's).
pub const OPERATOR_SA: &str = "tandem-operator";

pub struct Env {
    pub run_dir: PathBuf,
    pub cluster: Cluster,
    pub network: Arc<PodNetwork>,
    pub dns: DnsServer,
    pub nodes: Vec<Node>,
    pub kubectl: Kubectl,
    /// Kubeconfig of the operator's ServiceAccount (token auth, RBAC applies).
    pub operator_kubeconfig: PathBuf,
    /// Where the RBAC came from (`charts/tandem` or the fallback manifest).
    pub rbac_source: String,
    _scheduler: Scheduler,
    _lock: Flock<File>,
}

/// The dataplane binary every pod runs.
pub fn dataplane_binary() -> PathBuf {
    repo_root().join("target/debug/tandem-dataplane")
}

/// Where the model lives on this machine.
pub fn models_dir() -> Result<PathBuf> {
    let dir = repo_root().join(".cache/models");
    dir.canonicalize()
        .with_context(|| format!("{}: run `make model` first", dir.display()))
}

fn lock() -> Result<Flock<File>> {
    let f = File::create("/tmp/tandem-e2e.lock")?;
    match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(l),
        Err((f, _)) => {
            eprintln!("e2e: another run holds /tmp/tandem-e2e.lock; waiting for it");
            Flock::lock(f, FlockArg::LockExclusive).map_err(|(_, e)| e.into())
        }
    }
}

impl Env {
    pub async fn start(run_dir: &Path) -> Result<Env> {
        let lock = tokio::task::spawn_blocking(lock).await??;
        for (what, p) in [
            ("dataplane", dataplane_binary()),
            ("operator", crate::operator::binary()),
        ] {
            if !p.exists() {
                bail!(
                    "the {what} binary {} is missing: `make e2e` builds it",
                    p.display()
                );
            }
        }
        models_dir()?;
        std::fs::create_dir_all(run_dir)?;
        let network = Arc::new(PodNetwork::create().await?);
        let cluster = Cluster::start(run_dir).await?;
        let client = cluster.client.clone();
        let dns = DnsServer::start(client.clone(), SocketAddr::from((GATEWAY, 53))).await?;
        let scheduler = Scheduler::start(client.clone()).await?;
        let mut nodes = Vec::new();
        for name in [NODE_A, NODE_B] {
            nodes.push(
                Node::start(
                    client.clone(),
                    NodeSpec {
                        name: name.into(),
                        host_ip: GATEWAY.to_string(),
                        labels: BTreeMap::new(),
                        cpu: "16".into(),
                        memory: "64Gi".into(),
                    },
                    network.clone(),
                    dataplane_binary(),
                    crate::proc::pod_exec_binary(),
                    run_dir.join("nodes").join(name),
                )
                .await?,
            );
        }
        let kubectl = Kubectl::new(&cluster.bins.kubectl, &cluster.admin_kubeconfig);
        let mut env = Env {
            run_dir: run_dir.to_path_buf(),
            cluster,
            network,
            dns,
            nodes,
            kubectl,
            operator_kubeconfig: run_dir.join("operator.kubeconfig"),
            rbac_source: String::new(),
            _scheduler: scheduler,
            _lock: lock,
        };
        env.install_crd().await?;
        env.install_operator_identity().await?;
        info!("environment ready");
        Ok(env)
    }

    /// The CRD, applied as a user would.
    pub async fn install_crd(&self) -> Result<()> {
        let crd = repo_root().join("crds/pddeployment.yaml");
        self.kubectl
            .ok(&["apply", "--server-side", "-f", &crd.display().to_string()])
            .await?;
        self.kubectl
            .ok(&[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/pddeployments.tandem.dev",
            ])
            .await?;
        Ok(())
    }

    /// The operator's namespace, ServiceAccount and RBAC (rendered from `charts/tandem`),
    /// and a kubeconfig with a token of that ServiceAccount.
    async fn install_operator_identity(&mut self) -> Result<()> {
        self.kubectl
            .ok(&["create", "namespace", OPERATOR_NAMESPACE])
            .await?;
        // Only the chart's RBAC: a permission the chart lacks fails the scenarios.
        let chart = repo_root().join("charts/tandem");
        let rendered = crate::proc::run(
            &self.cluster.bins.helm.display().to_string(),
            &[
                "template",
                "tandem",
                &chart.display().to_string(),
                "--namespace",
                OPERATOR_NAMESPACE,
            ],
        )
        .await
        .context("rendering charts/tandem")?;
        self.rbac_source = "charts/tandem (helm template)".into();
        let rbac = rbac_documents(&rendered)?;
        self.kubectl.apply(OPERATOR_NAMESPACE, &rbac).await?;
        let token = self
            .kubectl
            .ok(&[
                "create",
                "token",
                OPERATOR_SA,
                "-n",
                OPERATOR_NAMESPACE,
                "--duration=12h",
            ])
            .await?;
        write_kubeconfig(
            &self.operator_kubeconfig,
            &self.cluster.server,
            &self.cluster.pki.ca_cert,
            OPERATOR_SA,
            Credentials::Token(token.trim()),
            OPERATOR_NAMESPACE,
        )?;
        Ok(())
    }

    /// A namespace for a scenario: labelled `restricted`, with a PersistentVolumeClaim
    /// `models` bound to a volume holding the model (as a cluster admin would provide).
    pub async fn namespace(&self, ns: &str) -> Result<()> {
        self.cluster.restricted_namespace(ns).await?;
        let models = models_dir()?;
        let pv = format!(
            "apiVersion: v1
kind: PersistentVolume
metadata: {{name: e2e-models-{ns}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadOnlyMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: \"\"
  hostPath: {{path: {path}, type: Directory}}
  claimRef: {{namespace: {ns}, name: models}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: models, namespace: {ns}}}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: \"\"
  volumeName: e2e-models-{ns}
  resources: {{requests: {{storage: 1Gi}}}}
",
            path = models.display()
        );
        self.kubectl.apply(ns, &pv).await?;
        let api: Api<PersistentVolumeClaim> = Api::namespaced(self.cluster.client.clone(), ns);
        crate::wait::until(
            &format!("claim {ns}/models to be Bound"),
            Duration::from_secs(60),
            Duration::from_millis(300),
            || {
                let api = api.clone();
                async move {
                    let pvc = api.get("models").await?;
                    Ok(
                        (pvc.status.and_then(|s| s.phase).as_deref() == Some("Bound"))
                            .then_some(()),
                    )
                }
            },
        )
        .await
    }

    pub fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .expect("a harness node")
    }

    /// PID of a pod's container process, on whichever node runs it.
    pub fn pid_of(&self, ns: &str, pod: &str) -> Option<i32> {
        self.nodes
            .iter()
            .flat_map(|n| n.pods())
            .find(|p| p.namespace == ns && p.name == pod)
            .map(|p| p.pid.load(std::sync::atomic::Ordering::SeqCst))
            .filter(|pid| *pid > 0)
    }

    /// Log file of a pod's container.
    pub fn pod_log(&self, ns: &str, pod: &str) -> Option<PathBuf> {
        self.nodes
            .iter()
            .flat_map(|n| n.pods())
            .find(|p| p.namespace == ns && p.name == pod)
            .map(|p| p.log.clone())
    }

    /// Start an operator replica under its ServiceAccount, watching `ns`.
    pub fn operator(&self, identity: &str, ns: &str) -> Result<Operator> {
        Operator::start(
            identity,
            &self.operator_kubeconfig,
            ns,
            &self.run_dir.join("logs"),
        )
    }

    /// Tear everything down: containers, nodes, control plane, network.
    pub async fn stop(mut self) {
        for n in &mut self.nodes {
            n.shutdown().await;
        }
        self.dns.stop();
        self.cluster.stop().await;
        let _ = self.network.destroy().await;
    }
}

/// The RBAC part of a rendered chart: ServiceAccounts, (Cluster)Roles and their bindings.
pub fn rbac_documents(rendered: &str) -> Result<String> {
    let mut out = Vec::new();
    for doc in rendered.split("\n---") {
        let value: serde_yaml::Value = match serde_yaml::from_str(doc) {
            Ok(v) => v,
            Err(_) => continue,
        };
        let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        if matches!(
            kind,
            "ServiceAccount" | "ClusterRole" | "ClusterRoleBinding" | "Role" | "RoleBinding"
        ) {
            out.push(doc.trim().trim_start_matches("---").to_string());
        }
    }
    if out.is_empty() {
        bail!("the rendered chart has no RBAC documents");
    }
    Ok(out.join("\n---\n"))
}
