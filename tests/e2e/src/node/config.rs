//! Configuration files of one node, as pure functions of where things are (unit-tested
//! below): containerd's `config.toml`, the CNI network list, the kubelet's
//! `KubeletConfiguration` and kube-proxy's `KubeProxyConfiguration`.

use std::path::{Path, PathBuf};

use crate::net::{CLUSTER_CIDR, CLUSTER_DOMAIN, DNS_SERVICE_IP, NodeNetwork};

/// The sandbox image containerd runs for every pod (imported from `target/images`).
pub const PAUSE_IMAGE: &str = "ghcr.io/tandem/pause:e2e";
/// Where Debian's containernetworking-plugins put the CNI plugins.
pub const CNI_BIN_DIRS: [&str; 2] = ["/usr/lib/cni", "/opt/cni/bin"];

/// Where a node keeps its files: on disk under the run directory (images, the kubelet's
/// volumes, logs) and in the run's private `/run` (sockets, runtime state).
#[derive(Debug, Clone)]
pub struct NodePaths {
    pub dir: PathBuf,
    pub run: PathBuf,
}

impl NodePaths {
    pub fn new(dir: &Path, name: &str) -> NodePaths {
        NodePaths {
            dir: dir.to_path_buf(),
            run: PathBuf::from("/run/tandem-e2e").join(name),
        }
    }
    pub fn containerd_config(&self) -> PathBuf {
        self.dir.join("containerd.toml")
    }
    pub fn containerd_root(&self) -> PathBuf {
        self.dir.join("containerd")
    }
    pub fn containerd_state(&self) -> PathBuf {
        self.run.join("containerd")
    }
    pub fn containerd_socket(&self) -> PathBuf {
        self.run.join("containerd.sock")
    }
    pub fn runc_root(&self) -> PathBuf {
        self.run.join("runc")
    }
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni/net.d")
    }
    pub fn cni_ipam_dir(&self) -> PathBuf {
        self.dir.join("cni/ipam")
    }
    pub fn kubelet_config(&self) -> PathBuf {
        self.dir.join("kubelet.yaml")
    }
    pub fn kubelet_kubeconfig(&self) -> PathBuf {
        self.dir.join("kubelet.kubeconfig")
    }
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet")
    }
    pub fn pod_logs(&self) -> PathBuf {
        self.dir.join("pod-logs")
    }
    pub fn proxy_config(&self) -> PathBuf {
        self.dir.join("kube-proxy.yaml")
    }
    pub fn proxy_kubeconfig(&self) -> PathBuf {
        self.dir.join("kube-proxy.kubeconfig")
    }
    /// `init.pid` of a container's runc task (the container's first process, as seen from
    /// the run's PID namespace).
    pub fn init_pid_file(&self, container_id: &str) -> PathBuf {
        self.containerd_state()
            .join("io.containerd.runtime.v2.task/k8s.io")
            .join(container_id)
            .join("init.pid")
    }
}

/// containerd 1.6 with the CRI plugin: per-node root, state and sockets; runc with cgroupfs;
/// the CNI plugins of the distribution; and `restrict_oom_score_adj`, without which every
/// sandbox fails here (the kubelet asks for an `oom_score_adj` below containerd's own, and
/// these machines lack CAP_SYS_RESOURCE to lower it).
pub fn containerd_toml(p: &NodePaths, cni_bin_dir: &str) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{runc}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"#,
        root = p.containerd_root().display(),
        state = p.containerd_state().display(),
        sock = p.containerd_socket().display(),
        opt = p.dir.join("opt").display(),
        runc = p.runc_root().display(),
        cni_conf = p.cni_conf_dir().display(),
    )
}

/// The pod network of one node: a Linux bridge (`cni0`, the pods' gateway) with host-local
/// addresses from the node's /24, and portmap for `hostPort`. No masquerading: pod
/// addresses are routed across the cluster network.
pub fn cni_conflist(p: &NodePaths, net: &NodeNetwork) -> String {
    serde_json::to_string_pretty(&serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "tandem-e2e",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net.pod_cidr(), "gateway": net.pod_gateway().to_string()}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": p.cni_ipam_dir(),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    }))
    .expect("a JSON value serializes")
}

/// Timings of the kubelet that the scenarios depend on.
pub struct KubeletTimings {
    /// How often the kubelet posts node status (and the Lease is renewed a quarter of the
    /// lease duration).
    pub node_status_update_s: u32,
    pub node_lease_duration_s: u32,
}

