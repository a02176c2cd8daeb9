//! Child processes of the harness (etcd, the control plane, each node's containerd, kubelet,
//! kube-proxy and NetworkPolicy enforcer): output to a log file, stopped with SIGTERM then
//! SIGKILL, and killed when the harness goes away — on drop, and through the parent-death
//! signal `e2e-exec` sets before it execs them. A node's processes are started in the
//! node's network namespace (and containerd in its cgroup) by `e2e-exec` too.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

static EXEC: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Tell the harness where `e2e-exec` is (cargo knows it only in the test target:
/// `env!("CARGO_BIN_EXE_e2e-exec")`).
pub fn set_exec_binary(path: PathBuf) {
    let _ = EXEC.set(path);
}

/// Path of the `e2e-exec` helper.
pub fn exec_binary() -> PathBuf {
    EXEC.get()
        .cloned()
        .expect("set_exec_binary is called before the harness starts")
}

/// Where a child runs: the harness's own namespaces by default, or a node's network
/// namespace, and cgroups it joins before it execs.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    pub netns: Option<PathBuf>,
    pub cgroups: Vec<PathBuf>,
}

/// A running child process with its log file.
pub struct Process {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Process {
    /// Start `program args` with stdout and stderr appended to `log`. The child dies with
    /// the harness (SIGKILL through the parent-death signal).
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(String, String)],
        log: &Path,
    ) -> Result<Process> {
        Self::spawn_in(name, program, args, envs, log, &Placement::default())
    }

    /// [`Process::spawn`] in a node's network namespace and cgroups.
    pub fn spawn_in(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(String, String)],
        log: &Path,
        at: &Placement,
    ) -> Result<Process> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = file.try_clone()?;
        let mut cmd = Command::new(exec_binary());
        if let Some(ns) = &at.netns {
            cmd.arg("--netns").arg(ns);
        }
        for c in &at.cgroups {
            cmd.arg("--cgroup").arg(c);
        }
        cmd.arg("--")
            .arg(program)
            .args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(Process {
            name: name.to_string(),
            log: log.to_path_buf(),
            child,
        })
    }

    pub fn pid(&self) -> Option<i32> {
        self.child.id().map(|p| p as i32)
    }

    /// Send a signal (no-op once the process has exited).
    pub fn signal(&self, sig: Signal) -> Result<()> {
        if let Some(pid) = self.pid() {
            kill(Pid::from_raw(pid), sig).with_context(|| format!("{sig} to {}", self.name))?;
        }
        Ok(())
    }

    /// Exit status if the process has exited.
    pub fn try_exit(&mut self) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Wait for the process to exit, at most `within`.
    pub async fn wait(&mut self, within: Duration) -> Result<std::process::ExitStatus> {
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(r) => Ok(r?),
            Err(_) => bail!("{} did not exit within {within:?}", self.name),
        }
    }

    /// SIGTERM, then SIGKILL after `grace`. Returns the exit status.
    pub async fn stop(&mut self, grace: Duration) -> Result<std::process::ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        self.signal(Signal::SIGTERM)?;
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(r) => Ok(r?),
            Err(_) => {
                self.child.start_kill()?;
                Ok(self.child.wait().await?)
            }
        }
    }

    /// The last `lines` lines of the log (for failure messages).
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

/// The last `lines` lines of a file, or a note that it cannot be read.
pub fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Run a command to completion; its output is returned, a failure names the command and
/// carries its stderr.
pub async fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for one test run).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}
