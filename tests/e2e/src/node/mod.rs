//! A real Kubernetes node: containerd (CRI, runc, the CNI bridge) and the kubelet, with
//! kube-proxy and the NetworkPolicy enforcer (kube-router's network policy controller)
//! beside them, in the node's own network
//! namespace ([`crate::net`]), under the node's own cgroup root ([`crate::cgroup`]), with
//! per-node directories and sockets ([`config::NodePaths`]).
//!
//! The kubelet authenticates as `system:node:<name>` (group `system:nodes`), so the API
//! server's Node authorizer and NodeRestriction admission apply to it, and serves its API on
//! the node's address with a certificate the API server verifies. The images the pods run
//! are imported into the node's containerd from `target/images` (built without a daemon by
//! `scripts/images.sh`) before the kubelet starts; nothing is ever pulled.

pub mod config;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::{Api, Client};
use nix::sys::signal::Signal;
use tracing::{info, warn};

use crate::cluster::{Binaries, Credentials, write_kubeconfig};
use crate::images::Image;
use crate::net::{API_SERVICE_IP, ClusterNetwork, NodeNetwork, SERVICE_CIDR};
use crate::pki::Pki;
use crate::proc::{Placement, Process, run};
use crate::{cgroup, wait};
use config::{KubeletTimings, NodePaths};

/// What a node is: its name, its index (address and pod subnet) and its labels.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub name: String,
    pub index: u8,
    /// `--node-labels` (NodeRestriction allows the kubelet only its own well-known labels).
    pub labels: BTreeMap<String, String>,
}

/// The kubelet's node status and Lease timings (the controller manager's grace period is
/// set against them in [`crate::cluster`]).
pub const KUBELET_TIMINGS: KubeletTimings = KubeletTimings {
    node_status_update_s: 2,
    node_lease_duration_s: 10,
};

/// Where every kubelet of the machine serves its device-plugin registry: fixed, whatever
/// its `--root-dir`. A starting kubelet empties the directory, then binds the socket; two
/// kubelets starting together can interleave (both empty it, then the second bind fails
/// `address already in use` and that kubelet's container manager never starts — a node
/// that never turns Ready, seen once in a run of this suite). So the nodes' kubelets start
/// one after another, each once this socket is its own.
const DEVICE_PLUGIN_SOCKET: &str = "/var/lib/kubelet/device-plugins/kubelet.sock";

static KUBELET_START: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Wait (at most 20 s) until the kubelet spawned at `spawned` has made its device-plugin
/// socket; a kubelet that takes longer is left to [`wait_node_ready`], which says why.
async fn device_plugin_socket_made(node: &str, spawned: std::time::SystemTime) {
    let made = wait::until(
        &format!("kubelet {node} to serve {DEVICE_PLUGIN_SOCKET}"),
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            let m = std::fs::metadata(DEVICE_PLUGIN_SOCKET).and_then(|m| m.modified());
            Ok(m.is_ok_and(|t| t >= spawned).then_some(()))
        },
    )
    .await;
    if let Err(e) = made {
        warn!(node, "starting the next kubelet anyway: {e:#}");
    }
}

pub struct Node {
    pub name: String,
    pub paths: NodePaths,
    pub net: NodeNetwork,
    cgroup_rel: String,
    ctr: PathBuf,
    logs: PathBuf,
    containerd: Process,
    kubelet: Process,
    proxy: Process,
    netpol: Process,
}

