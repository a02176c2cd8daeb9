//! `e2e-exec`: what the end-to-end harness runs its children and its in-pod probes through.
//!
//! - `e2e-exec --init -- PROGRAM ARGS…`: PID 1 of the run's PID namespace
//!   (`tandem_e2e::sandbox`). Starts the program (the scenarios), reaps every process that
//!   ends up as its child (container shims double-fork and are reparented here), and exits
//!   with the program's status. When it exits the kernel kills whatever still runs in the
//!   namespace, so nothing of a run outlives it.
//! - `e2e-exec [--netns PATH] [--cgroup DIR]… -- PROGRAM ARGS…`: join a network namespace
//!   (a node's), join cgroups (write its PID into each `DIR/cgroup.procs`), ask to be
//!   killed when the parent (the harness) dies, then exec the program.
//! - `e2e-exec --netns PATH --connect IP:PORT --timeout-ms N`: one TCP connect from inside
//!   a pod's network namespace (a NetworkPolicy check): prints `connected`, `refused` or
//!   `timeout` and exits 0, 1 or 2.
//! - `e2e-exec --pod-root DIR --netns PATH --resolve NAME`: resolve a name as the pod
//!   does: its `/etc/resolv.conf` and `/etc/hosts` (read from the container's root, `DIR`)
//!   bind-mounted over ours in a private mount namespace, from inside its network
//!   namespace, through glibc's resolver. Prints one address per line.

use std::ffi::OsString;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::errno::Errno;
use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, setns, unshare};
use nix::sys::prctl;
use nix::sys::signal::Signal;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{Pid, getppid};

#[derive(Debug, Default)]
struct Opts {
    init: bool,
    netns: Option<PathBuf>,
    cgroups: Vec<PathBuf>,
    connect: Option<SocketAddr>,
    timeout_ms: u64,
    resolve: Option<String>,
    pod_root: Option<PathBuf>,
    program: Vec<OsString>,
}

fn parse(args: Vec<OsString>) -> Result<Opts> {
    let mut o = Opts {
        timeout_ms: 3000,
        ..Opts::default()
    };
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
            Some("--init") => o.init = true,
            Some("--netns") => o.netns = Some(value(&mut it, "--netns")?.into()),
            Some("--cgroup") => o.cgroups.push(value(&mut it, "--cgroup")?.into()),
            Some("--connect") => {
                let v = value(&mut it, "--connect")?;
                o.connect = Some(v.parse().with_context(|| format!("--connect {v:?}"))?);
            }
            Some("--timeout-ms") => o.timeout_ms = value(&mut it, "--timeout-ms")?.parse()?,
            Some("--resolve") => o.resolve = Some(value(&mut it, "--resolve")?),
            Some("--pod-root") => o.pod_root = Some(value(&mut it, "--pod-root")?.into()),
            _ => bail!("unknown argument {a:?}"),
        }
    }
    let probes = usize::from(o.connect.is_some()) + usize::from(o.resolve.is_some());
    if probes > 1 || (probes == 1 && (o.init || !o.program.is_empty())) {
        bail!("--connect and --resolve run alone (no --init, no program)");
    }
    if probes == 0 && o.program.is_empty() {
        bail!("no program after --");
    }
    if o.resolve.is_some() && o.pod_root.is_none() {
        bail!("--resolve needs --pod-root (where the pod's /etc/resolv.conf is)");
    }
    Ok(o)
}

fn join_netns(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    setns(f, CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("joining the network namespace {}", path.display()))
}

/// PID 1 of the run: start the program, reap everything, exit with the program's status.
fn init(program: &[OsString]) -> Result<ExitCode> {
    let child = Command::new(&program[0])
        .args(&program[1..])
        .spawn()
        .with_context(|| format!("starting {:?}", program[0]))?;
    let main = Pid::from_raw(child.id() as i32);
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == main => {
                return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
            }
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == main => {
                eprintln!("e2e-exec: the suite was killed by {sig}");
                let status = std::process::ExitStatus::from_raw(sig as i32);
                return Ok(ExitCode::from(
                    128u8.saturating_add(status.signal().unwrap_or(9) as u8),
                ));
            }
            Ok(_) => {}
            Err(Errno::EINTR) => {}
            Err(e) => bail!("waitpid: {e}"),
        }
    }
}

fn connect(addr: SocketAddr, timeout: Duration) -> ExitCode {
    match TcpStream::connect_timeout(&addr, timeout) {
        Ok(_) => {
            println!("connected");
            ExitCode::SUCCESS
        }
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            println!("refused");
            ExitCode::from(1)
        }
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            println!("timeout");
            ExitCode::from(2)
        }
        Err(e) => {
            println!("error: {e}");
            ExitCode::from(3)
        }
    }
}

fn bind_over(src: &Path, dst: &Path) -> Result<()> {
    mount(Some(src), dst, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .with_context(|| format!("bind-mounting {} on {}", src.display(), dst.display()))
}

fn resolve(name: &str, pod_root: &Path) -> Result<ExitCode> {
    // The pod's files, copied out first: a bind mount's source must be in our own mount
    // namespace, and the container's files are mounts in its.
    let dir = std::env::temp_dir().join(format!("e2e-resolve-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut copies = Vec::new();
    for f in ["resolv.conf", "hosts"] {
        let src = pod_root.join("etc").join(f);
        if let Ok(text) = std::fs::read(&src) {
            let copy = dir.join(f);
            std::fs::write(&copy, text)?;
            copies.push((copy, Path::new("/etc").join(f)));
        }
    }
    let result = (|| {
        unshare(CloneFlags::CLONE_NEWNS).context("a private mount namespace")?;
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_SLAVE,
            None::<&str>,
        )
        .context("making / a slave mount")?;
        for (copy, dst) in &copies {
            bind_over(copy, dst)?;
        }
        let addrs: Vec<SocketAddr> = (name, 0)
            .to_socket_addrs()
            .with_context(|| format!("resolving {name}"))?
            .collect();
        for a in &addrs {
            println!("{}", a.ip());
        }
        anyhow::Ok(if addrs.is_empty() {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        })
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn main() -> Result<ExitCode> {
    let o = parse(std::env::args_os().skip(1).collect())?;
    if o.init {
        if o.netns.is_some() || !o.cgroups.is_empty() {
            bail!("--init takes no --netns or --cgroup");
        }
        return init(&o.program);
    }
    let parent = getppid();
    if let Some(root) = &o.pod_root {
        // Read through the container's root before leaving our network namespace (the
        // path is the same from anywhere; the order only keeps errors readable).
        if !root.exists() {
            bail!("{} does not exist", root.display());
        }
    }
    if let Some(ns) = &o.netns {
        join_netns(ns)?;
    }
    if let Some(addr) = o.connect {
        return Ok(connect(addr, Duration::from_millis(o.timeout_ms)));
    }
    if let (Some(name), Some(root)) = (&o.resolve, &o.pod_root) {
        return resolve(name, root);
    }
    for dir in &o.cgroups {
        let procs = dir.join("cgroup.procs");
        std::fs::write(&procs, std::process::id().to_string())
            .with_context(|| format!("joining the cgroup {}", dir.display()))?;
    }
    prctl::set_pdeathsig(Signal::SIGKILL).context("parent-death signal")?;
    if getppid() != parent {
        bail!("the parent exited before the program started");
    }
    let err = Command::new(&o.program[0]).args(&o.program[1..]).exec();
    bail!("exec {:?}: {err}", o.program[0])
}
