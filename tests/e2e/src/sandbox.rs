//! The run's own namespaces. The scenarios binary re-executes itself, first thing, in new
//! network, mount and PID namespaces (`unshare`), under `e2e-exec --init` as PID 1:
//!
//! - **network**: the control plane, the cluster network's bridge and every node's network
//!   namespace live here, so no address, route, iptables/nftables rule or sysctl of the run
//!   touches the machine's own network, and fixed ports (6443, 10250, 53) never collide
//!   with anything else on the machine;
//! - **mount** (a slave of the machine's: its mounts are seen here, ours never leave): a
//!   private tmpfs on `/run` (network namespace files, containerd's shim sockets, runc state,
//!   the xtables lock), and every mount the
//!   nodes make (container root filesystems, volumes, tmpfs for Secrets);
//! - **PID**: when the suite ends or is killed, PID 1 exits and the kernel kills every
//!   process left in the namespace (container shims detach from containerd by design, so
//!   only this catches them after a crash); the mount namespace then has no process left and
//!   every mount in it is gone.
//!
//! The orderly teardown (`Env::stop`) still stops every process by its PID and unmounts what
//! the nodes mounted; the namespaces are what makes a crash leave nothing behind but the
//! cgroup directories under `/sys/fs/cgroup/*/tandem-e2e`, which the next run removes
//! (`cgroup::remove_leftovers`).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use nix::mount::{MsFlags, mount};
use nix::unistd::Uid;

/// Set in the re-executed process: it is inside the namespaces.
pub const INSIDE: &str = "TANDEM_E2E_SANDBOX";

/// Outside the sandbox: re-execute this program inside it (does not return). Inside:
/// prepare the namespaces (private `/run`, loopback up, forwarding on) and return.
pub fn enter(init: &Path) -> Result<()> {
    if std::env::var_os(INSIDE).is_none() {
        if !Uid::effective().is_root() {
            bail!(
                "the e2e suite needs root: it creates network, mount and PID namespaces and runs containerd and the kubelet"
            );
        }
        let exe = std::env::current_exe().context("locating the scenarios binary")?;
        let err = Command::new("unshare")
            .args([
                "--net",
                "--mount",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                "--propagation",
                "slave",
                "--",
            ])
            .arg(init)
            .arg("--init")
            .arg("--")
            .arg(exe)
            .args(std::env::args_os().skip(1))
            .env(INSIDE, "1")
            .exec();
        bail!("exec unshare (util-linux): {err}");
    }
    mount(
        Some("tmpfs"),
        "/run",
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=755,size=256m"),
    )
    .context("mounting a private tmpfs on /run")?;
    std::fs::create_dir_all("/run/netns")?;
    let lo = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()?;
    if !lo.success() {
        bail!("ip link set lo up failed in the run's network namespace");
    }
    sysctl("net/ipv4/ip_forward", "1")?;
    Ok(())
}

/// Write a sysctl of the current network namespace (`/proc/sys/<key>`).
pub fn sysctl(key: &str, value: &str) -> Result<()> {
    let path = Path::new("/proc/sys").join(key);
    std::fs::write(&path, value).with_context(|| format!("writing {}", path.display()))
}