impl Node {
    /// Bring the node up: network, containerd (images imported), kubelet (Ready),
    /// kube-proxy (Service IPs answer from the node), the NetworkPolicy enforcer.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        spec: &NodeSpec,
        network: &ClusterNetwork,
        bins: &Binaries,
        pki: &Pki,
        server: &str,
        client: Client,
        images: &[Image],
        netpol_kubeconfig: &Path,
        dir: &Path,
        logs: &Path,
    ) -> Result<Node> {
        let name = spec.name.as_str();
        let net = network.add_node(name, spec.index).await?;
        let paths = NodePaths::new(dir, name);
        for d in [
            paths.dir.clone(),
            paths.run.clone(),
            paths.cni_conf_dir(),
            paths.cni_ipam_dir(),
            paths.kubelet_root(),
            paths.pod_logs(),
        ] {
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        let cni_bin = config::cni_bin_dir().context(
            "no CNI plugins in /usr/lib/cni or /opt/cni/bin: install containernetworking-plugins",
        )?;
        std::fs::write(
            paths.containerd_config(),
            config::containerd_toml(&paths, cni_bin),
        )?;
        std::fs::write(
            paths.cni_conf_dir().join("10-tandem-e2e.conflist"),
            config::cni_conflist(&paths, &net),
        )?;
        let cgroup_rel = format!("{}/{name}", cgroup::TOP);
        let runtime_cgroup = format!("{cgroup_rel}/runtime");
        cgroup::create(&runtime_cgroup)?;
        let in_node = Placement {
            netns: Some(net.netns_path()),
            cgroups: Vec::new(),
        };

        let containerd = Process::spawn_in(
            &format!("containerd {name}"),
            &bins.containerd,
            &[
                "--config".into(),
                paths.containerd_config().display().to_string(),
            ],
            &[],
            &logs.join(format!("{name}-containerd.log")),
            &Placement {
                netns: Some(net.netns_path()),
                cgroups: cgroup::dirs(&runtime_cgroup)?,
            },
        )?;
        let sock = paths.containerd_socket().display().to_string();
        let ctr = bins.ctr.clone();
        wait::until(
            &format!("containerd of {name} to answer"),
            Duration::from_secs(60),
            Duration::from_millis(200),
            || {
                let (ctr, sock) = (ctr.display().to_string(), sock.clone());
                async move { Ok(run(&ctr, &["-a", &sock, "version"]).await.ok().map(|_| ())) }
            },
        )
        .await
        .with_context(|| containerd.log_tail(20))?;
        for image in images {
            image.import(&bins.ctr, &paths.containerd_socket()).await?;
        }

        let kubelet_cert = pki.cert(&format!("kubelet-{name}"))?;
        let serving = pki.cert(&format!("kubelet-{name}-serving"))?;
        write_kubeconfig(
            &paths.kubelet_kubeconfig(),
            server,
            &pki.ca_cert,
            &format!("system:node:{name}"),
            Credentials::ClientCert {
                cert: &kubelet_cert.cert,
                key: &kubelet_cert.key,
            },
            "default",
        )?;
        std::fs::write(
            paths.kubelet_config(),
            config::kubelet_yaml(
                &paths,
                &net,
                &format!("/{cgroup_rel}"),
                &pki.ca_cert,
                &serving.cert,
                &serving.key,
                &KUBELET_TIMINGS,
            ),
        )?;
        let labels: Vec<String> = spec
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let mut kubelet_args = vec![
            format!("--config={}", paths.kubelet_config().display()),
            format!("--kubeconfig={}", paths.kubelet_kubeconfig().display()),
            format!("--root-dir={}", paths.kubelet_root().display()),
            format!("--cert-dir={}", paths.dir.join("kubelet-pki").display()),
            format!("--hostname-override={name}"),
            format!("--node-ip={}", net.ip),
            "--v=1".into(),
        ];
        if !labels.is_empty() {
            kubelet_args.push(format!("--node-labels={}", labels.join(",")));
        }
        let kubelet = {
            // One kubelet starts at a time: see `DEVICE_PLUGIN_SOCKET`.
            let _one_at_a_time = KUBELET_START.lock().await;
            let spawned = std::time::SystemTime::now();
            let kubelet = Process::spawn_in(
                &format!("kubelet {name}"),
                &bins.kubelet,
                &kubelet_args,
                &[],
                &logs.join(format!("{name}-kubelet.log")),
                &in_node,
            )?;
            device_plugin_socket_made(name, spawned).await;
            kubelet
        };
        wait_node_ready(&client, name, Duration::from_secs(180))
            .await
            .with_context(|| kubelet.log_tail(30))?;

        let proxy_cert = pki.cert("kube-proxy")?;
        write_kubeconfig(
            &paths.proxy_kubeconfig(),
            server,
            &pki.ca_cert,
            "system:kube-proxy",
            Credentials::ClientCert {
                cert: &proxy_cert.cert,
                key: &proxy_cert.key,
            },
            "default",
        )?;
        std::fs::write(paths.proxy_config(), config::kube_proxy_yaml(&paths, name))?;
        let proxy = Process::spawn_in(
            &format!("kube-proxy {name}"),
            &bins.kube_proxy,
            &[
                format!("--config={}", paths.proxy_config().display()),
                "--v=1".into(),
            ],
            &[],
            &logs.join(format!("{name}-kube-proxy.log")),
            &in_node,
        )?;
        // The `kubernetes` Service answers from the node once kube-proxy has written its
        // rules (the API server's own address stays reachable without them).
        let api = format!("{API_SERVICE_IP}:443");
        wait::until(
            &format!("kube-proxy of {name} to route the kubernetes Service"),
            Duration::from_secs(90),
            Duration::from_millis(500),
            || {
                let (ns, api) = (net.netns_path(), api.clone());
                async move { Ok(connect_from(&ns, &api, 1000).await?.then_some(())) }
            },
        )
        .await
        .with_context(|| proxy.log_tail(20))?;

        // kube-router with only its network policy controller: iptables (the nf_tables
        // backend) and ipsets in the node's network namespace.
        let netpol = Process::spawn_in(
            &format!("kube-router {name}"),
            &bins.netpol,
            &[
                "--run-firewall=true".into(),
                "--run-router=false".into(),
                "--run-service-proxy=false".into(),
                format!("--kubeconfig={}", netpol_kubeconfig.display()),
                format!("--hostname-override={name}"),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--enable-ipv4=true".into(),
                "--enable-ipv6=false".into(),
                "--metrics-port=0".into(),
                "--health-port=20244".into(),
                "--v=1".into(),
            ],
            &[],
            &logs.join(format!("{name}-kube-router.log")),
            &in_node,
        )?;
        info!(node = name, ip = %net.ip, pods = %net.pod_cidr(), "node ready");
        Ok(Node {
            name: name.to_string(),
            paths,
            net,
            cgroup_rel,
            ctr,
            logs: logs.to_path_buf(),
            containerd,
            kubelet,
            proxy,
            netpol,
        })
    }

    /// PID (in the run's PID namespace) of a container's first process.
    pub fn container_pid(&self, container_id: &str) -> Option<i32> {
        std::fs::read_to_string(self.paths.init_pid_file(container_id))
            .ok()?
            .trim()
            .parse()
            .ok()
            .filter(|p| *p > 0)
    }

    /// PID of the kubelet.
    pub fn kubelet_pid(&self) -> Option<i32> {
        self.kubelet.pid()
    }

    /// Freeze the kubelet (SIGSTOP): the node stops heartbeating, its containers keep
    /// running, nobody confirms a deletion there. [`Node::thaw_kubelet`] undoes it.
    pub fn freeze_kubelet(&self) -> Result<()> {
        self.kubelet.signal(Signal::SIGSTOP)
    }

    pub fn thaw_kubelet(&self) -> Result<()> {
        self.kubelet.signal(Signal::SIGCONT)
    }

    /// `ctr` against this node's containerd (namespace `k8s.io`).
    pub async fn ctr(&self, args: &[&str]) -> Result<String> {
        let sock = self.paths.containerd_socket().display().to_string();
        let mut a = vec!["-a", sock.as_str(), "-n", "k8s.io"];
        a.extend_from_slice(args);
        run(&self.ctr.display().to_string(), &a).await
    }

    /// Logs of the node's processes.
    pub fn log_files(&self) -> Vec<PathBuf> {
        [
            "containerd",
            "kubelet",
            "kube-proxy",
            "kube-network-policies",
        ]
        .iter()
        .map(|c| self.logs.join(format!("{}-{c}.log", self.name)))
        .collect()
    }

    /// Stop everything of the node, each process by its PID: the enforcer, kube-proxy and
    /// the kubelet (SIGTERM), every container and shim left in the node's cgroups
    /// (SIGKILL), containerd; then unmount what they mounted, remove the cgroups and the
    /// network namespace.
    pub async fn shutdown(&mut self) {
        let _ = self.kubelet.signal(Signal::SIGCONT);
        for p in [&mut self.netpol, &mut self.proxy, &mut self.kubelet] {
            if let Err(e) = p.stop(Duration::from_secs(10)).await {
                warn!(process = %p.name, "stopping: {e:#}");
            }
        }
        let pods = format!("{}/kubepods", self.cgroup_rel);
        match cgroup::kill_all(&pods, Duration::from_secs(20)).await {
            Ok(n) if n > 0 => info!(node = %self.name, "killed {n} container processes"),
            Ok(_) => {}
            Err(e) => warn!(node = %self.name, "killing containers: {e:#}"),
        }
        if let Err(e) = self.containerd.stop(Duration::from_secs(10)).await {
            warn!(node = %self.name, "stopping containerd: {e:#}");
        }
        if let Err(e) = cgroup::kill_all(&self.cgroup_rel, Duration::from_secs(20)).await {
            warn!(node = %self.name, "killing shims: {e:#}");
        }
        for prefix in [&self.paths.dir, &self.paths.run] {
            if let Err(e) = crate::mounts::unmount_below(prefix) {
                warn!(node = %self.name, "unmounting under {}: {e:#}", prefix.display());
            }
        }
        if let Err(e) = cgroup::remove(&self.cgroup_rel) {
            warn!(node = %self.name, "removing cgroups: {e:#}");
        }
        let _ = run("ip", &["netns", "del", &self.net.netns]).await;
    }
}

