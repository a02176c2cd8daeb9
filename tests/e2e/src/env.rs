//! The whole test environment, started once for the suite: the run's namespaces (entered
//! in `main`), the cluster network, the control plane, cluster DNS, two real nodes, and
//! Tandem installed with `helm install` of `charts/tandem`; `kubectl` and `helm` with the
//! admin kubeconfig.
//!
//! One run at a time per machine (a lock in /tmp): the network is the run's own, but two
//! suites on two cores would only make each other's timings meaningless.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::Api;
use nix::fcntl::{Flock, FlockArg};
use tracing::{info, warn};

use crate::cluster::{Cluster, Credentials, write_kubeconfig};
use crate::dns::DnsServer;
use crate::images::Image;
use crate::kubectl::Kubectl;
use crate::net::{CONTROL_PLANE_IP, ClusterNetwork, DNS_SERVICE_IP, node_ip};
use crate::node::{Node, NodeSpec};
use crate::operator::{Helm, OPERATOR_NAMESPACE};
use crate::pki::NodeIdentity;
use crate::{cgroup, repo_root};

/// Nodes of the cluster. Scenarios cordon and freeze them by these names.
pub const NODE_A: &str = "e2e-node-a";
pub const NODE_B: &str = "e2e-node-b";
/// The zone label each node carries (its kubelet sets it; NodeRestriction allows it).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The ServiceAccount the operator runs as (the chart's).
pub const OPERATOR_SA: &str = "tandem-operator";

pub struct Env {
    pub run_dir: PathBuf,
    pub cluster: Cluster,
    pub network: ClusterNetwork,
    pub dns: DnsServer,
    pub nodes: Vec<Node>,
    pub kubectl: Kubectl,
    pub helm: Helm,
    pub images: Vec<Image>,
    /// When `helm install` started, and how long it took to a leading operator.
    pub installed_at: Instant,
    pub install_took: Duration,
    _lock: Flock<File>,
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

/// The nodes: two zones, one node each.
pub fn node_specs() -> Vec<NodeSpec> {
    [(NODE_A, "zone-a"), (NODE_B, "zone-b")]
        .iter()
        .enumerate()
        .map(|(i, (name, zone))| NodeSpec {
            name: name.to_string(),
            index: i as u8,
            labels: BTreeMap::from([(ZONE_LABEL.to_string(), zone.to_string())]),
        })
        .collect()
}

/// Objects a cluster's installer would create before any workload: the `kube-dns`
/// Service (no selector: its EndpointSlice names the harness's DNS server), the API
/// server's access to kubelets, and the NetworkPolicy enforcer's (kube-router's)
/// ServiceAccount and read-only RBAC.
fn bootstrap_objects() -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {{k8s-app: kube-dns}}
spec:
  clusterIP: {DNS_SERVICE_IP}
  ports:
    - {{name: dns, port: 53, protocol: UDP, targetPort: 53}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-harness
  namespace: kube-system
  labels:
    kubernetes.io/service-name: kube-dns
    endpointslice.kubernetes.io/managed-by: tandem-e2e
addressType: IPv4
ports:
  - {{name: dns, port: 53, protocol: UDP}}
endpoints:
  - addresses: ["{CONTROL_PLANE_IP}"]
    conditions: {{ready: true}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: tandem-e2e-apiserver-kubelet-client
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:kubelet-api-admin"}}
subjects:
  - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: kube-router, namespace: kube-system}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: kube-router-netpol}}
rules:
  - apiGroups: [""]
    resources: [namespaces, pods, services, nodes, endpoints]
    verbs: [get, list, watch]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [get, list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [get, list, watch]
  - apiGroups: ["", events.k8s.io]
    resources: [events]
    verbs: [create, patch, update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: kube-router-netpol}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kube-router-netpol}}
subjects:
  - {{kind: ServiceAccount, name: kube-router, namespace: kube-system}}
"#
    )
}