/// The kubelet: cgroup v1 with cgroupfs under the node's own cgroup root; TLS serving with
/// the harness's certificate and webhook authentication/authorization (the API server's
/// `logs`/`exec` go through RBAC); cluster DNS at the `kube-dns` Service; eviction and image
/// garbage collection effectively off (the machine's disk and memory are shared with other
/// work, and the node must not evict the suite's pods or delete its images); no swap.
pub fn kubelet_yaml(
    p: &NodePaths,
    net: &NodeNetwork,
    cgroup_root: &str,
    ca: &Path,
    serving_cert: &Path,
    serving_key: &Path,
    t: &KubeletTimings,
) -> String {
    let doc = serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": false,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": true,
        "enforceNodeAllocatable": ["pods"],
        "containerRuntimeEndpoint": format!("unix://{}", p.containerd_socket().display()),
        "address": net.ip.to_string(),
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": serving_cert,
        "tlsPrivateKeyFile": serving_key,
        "rotateCertificates": false,
        "serverTLSBootstrap": false,
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": ca},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [DNS_SERVICE_IP.to_string()],
        "clusterDomain": CLUSTER_DOMAIN,
        // No host resolv.conf merged into the pods' (no upstream on these machines).
        "resolvConf": "",
        "podLogsDir": p.pod_logs(),
        "nodeStatusUpdateFrequency": format!("{}s", t.node_status_update_s),
        "nodeStatusReportFrequency": format!("{}s", t.node_status_update_s),
        "nodeLeaseDurationSeconds": t.node_lease_duration_s,
        "syncFrequency": "10s",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
            "imagefs.inodesFree": "1%",
        },
        "evictionPressureTransitionPeriod": "10s",
        // Lowering a score needs CAP_SYS_RESOURCE, which these machines do not give.
        "oomScoreAdj": 0,
        "serializeImagePulls": false,
        "maxPods": 60,
        "failSwapOn": true,
        "shutdownGracePeriod": "0s",
        "staticPodPath": "",
        "runtimeRequestTimeout": "2m",
    });
    serde_yaml::to_string(&doc).expect("a JSON value serializes")
}

/// kube-proxy in iptables mode, in the node's network namespace. The conntrack settings it
/// would write machine-wide are left as they are (`maxPerCore: 0`, timeouts 0).
pub fn kube_proxy_yaml(p: &NodePaths, node: &str) -> String {
    let doc = serde_json::json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": p.proxy_kubeconfig()},
        "hostnameOverride": node,
        "mode": "iptables",
        "clusterCIDR": CLUSTER_CIDR,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s", "localhostNodePorts": false},
    });
    serde_yaml::to_string(&doc).expect("a JSON value serializes")
}

/// The first directory of [`CNI_BIN_DIRS`] that holds the bridge plugin.
pub fn cni_bin_dir() -> Option<&'static str> {
    CNI_BIN_DIRS
        .into_iter()
        .find(|d| Path::new(d).join("bridge").exists())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::{node_ip, pod_subnet};

    fn fixture() -> (NodePaths, NodeNetwork) {
        (
            NodePaths::new(Path::new("/r/nodes/n"), "n"),
            NodeNetwork {
                netns: "tdm-n".into(),
                ip: node_ip(0),
                pod_subnet: pod_subnet(0),
            },
        )
    }

    #[test]
    fn containerd_restricts_oom_score_adj_and_keeps_everything_per_node() {
        let (p, _) = fixture();
        let t = containerd_toml(&p, "/usr/lib/cni");
        assert!(t.contains("restrict_oom_score_adj = true"), "{t}");
        assert!(t.contains(r#"root = "/r/nodes/n/containerd""#), "{t}");
        assert!(
            t.contains(r#"state = "/run/tandem-e2e/n/containerd""#),
            "{t}"
        );
        assert!(
            t.contains(r#"address = "/run/tandem-e2e/n/containerd.sock""#),
            "{t}"
        );
        assert!(t.contains("SystemdCgroup = false"), "{t}");
        assert!(
            t.contains(&format!(r#"sandbox_image = "{PAUSE_IMAGE}""#)),
            "{t}"
        );
    }

    #[test]
    fn cni_uses_the_nodes_subnet_and_gateway() {
        let (p, n) = fixture();
        let v: serde_json::Value = serde_json::from_str(&cni_conflist(&p, &n)).unwrap();
        let ipam = &v["plugins"][0]["ipam"];
        assert_eq!(ipam["ranges"][0][0]["subnet"], "10.244.0.0/24");
        assert_eq!(ipam["ranges"][0][0]["gateway"], "10.244.0.1");
        assert_eq!(v["plugins"][0]["type"], "bridge");
        assert_eq!(v["plugins"][1]["type"], "portmap");
    }

    #[test]
    fn kubelet_runs_on_cgroup_v1_with_cluster_dns() {
        let (p, n) = fixture();
        let y = kubelet_yaml(
            &p,
            &n,
            "/tandem-e2e/n",
            Path::new("/ca"),
            Path::new("/c"),
            Path::new("/k"),
            &KubeletTimings {
                node_status_update_s: 2,
                node_lease_duration_s: 10,
            },
        );
        let v: serde_yaml::Value = serde_yaml::from_str(&y).unwrap();
        assert_eq!(v["failCgroupV1"], false);
        assert_eq!(v["cgroupDriver"], "cgroupfs");
        assert_eq!(v["cgroupRoot"], "/tandem-e2e/n");
        assert_eq!(v["clusterDNS"][0], "10.96.0.10");
        assert_eq!(v["authorization"]["mode"], "Webhook");
        assert_eq!(v["address"], "10.213.0.10");
    }
}
