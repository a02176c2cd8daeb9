//! The run's cgroups: one subtree, `/tandem-e2e/<node>`, in every hierarchy under
//! `/sys/fs/cgroup` (cgroup v1 with a cgroup2 `unified` mount on these machines). Each
//! kubelet's `cgroupRoot` is its node's directory (it creates `kubepods/…` below it and runc
//! puts every container there), and containerd runs in `<node>/runtime`, so its shims — which
//! detach from containerd by design — are found there too.
//!
//! cgroupfs is not namespaced: these directories are the one thing the run creates outside
//! its namespaces. Teardown kills every process left in a node's subtree by its PID and
//! removes the directories; a run that was killed leaves empty directories, which the next
//! run removes before it starts ([`remove_leftovers`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Top directory of the run's cgroups in every hierarchy.
pub const TOP: &str = "tandem-e2e";

/// CPU weight of [`TOP`] (cgroup v1 `cpu.shares`; the default is 1024). The nodes' pods
/// are the system under test, probed with one-second timeouts, and their requests are
/// small (100m: 102 shares each inside the node). At the default weight the whole subtree
/// counts, when the CPUs are contended, as much as one thread at the root — one thread of
/// the CUDA suite that `make test` runs beside the e2e suite — so two busy threads there
/// left the pods a third of the machine, and every decode of a scenario could miss two
/// readiness probes at once. Eight times the default gives the cluster the CPUs it asks
/// for first; a job beside it gets what the cluster leaves idle.
const TOP_CPU_SHARES: u32 = 8 * 1024;
const CGROUP_FS: &str = "/sys/fs/cgroup";

/// Every mounted hierarchy (`/sys/fs/cgroup/cpu`, …, `/sys/fs/cgroup/unified`).
pub fn hierarchies() -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(CGROUP_FS).with_context(|| format!("listing {CGROUP_FS}"))? {
        let p = e?.path();
        // A comounted pair (cpu,cpuacct) also appears under each name as a symlink.
        if p.is_symlink() {
            continue;
        }
        if p.join("cgroup.procs").exists() {
            out.push(p);
        }
    }
    out.sort();
    if out.is_empty() {
        bail!("no cgroup hierarchy under {CGROUP_FS}");
    }
    Ok(out)
}

fn is_cpuset(h: &Path) -> bool {
    h.join("cpuset.cpus").exists()
}

/// Create `rel` (e.g. `tandem-e2e/e2e-node-a/runtime`) in every hierarchy. cpuset
/// directories start with no CPUs and no memory nodes: they get their parent's.
pub fn create(rel: &str) -> Result<()> {
    for h in hierarchies()? {
        let mut at = h.clone();
        for part in rel.split('/') {
            let parent = at.clone();
            at = at.join(part);
            if at.exists() {
                continue;
            }
            std::fs::create_dir(&at).with_context(|| format!("creating {}", at.display()))?;
            if at == h.join(TOP) && at.join("cpu.shares").exists() {
                std::fs::write(at.join("cpu.shares"), TOP_CPU_SHARES.to_string())
                    .with_context(|| format!("writing {}", at.join("cpu.shares").display()))?;
            }
            if is_cpuset(&h) {
                for f in ["cpuset.cpus", "cpuset.mems"] {
                    let v = std::fs::read_to_string(parent.join(f))?;
                    std::fs::write(at.join(f), v.trim())
                        .with_context(|| format!("writing {}", at.join(f).display()))?;
                }
            }
        }
    }
    Ok(())
}

/// The directories of `rel` in every hierarchy (where a process joins it).
pub fn dirs(rel: &str) -> Result<Vec<PathBuf>> {
    Ok(hierarchies()?.into_iter().map(|h| h.join(rel)).collect())
}

/// Every PID in `dir` and below (as seen from this PID namespace).
fn pids_below(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(
            text.lines()
                .filter_map(|l| l.trim().parse::<i32>().ok())
                .filter(|p| *p > 0),
        );
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                pids_below(&p, out);
            }
        }
    }
}

/// Processes still in `rel` or below (read from the `pids` hierarchy, or the first one).
pub fn processes(rel: &str) -> Result<Vec<i32>> {
    let hs = hierarchies()?;
    let h = hs
        .iter()
        .find(|h| h.ends_with("pids"))
        .unwrap_or(&hs[0])
        .join(rel);
    let mut out = Vec::new();
    pids_below(&h, &mut out);
    out.sort();
    out.dedup();
    Ok(out)
}

/// SIGKILL every process in `rel` and below, by PID, until none is left (at most `within`).
pub async fn kill_all(rel: &str, within: Duration) -> Result<usize> {
    let started = std::time::Instant::now();
    let mut killed = 0;
    loop {
        let left = processes(rel)?;
        if left.is_empty() {
            return Ok(killed);
        }
        for pid in &left {
            if kill(Pid::from_raw(*pid), Signal::SIGKILL).is_ok() {
                killed += 1;
            }
        }
        if started.elapsed() > within {
            bail!("processes still in cgroup {rel} after {within:?}: {left:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Remove `dir` and every directory below it (deepest first). Only empty cgroups can be
/// removed; a failure names the one that could not.
fn remove_tree(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)?.flatten() {
        let p = e.path();
        if p.is_dir() {
            remove_tree(&p)?;
        }
    }
    // A cgroup whose last process just exited can be busy for a moment.
    for attempt in 0.. {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if attempt < 20 => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e).with_context(|| format!("removing cgroup {}", dir.display())),
        }
    }
    unreachable!("the loop returns")
}

/// Remove `rel` and below from every hierarchy.
pub fn remove(rel: &str) -> Result<()> {
    let mut first_err = None;
    for h in hierarchies()? {
        if let Err(e) = remove_tree(&h.join(rel)) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Remove what a killed run left (empty directories under [`TOP`]). A directory that still
/// holds processes is an error naming it: something of another run is alive.
pub fn remove_leftovers() -> Result<()> {
    let left = processes(TOP)?;
    if !left.is_empty() {
        bail!(
            "processes {left:?} are still in the cgroups of an earlier e2e run (/sys/fs/cgroup/*/{TOP})"
        );
    }
    remove(TOP)
}