impl Env {
    pub async fn start(run_dir: &Path) -> Result<Env> {
        let lock = tokio::task::spawn_blocking(lock).await??;
        cgroup::remove_leftovers()?;
        let images = crate::images::built()?;
        models_dir()?;
        std::fs::create_dir_all(run_dir)?;
        let logs = run_dir.join("logs");
        std::fs::create_dir_all(&logs)?;

        let network = ClusterNetwork::create().await?;
        let specs = node_specs();
        let identities: Vec<NodeIdentity> = specs
            .iter()
            .map(|s| NodeIdentity {
                name: s.name.clone(),
                ip: node_ip(s.index).into(),
            })
            .collect();
        let cluster = Cluster::start(run_dir, &identities).await?;
        let client = cluster.client.clone();
        let kubectl = Kubectl::new(&cluster.bins.kubectl, &cluster.admin_kubeconfig);
        let helm = Helm::new(&cluster.bins.helm, &cluster.admin_kubeconfig);

        kubectl.apply("kube-system", &bootstrap_objects()).await?;
        let token = kubectl
            .ok(&[
                "create",
                "token",
                "kube-router",
                "-n",
                "kube-system",
                "--duration=12h",
            ])
            .await?;
        let netpol_kubeconfig = run_dir.join("kube-router.kubeconfig");
        write_kubeconfig(
            &netpol_kubeconfig,
            &cluster.node_server,
            &cluster.pki.ca_cert,
            "system:serviceaccount:kube-system:kube-router",
            Credentials::Token(token.trim()),
            "kube-system",
        )?;
        let dns =
            DnsServer::start(client.clone(), SocketAddr::from((CONTROL_PLANE_IP, 53))).await?;

        let dirs: Vec<PathBuf> = specs
            .iter()
            .map(|s| run_dir.join("nodes").join(&s.name))
            .collect();
        let starts = specs.iter().zip(&dirs).map(|(s, dir)| {
            Node::start(
                s,
                &network,
                &cluster.bins,
                &cluster.pki,
                &cluster.node_server,
                client.clone(),
                &images,
                &netpol_kubeconfig,
                dir,
                &logs,
            )
        });
        let nodes = futures::future::try_join_all(starts).await?;

        let mut env = Env {
            run_dir: run_dir.to_path_buf(),
            cluster,
            network,
            dns,
            nodes,
            kubectl,
            helm,
            images,
            installed_at: Instant::now(),
            install_took: Duration::ZERO,
            _lock: lock,
        };
        env.install_tandem().await?;
        info!("environment ready");
        Ok(env)
    }

    /// `helm install` of the chart, as docs/install.md says: the release namespace
    /// labelled for the restricted Pod Security profile, default values. Waits until the
    /// Deployment is rolled out and one replica leads.
    async fn install_tandem(&mut self) -> Result<()> {
        self.cluster
            .restricted_namespace(OPERATOR_NAMESPACE)
            .await?;
        self.installed_at = Instant::now();
        self.helm
            .install(&[])
            .await
            .with_context(|| self.operator_diagnostics())?;
        crate::operator::wait_leader(&self.cluster.client, Duration::from_secs(120)).await?;
        self.install_took = self.installed_at.elapsed();
        Ok(())
    }