/// Wait until the Node object says Ready.
pub async fn wait_node_ready(client: &Client, name: &str, within: Duration) -> Result<()> {
    let api: Api<NodeObject> = Api::all(client.clone());
    wait::until_seen(
        &format!("node {name} to be Ready"),
        within,
        Duration::from_millis(500),
        || {
            let api = api.clone();
            async move {
                let Some(n) = api.get_opt(name).await? else {
                    return Ok(Err("not registered".to_string()));
                };
                let ready = n
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .into_iter()
                    .find(|c| c.type_ == "Ready");
                Ok(match ready {
                    Some(c) if c.status == "True" => Ok(()),
                    Some(c) => Err(format!(
                        "Ready={} {}",
                        c.status,
                        c.message.unwrap_or_default()
                    )),
                    None => Err("no Ready condition".into()),
                })
            }
        },
    )
    .await
}

/// One TCP connect to `addr` from inside the network namespace `netns` (through
/// `e2e-exec --connect`): `true` if it connected, `false` if refused or timed out.
pub async fn connect_from(netns: &Path, addr: &str, timeout_ms: u64) -> Result<bool> {
    let out = tokio::process::Command::new(crate::proc::exec_binary())
        .arg("--netns")
        .arg(netns)
        .args(["--connect", addr, "--timeout-ms", &timeout_ms.to_string()])
        .output()
        .await
        .context("running e2e-exec --connect")?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match said.as_str() {
        "connected" => Ok(true),
        "refused" | "timeout" => Ok(false),
        _ => bail!(
            "e2e-exec --connect {addr}: {said} {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    }
}
