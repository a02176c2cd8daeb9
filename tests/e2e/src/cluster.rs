//! The control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler as
//! local processes in the run's network namespace (binaries from `make e2e-deps`), fresh
//! certificates and an empty etcd per run.
//!
//! Admission is the API server's default set plus NodeRestriction (PodSecurity included);
//! authorization is Node then RBAC, so each kubelet may touch only its own Node and the
//! pods bound to it, and the operator's ServiceAccount exactly what its Role grants. The
//! controller manager runs every default controller (garbage collector, EndpointSlices,
//! node lifecycle, service accounts, PersistentVolume binding, …) under per-controller
//! ServiceAccounts, with a short node-monitor grace period so a node that stops
//! heartbeating turns NotReady in seconds. The scheduler has two profiles: the default
//! one, and `tandem-e2e-scheduler` (same plugins) for the pod templates that name a
//! `schedulerName`.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use crate::net::{API_SERVICE_IP, CONTROL_PLANE_IP, SERVICE_CIDR};
use crate::pki::{NodeIdentity, Pki};
use crate::proc::{Process, log_tail};
use crate::{ETCD_VERSION, K8S_VERSION, NETPOL_VERSION, repo_root, wait};

/// How long the node lifecycle controller waits for a heartbeat before a node is NotReady.
pub const NODE_MONITOR_GRACE: Duration = Duration::from_secs(12);
/// The API server's port, on every address of the run's network namespace.
pub const API_PORT: u16 = 6443;
/// The second scheduler profile (a pod template's `schedulerName` passed through).
pub const SECOND_SCHEDULER: &str = "tandem-e2e-scheduler";

/// Where the Go-built binaries are cached: `$TANDEM_CACHE_DIR`, else `~/.cache/tandem`
/// (the same rule as `scripts/e2e-deps.sh`).
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/tandem")
}

/// Find a program on `PATH` (and in the sbin directories, where Debian puts iptables).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Where `make e2e-deps` put the binaries, and the node's system tools.
pub struct Binaries {
    pub etcd: PathBuf,
    pub apiserver: PathBuf,
    pub controller_manager: PathBuf,
    pub scheduler: PathBuf,
    pub kubelet: PathBuf,
    pub kube_proxy: PathBuf,
    pub netpol: PathBuf,
    pub kubectl: PathBuf,
    pub helm: PathBuf,
    pub containerd: PathBuf,
    pub ctr: PathBuf,
}

impl Binaries {
    pub fn locate() -> Result<Binaries> {
        let root = repo_root();
        let k8s = cache_dir().join("k8s").join(K8S_VERSION).join("bin");
        let netpol = cache_dir()
            .join("k8s")
            .join(format!("kube-router-{NETPOL_VERSION}"))
            .join("kube-router");
        let mut missing_tools = Vec::new();
        let mut tool = |name: &str| {
            which(name).unwrap_or_else(|| {
                missing_tools.push(name.to_string());
                PathBuf::from(name)
            })
        };
        let containerd = tool("containerd");
        let ctr = tool("ctr");
        for t in [
            "runc",
            "iptables",
            "iptables-restore",
            "conntrack",
            "nsenter",
            "unshare",
        ] {
            tool(t);
        }
        if !missing_tools.is_empty() {
            bail!(
                "missing on this machine: {} (apt-get install containerd runc containernetworking-plugins iptables ipset conntrack; .ci/run does it)",
                missing_tools.join(", ")
            );
        }
        let b = Binaries {
            etcd: root
                .join(".cache/k8s")
                .join(format!("etcd-{ETCD_VERSION}"))
                .join("etcd"),
            apiserver: k8s.join("kube-apiserver"),
            controller_manager: k8s.join("kube-controller-manager"),
            scheduler: k8s.join("kube-scheduler"),
            kubelet: k8s.join("kubelet"),
            kube_proxy: k8s.join("kube-proxy"),
            netpol,
            kubectl: root.join(".cache/bin/kubectl"),
            helm: root.join(".cache/bin/helm"),
            containerd,
            ctr,
        };
        for p in [
            &b.etcd,
            &b.apiserver,
            &b.controller_manager,
            &b.scheduler,
            &b.kubelet,
            &b.kube_proxy,
            &b.netpol,
            &b.kubectl,
            &b.helm,
        ] {
            if !p.exists() {
                bail!(
                    "{} is missing: run `make e2e-deps` (scripts/e2e-deps.sh) first",
                    p.display()
                );
            }
        }
        Ok(b)
    }
}