    /// What to look at when the operator does not come up.
    fn operator_diagnostics(&self) -> String {
        format!(
            "operator pod logs under {}/nodes/*/pod-logs/{OPERATOR_NAMESPACE}_*",
            self.run_dir.display()
        )
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

    /// PID (in the run's PID namespace) of the first container's process of a pod, on
    /// whichever node runs it; `None` while it has no running container.
    pub fn container_pid(&self, pod: &Pod) -> Option<i32> {
        let node = pod.spec.as_ref()?.node_name.clone()?;
        let id = pod
            .status
            .as_ref()?
            .container_statuses
            .as_ref()?
            .first()?
            .container_id
            .clone()?;
        let id = id.strip_prefix("containerd://")?;
        self.nodes
            .iter()
            .find(|n| n.name == node)?
            .container_pid(id)
    }

    /// PID of a pod's container process, read from the API and its node.
    pub async fn pid_of(&self, ns: &str, pod: &str) -> Result<i32> {
        let p = Api::<Pod>::namespaced(self.cluster.client.clone(), ns)
            .get(pod)
            .await?;
        self.container_pid(&p)
            .with_context(|| format!("pod {ns}/{pod} has no running container"))
    }

    /// The network namespace of a pod (through its container's process).
    pub async fn pod_netns(&self, ns: &str, pod: &str) -> Result<PathBuf> {
        Ok(PathBuf::from(format!(
            "/proc/{}/ns/net",
            self.pid_of(ns, pod).await?
        )))
    }

    /// One TCP connect from inside a pod's network namespace: whether it connected.
    pub async fn connect_from_pod(&self, ns: &str, pod: &str, addr: &str) -> Result<bool> {
        crate::node::connect_from(&self.pod_netns(ns, pod).await?, addr, 2000).await
    }

    /// Resolve `name` as the pod does: its resolv.conf and hosts, its network namespace.
    pub async fn resolve_in_pod(&self, ns: &str, pod: &str, name: &str) -> Result<Vec<String>> {
        let pid = self.pid_of(ns, pod).await?;
        let out = tokio::process::Command::new(crate::proc::exec_binary())
            .arg("--netns")
            .arg(format!("/proc/{pid}/ns/net"))
            .arg("--pod-root")
            .arg(format!("/proc/{pid}/root"))
            .args(["--resolve", name])
            .output()
            .await?;
        if !out.status.success() {
            bail!(
                "resolving {name} in {ns}/{pod}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect())
    }

    /// `kubectl logs` of a pod's container (through the API server and the kubelet).
    pub async fn pod_log(&self, ns: &str, pod: &str, previous: bool) -> Result<String> {
        let mut args = vec!["logs", "-n", ns, pod];
        if previous {
            args.push("--previous");
        }
        self.kubectl.ok(&args).await
    }

    /// Every log file the nodes' kubelets kept for pods in `ns` whose name starts with
    /// `prefix` (all container instances, the current and the restarted ones).
    pub fn kept_pod_logs(&self, ns: &str, prefix: &str) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for n in &self.nodes {
            let Ok(dirs) = std::fs::read_dir(n.paths.pod_logs()) else {
                continue;
            };
            for d in dirs.flatten() {
                let name = d.file_name().to_string_lossy().to_string();
                if !name.starts_with(&format!("{ns}_{prefix}")) {
                    continue;
                }
                let Ok(containers) = std::fs::read_dir(d.path()) else {
                    continue;
                };
                for c in containers.flatten() {
                    if let Ok(files) = std::fs::read_dir(c.path()) {
                        out.extend(files.flatten().map(|f| f.path()));
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// After a failed start: whatever the nodes had started (containers, shims) is killed by
    /// its PID from the run's cgroups, their mounts undone, the cgroups removed. The
    /// processes the harness started itself were killed when their handles were dropped.
    pub async fn clean_up_failed_start(run_dir: &Path) {
        if let Err(e) = cgroup::kill_all(cgroup::TOP, Duration::from_secs(20)).await {
            warn!("killing what the nodes started: {e:#}");
        }
        for dir in [run_dir, Path::new("/run/tandem-e2e")] {
            let _ = crate::mounts::unmount_below(dir);
        }
        if let Err(e) = cgroup::remove(cgroup::TOP) {
            warn!("removing the run's cgroups: {e:#}");
        }
    }

    /// Tear everything down: the nodes (every process by PID, mounts, cgroups), DNS, the
    /// control plane. The run's namespaces go with the suite's PID 1.
    pub async fn stop(mut self) {
        futures::future::join_all(self.nodes.iter_mut().map(|n| n.shutdown())).await;
        self.dns.stop();
        self.cluster.stop().await;
        if let Err(e) = cgroup::remove(cgroup::TOP) {
            warn!("removing the run's cgroups: {e:#}");
        }
        let _ = crate::mounts::unmount_below(&self.run_dir);
    }
}
