//! `e2e-pod-exec`: what a container runtime does between fork and exec, for the process
//! kubelet of the end-to-end tests. Runs as root, then becomes the container's process:
//!
//! 1. joins the pod's network namespace (`--netns /var/run/netns/<name>`);
//! 2. enters new mount and UTS namespaces (mounts stay private to the pod) and sets the
//!    pod's hostname;
//! 3. bind-mounts the pod's `resolv.conf` and `hosts` (from `--etc <dir>`) over `/etc` and
//!    each `--mount SRC:DST:ro|rw` volume, then makes `/` read-only if asked;
//! 4. drops to the pod's groups, GID and UID, sets no-new-privileges if asked;
//! 5. asks to be killed when its parent (the kubelet) dies, and execs the program with the
//!    environment the kubelet prepared.
//!
//! `--exec-only -- PROGRAM ARGS…` does only step 5 (the harness's own children).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, setns, unshare};
use nix::sys::prctl;
use nix::sys::signal::Signal;
use nix::unistd::{Gid, Uid, getppid, setgid, setgroups, sethostname, setuid};

#[derive(Debug, Default)]
struct Opts {
    exec_only: bool,
    netns: Option<PathBuf>,
    etc: Option<PathBuf>,
    hostname: Option<String>,
    uid: Option<u32>,
    gid: Option<u32>,
    groups: Vec<u32>,
    mounts: Vec<(PathBuf, PathBuf, bool)>,
    read_only_root: bool,
    no_new_privs: bool,
    workdir: Option<PathBuf>,
    program: Vec<OsString>,
}

fn parse(args: Vec<OsString>) -> Result<Opts> {
    let mut o = Opts::default();
    let mut it = args.into_iter();
    let value = |it: &mut std::vec::IntoIter<OsString>, flag: &str| -> Result<String> {
        it.next()
            .and_then(|v| v.into_string().ok())
            .with_context(|| format!("{flag} needs a value"))
    };
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--") => {
                o.program = it.by_ref().collect();
                break;
            }
            Some("--exec-only") => o.exec_only = true,
            Some("--netns") => o.netns = Some(value(&mut it, "--netns")?.into()),
            Some("--etc") => o.etc = Some(value(&mut it, "--etc")?.into()),
            Some("--hostname") => o.hostname = Some(value(&mut it, "--hostname")?),
            Some("--uid") => o.uid = Some(value(&mut it, "--uid")?.parse()?),
            Some("--gid") => o.gid = Some(value(&mut it, "--gid")?.parse()?),
            Some("--groups") => {
                for g in value(&mut it, "--groups")?
                    .split(',')
                    .filter(|g| !g.is_empty())
                {
                    o.groups.push(g.parse()?);
                }
            }
            Some("--mount") => {
                let m = value(&mut it, "--mount")?;
                let mut parts = m.rsplitn(3, ':');
                let (mode, dst, src) = (parts.next(), parts.next(), parts.next());
                let (Some(mode), Some(dst), Some(src)) = (mode, dst, src) else {
                    bail!("--mount {m:?}: expected SRC:DST:ro|rw");
                };
                o.mounts.push((src.into(), dst.into(), mode == "ro"));
            }
            Some("--read-only-root") => o.read_only_root = true,
            Some("--no-new-privs") => o.no_new_privs = true,
            Some("--workdir") => o.workdir = Some(value(&mut it, "--workdir")?.into()),
            _ => bail!("unknown argument {a:?}"),
        }
    }
    if o.program.is_empty() {
        bail!("no program after --");
    }
    Ok(o)
}

fn bind(src: &std::path::Path, dst: &std::path::Path, read_only: bool) -> Result<()> {
    mount(
        Some(src),
        dst,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .with_context(|| format!("bind-mounting {} on {}", src.display(), dst.display()))?;
    if read_only {
        mount(
            None::<&str>,
            dst,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .with_context(|| format!("making {} read-only", dst.display()))?;
    }
    Ok(())
}

fn enter_pod(o: &Opts) -> Result<()> {
    if let Some(ns) = &o.netns {
        let f = std::fs::File::open(ns).with_context(|| format!("opening {}", ns.display()))?;
        setns(f, CloneFlags::CLONE_NEWNET).context("joining the pod's network namespace")?;
    }
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS)
        .context("new mount and UTS namespaces")?;
    // Nothing mounted from here on may leak back to the host.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .context("making / a slave mount")?;
    if let Some(h) = &o.hostname {
        sethostname(h).context("setting the hostname")?;
    }
    if let Some(etc) = &o.etc {
        for f in ["resolv.conf", "hosts"] {
            let src = etc.join(f);
            if src.exists() {
                bind(&src, &PathBuf::from("/etc").join(f), true)?;
            }
        }
    }
    for (src, dst, ro) in &o.mounts {
        if !dst.exists() {
            std::fs::create_dir_all(dst)
                .with_context(|| format!("creating mount point {}", dst.display()))?;
        }
        bind(src, dst, *ro)?;
    }
    if o.read_only_root {
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .context("making the root filesystem read-only")?;
    }
    let groups: Vec<Gid> = o.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    setgroups(&groups).context("setgroups")?;
    if let Some(g) = o.gid {
        setgid(Gid::from_raw(g)).context("setgid")?;
    }
    if let Some(u) = o.uid {
        setuid(Uid::from_raw(u)).context("setuid")?;
    }
    if o.no_new_privs {
        prctl::set_no_new_privs().context("no_new_privs")?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let o = parse(std::env::args_os().skip(1).collect())?;
    let parent = getppid();
    if !o.exec_only {
        enter_pod(&o)?;
    }
    // After the credential change (which clears it): die with the kubelet.
    prctl::set_pdeathsig(Signal::SIGKILL).context("parent-death signal")?;
    if getppid() != parent {
        bail!("the parent exited before the container started");
    }
    if let Some(dir) = &o.workdir {
        std::env::set_current_dir(dir).with_context(|| format!("chdir {}", dir.display()))?;
    }
    let err = Command::new(&o.program[0]).args(&o.program[1..]).exec();
    bail!("exec {:?}: {err}", o.program[0])
}