/// How a kubeconfig authenticates.
pub enum Credentials<'a> {
    ClientCert { cert: &'a Path, key: &'a Path },
    Token(&'a str),
}

/// Write a kubeconfig for `server` trusting `ca`.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    user: &str,
    creds: Credentials<'_>,
    namespace: &str,
) -> Result<()> {
    let user_body = match creds {
        Credentials::ClientCert { cert, key } => serde_json::json!({
            "client-certificate": cert, "client-key": key,
        }),
        Credentials::Token(t) => serde_json::json!({ "token": t }),
    };
    let cfg = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": user_body}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user, "namespace": namespace}}],
        "current-context": "e2e",
    });
    std::fs::write(path, serde_yaml::to_string(&cfg)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// A client from a kubeconfig file. Non-watch requests time out (the server is local).
pub async fn client_from(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let mut cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    cfg.read_timeout = Some(Duration::from_secs(60));
    Ok(Client::try_from(cfg)?)
}

/// The running control plane.
pub struct Cluster {
    pub dir: PathBuf,
    pub pki: Pki,
    /// The API server as the harness reaches it (loopback).
    pub server: String,
    /// The API server as nodes and pods reach it (the control plane's address).
    pub node_server: String,
    pub admin_kubeconfig: PathBuf,
    pub client: Client,
    pub bins: Binaries,
    etcd: Process,
    apiserver: Process,
    controller_manager: Process,
    scheduler: Process,
}

/// A kubeconfig for one of the PKI's component identities.
fn component_kubeconfig(
    dir: &Path,
    pki: &Pki,
    stem: &str,
    cn: &str,
    server: &str,
) -> Result<PathBuf> {
    let pair = pki.cert(stem)?;
    let path = dir.join(format!("{stem}.kubeconfig"));
    write_kubeconfig(
        &path,
        server,
        &pki.ca_cert,
        cn,
        Credentials::ClientCert {
            cert: &pair.cert,
            key: &pair.key,
        },
        "default",
    )?;
    Ok(path)
}

impl Cluster {
    /// Start etcd, the API server, the controller manager and the scheduler under `dir`
    /// (logs in `dir/logs`), with certificates for `nodes`' kubelets, and wait until the
    /// API answers and the `default` ServiceAccount exists.
    pub async fn start(dir: &Path, nodes: &[NodeIdentity]) -> Result<Cluster> {
        let bins = Binaries::locate()?;
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let pki = Pki::create(
            &dir.join("pki"),
            &[
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V4(CONTROL_PLANE_IP),
                IpAddr::V4(API_SERVICE_IP),
            ],
            &[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            nodes,
        )?;

        // The run has its own network namespace: fixed ports collide with nothing.
        let etcd_url = "http://127.0.0.1:2379".to_string();
        let peer_url = "http://127.0.0.1:2380".to_string();
        let etcd = Process::spawn(
            "etcd",
            &bins.etcd,
            &[
                "--name=e2e".into(),
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=e2e={peer_url}"),
                // Test data: losing it on a crash is fine, waiting for the disk is not.
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
            &[],
            &logs.join("etcd.log"),
        )?;
        wait::until(
            "etcd to answer /health",
            Duration::from_secs(60),
            Duration::from_millis(200),
            || async {
                Ok(
                    crate::http::get("127.0.0.1:2379", "/health", Duration::from_secs(2))
                        .await
                        .ok()
                        .filter(|r| r.status == 200 && r.body.contains("true")),
                )
            },
        )
        .await
        .with_context(|| log_tail(&logs.join("etcd.log"), 20))?;

        let server = format!("https://127.0.0.1:{API_PORT}");
        let node_server = format!("https://{CONTROL_PLANE_IP}:{API_PORT}");
        let kubelet_client = pki.cert("apiserver-kubelet-client")?.clone();
        let apiserver = Process::spawn(
            "kube-apiserver",
            &bins.apiserver,
            &[
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=0.0.0.0".into(),
                format!("--secure-port={API_PORT}"),
                format!("--advertise-address={CONTROL_PLANE_IP}"),
                format!("--tls-cert-file={}", pki.serving_cert.display()),
                format!("--tls-private-key-file={}", pki.serving_key.display()),
                format!("--client-ca-file={}", pki.ca_cert.display()),
                format!(
                    "--kubelet-client-certificate={}",
                    kubelet_client.cert.display()
                ),
                format!("--kubelet-client-key={}", kubelet_client.key.display()),
                format!("--kubelet-certificate-authority={}", pki.ca_cert.display()),
                "--kubelet-preferred-address-types=InternalIP".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", pki.sa_pub.display()),
                format!(
                    "--service-account-signing-key-file={}",
                    pki.sa_key.display()
                ),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--authorization-mode=Node,RBAC".into(),
                // PodSecurity is in the default set; named so nobody turns it off by accident.
                "--enable-admission-plugins=NodeRestriction,PodSecurity".into(),
                "--allow-privileged=false".into(),
                "--profiling=false".into(),
                "--enable-priority-and-fairness=false".into(),
                format!("--cert-dir={}", dir.join("apiserver-certs").display()),
                "--v=1".into(),
            ],
            &[],
            &logs.join("kube-apiserver.log"),
        )?;

        let admin_kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(
            &admin_kubeconfig,
            &server,
            &pki.ca_cert,
            "admin",
            Credentials::ClientCert {
                cert: &pki.admin_cert,
                key: &pki.admin_key,
            },
            "default",
        )?;
        let client = client_from(&admin_kubeconfig).await?;
        let mut apiserver = apiserver;
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = apiserver.try_exit()? {
                bail!(
                    "kube-apiserver exited ({status}):\n{}",
                    apiserver.log_tail(8)
                );
            }
            let req = http::Request::get("/readyz").body(Vec::new())?;
            if client
                .request_text(req)
                .await
                .is_ok_and(|t| t.trim() == "ok")
            {
                break;
            }
            if started.elapsed() > Duration::from_secs(180) {
                bail!(
                    "kube-apiserver not ready after 180s:\n{}",
                    apiserver.log_tail(8)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }

        let kcm_kubeconfig = component_kubeconfig(
            dir,
            &pki,
            "kube-controller-manager",
            "system:kube-controller-manager",
            &server,
        )?
        .display()
        .to_string();
        let controller_manager = Process::spawn(
            "kube-controller-manager",
            &bins.controller_manager,
            &[
                format!("--kubeconfig={kcm_kubeconfig}"),
                format!("--authentication-kubeconfig={kcm_kubeconfig}"),
                format!("--authorization-kubeconfig={kcm_kubeconfig}"),
                format!(
                    "--service-account-private-key-file={}",
                    pki.sa_key.display()
                ),
                format!("--root-ca-file={}", pki.ca_cert.display()),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=true".into(),
                "--bind-address=127.0.0.1".into(),
                "--secure-port=10257".into(),
                format!("--cert-dir={}", dir.join("kcm-certs").display()),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--node-monitor-period=2s".into(),
                format!(
                    "--node-monitor-grace-period={}s",
                    NODE_MONITOR_GRACE.as_secs()
                ),
                "--profiling=false".into(),
                "--v=1".into(),
            ],
            &[],
            &logs.join("kube-controller-manager.log"),
        )?;

        let sched_kubeconfig = component_kubeconfig(
            dir,
            &pki,
            "kube-scheduler",
            "system:kube-scheduler",
            &server,
        )?;
        let sched_config = dir.join("kube-scheduler.yaml");
        std::fs::write(
            &sched_config,
            serde_yaml::to_string(&serde_json::json!({
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": sched_kubeconfig},
                "leaderElection": {"leaderElect": false},
                "profiles": [
                    {"schedulerName": "default-scheduler"},
                    {"schedulerName": SECOND_SCHEDULER},
                ],
            }))?,
        )?;
        let scheduler = Process::spawn(
            "kube-scheduler",
            &bins.scheduler,
            &[
                format!("--config={}", sched_config.display()),
                format!("--authentication-kubeconfig={}", sched_kubeconfig.display()),
                format!("--authorization-kubeconfig={}", sched_kubeconfig.display()),
                "--bind-address=127.0.0.1".into(),
                "--secure-port=10259".into(),
                "--v=1".into(),
            ],
            &[],
            &logs.join("kube-scheduler.log"),
        )?;

        let cluster = Cluster {
            dir: dir.to_path_buf(),
            pki,
            server,
            node_server,
            admin_kubeconfig,
            client,
            bins,
            etcd,
            apiserver,
            controller_manager,
            scheduler,
        };
        cluster
            .wait_for_service_account("default", "default")
            .await?;
        Ok(cluster)
    }

    /// Wait for the controller manager to create a namespace's `default` ServiceAccount
    /// (pods cannot be admitted before it exists).
    pub async fn wait_for_service_account(&self, ns: &str, name: &str) -> Result<()> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        let r = wait::until(
            &format!("ServiceAccount {ns}/{name}"),
            Duration::from_secs(120),
            Duration::from_millis(300),
            || {
                let api = api.clone();
                async move { Ok(api.get_opt(name).await?.map(|_| ())) }
            },
        )
        .await;
        r.with_context(|| self.controller_manager.log_tail(20))
    }

    /// Create a namespace labelled for the `restricted` Pod Security level (enforce, audit
    /// and warn) and wait for its default ServiceAccount.
    pub async fn restricted_namespace(&self, ns: &str) -> Result<()> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let obj: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": ns, "labels": restricted_labels()},
        }))?;
        api.patch(
            ns,
            &kube::api::PatchParams::apply("tandem-e2e").force(),
            &kube::api::Patch::Apply(&obj),
        )
        .await
        .with_context(|| format!("creating namespace {ns}"))?;
        self.wait_for_service_account(ns, "default").await
    }

    /// Paths of the control plane's logs (named in failure reports).
    pub fn logs(&self) -> Vec<PathBuf> {
        vec![
            self.etcd.log.clone(),
            self.apiserver.log.clone(),
            self.controller_manager.log.clone(),
            self.scheduler.log.clone(),
        ]
    }

    /// Stop the scheduler, the controller manager, the API server and etcd (in that order).
    pub async fn stop(&mut self) {
        for p in [
            &mut self.scheduler,
            &mut self.controller_manager,
            &mut self.apiserver,
            &mut self.etcd,
        ] {
            let _ = p.stop(Duration::from_secs(10)).await;
        }
    }
}

/// The Pod Security level scenario namespaces enforce: `restricted`, unless a developer
/// sets `TANDEM_E2E_POD_SECURITY` (the suite then says so loudly on every run).
pub fn pod_security_level() -> String {
    std::env::var("TANDEM_E2E_POD_SECURITY").unwrap_or_else(|_| "restricted".into())
}

/// `pod-security.kubernetes.io/*` labels for [`pod_security_level`].
pub fn restricted_labels() -> serde_json::Value {
    let level = pod_security_level();
    serde_json::json!({
        "pod-security.kubernetes.io/enforce": level,
        "pod-security.kubernetes.io/enforce-version": "latest",
        "pod-security.kubernetes.io/audit": level,
        "pod-security.kubernetes.io/warn": level,
    })
}
