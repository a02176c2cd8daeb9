//! Operator replicas: the real `tandem-operator` binary, run with the kubeconfig of its
//! ServiceAccount (so only the RBAC the chart grants applies), leader election on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::Signal;

use crate::proc::{Process, free_port};
use crate::{http, wait};

/// The operator binary built by cargo (`make e2e` builds it before the suite runs).
pub fn binary() -> PathBuf {
    crate::repo_root().join("target/debug/tandem-operator")
}

/// Namespace of the operator's ServiceAccount and Lease.
pub const OPERATOR_NAMESPACE: &str = "tandem-system";

pub struct Operator {
    pub identity: String,
    pub metrics_port: u16,
    pub process: Process,
}

impl Operator {
    /// Start a replica watching `watch_namespace`.
    pub fn start(
        identity: &str,
        kubeconfig: &Path,
        watch_namespace: &str,
        log_dir: &Path,
    ) -> Result<Operator> {
        let bin = binary();
        anyhow::ensure!(
            bin.exists(),
            "{} is missing: build it first (`make e2e` runs `cargo build -p tandem-operator`)",
            bin.display()
        );
        let metrics_port = free_port()?;
        let args = vec![
            "--namespace".to_string(),
            watch_namespace.to_string(),
            "--metrics-addr".into(),
            format!("127.0.0.1:{metrics_port}"),
            "--leader-election=true".into(),
            "--lease-namespace".into(),
            OPERATOR_NAMESPACE.into(),
            "--identity".into(),
            identity.into(),
        ];
        let envs = vec![
            ("KUBECONFIG".to_string(), kubeconfig.display().to_string()),
            (
                "RUST_LOG".to_string(),
                "info,kube=warn,hyper=warn,tower=warn".to_string(),
            ),
        ];
        let process = Process::spawn(
            &format!("operator {identity}"),
            &bin,
            &args,
            &envs,
            &log_dir.join(format!("operator-{identity}.log")),
        )?;
        Ok(Operator {
            identity: identity.to_string(),
            metrics_port,
            process,
        })
    }

    /// The replica's Prometheus text.
    pub async fn metrics(&self) -> Result<String> {
        let r = http::get(
            &format!("127.0.0.1:{}", self.metrics_port),
            "/metrics",
            Duration::from_secs(3),
        )
        .await?;
        Ok(r.body)
    }

    /// Whether `tandem_operator_is_leader` is 1.
    pub async fn is_leader(&self) -> Result<bool> {
        let m = self.metrics().await?;
        Ok(m.lines().any(|l| l.trim() == "tandem_operator_is_leader 1"))
    }

    /// Wait until this replica leads.
    pub async fn wait_leading(&self, within: Duration) -> Result<()> {
        wait::until(
            &format!("operator {} to lead", self.identity),
            within,
            Duration::from_millis(300),
            || async { Ok(self.is_leader().await.unwrap_or(false).then_some(())) },
        )
        .await
        .with_context(|| self.process.log_tail(30))
    }

    pub fn kill(&self) -> Result<()> {
        self.process.signal(Signal::SIGKILL)
    }

    /// SIGTERM and wait (the replica releases its Lease).
    pub async fn stop(&mut self) -> Result<()> {
        self.process.stop(Duration::from_secs(15)).await?;
        Ok(())
    }
}
