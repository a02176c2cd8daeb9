//! `kubectl` as the scenarios' user runs it (the binary `make e2e-deps` installed, with
//! the admin kubeconfig).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, bail};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Outcome of one kubectl call.
#[derive(Debug, Clone)]
pub struct Output {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

#[derive(Debug, Clone)]
pub struct Kubectl {
    pub bin: PathBuf,
    pub kubeconfig: PathBuf,
}

impl Kubectl {
    pub fn new(bin: &Path, kubeconfig: &Path) -> Kubectl {
        Kubectl {
            bin: bin.to_path_buf(),
            kubeconfig: kubeconfig.to_path_buf(),
        }
    }

    /// Run with `stdin` (if any); never fails on a non-zero exit (see [`Output`]).
    pub async fn run_with(&self, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting kubectl")?;
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().expect("piped");
            pipe.write_all(input.as_bytes()).await?;
            drop(pipe);
        }
        let out = child.wait_with_output().await?;
        Ok(Output {
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    pub async fn run(&self, args: &[&str]) -> Result<Output> {
        self.run_with(args, None).await
    }

    /// Run and require success; returns stdout.
    pub async fn ok(&self, args: &[&str]) -> Result<String> {
        let out = self.run(args).await?;
        if !out.success {
            bail!("kubectl {} failed: {}", args.join(" "), out.stderr.trim());
        }
        Ok(out.stdout)
    }

    /// `kubectl apply -f -` of `yaml`, requiring success.
    pub async fn apply(&self, ns: &str, yaml: &str) -> Result<String> {
        let out = self
            .run_with(&["apply", "-n", ns, "-f", "-"], Some(yaml))
            .await?;
        if !out.success {
            bail!("kubectl apply failed: {}", out.stderr.trim());
        }
        Ok(out.stdout)
    }

    /// `kubectl get … -o json`, parsed.
    pub async fn json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        let text = self.ok(&a).await?;
        serde_json::from_str(&text).with_context(|| format!("kubectl {} output", a.join(" ")))
    }
}
