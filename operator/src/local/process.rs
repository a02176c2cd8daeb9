//! Real member processes: start `tandem-dataplane`, deliver signals, report exits, run
//! the readiness probes.
//!
//! Each child
//! - gets the runtime's PID in `TANDEM_PARENT_PID`: the dataplane then asks the kernel to
//!   SIGKILL it when the runtime dies (`dataplane/src/parent.rs`), so no member outlives
//!   the runtime, even a SIGKILLed one. The kernel ties that to the *thread* that started
//!   the child, so children are started from the runtime's main thread (the local runtime
//!   runs on a current-thread Tokio runtime);
//! - runs in its own process group, so a Ctrl-C on the terminal reaches only the runtime,
//!   which then stops the members in order;
//! - writes its stdout and stderr to its own log file (with `NO_COLOR=1`).
//!
//! A child is owned by one task that waits for it and sends it signals, so a signal never
//! reaches a PID that has already been reaped (and maybe reused).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use k8s_openapi::jiff::Timestamp;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::task::AbortHandle;

use super::executor::{Launch, Processes, ResetCall};
use super::input::Input;
use super::probe;

/// The variable `dataplane/src/parent.rs` reads.
pub const PARENT_PID_ENV: &str = "TANDEM_PARENT_PID";

struct Handle {
    signals: UnboundedSender<Signal>,
    probe: AbortHandle,
}

pub struct LocalProcesses {
    dataplane: PathBuf,
    events: UnboundedSender<Input>,
    children: HashMap<String, Handle>,
}

impl LocalProcesses {
    pub fn new(dataplane: PathBuf, events: UnboundedSender<Input>) -> Self {
        Self {
            dataplane,
            events,
            children: HashMap::new(),
        }
    }

    /// Stop probing a member whose process has exited.
    pub fn forget(&mut self, pod: &str) {
        if let Some(h) = self.children.remove(pod) {
            h.probe.abort();
        }
    }
}

impl Processes for LocalProcesses {
    fn free_ports(&mut self, n: usize) -> Result<Vec<u16>, String> {
        // Hold every listener until all are picked, so the ports are distinct.
        let listeners = (0..n)
            .map(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("finding a free loopback port: {e}"))?;
        listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("finding a free loopback port: {e}"))
    }

    fn spawn(&mut self, launch: &Launch) -> Result<u32, String> {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&launch.log)
            .map_err(|e| format!("opening {}: {e}", launch.log.display()))?;
        let _ = writeln!(
            log,
            "--- {} tandem-operator local: {} {}",
            Timestamp::now(),
            self.dataplane.display(),
            launch.args.join(" ")
        );
        let err_log = log
            .try_clone()
            .map_err(|e| format!("opening {}: {e}", launch.log.display()))?;
        let child = Command::new(&self.dataplane)
            .args(&launch.args)
            .envs(launch.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env(PARENT_PID_ENV, std::process::id().to_string())
            // Its output is a file: no terminal colours (honoured by tracing-subscriber).
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .process_group(0)
            .kill_on_drop(false)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.dataplane.display()))?;
        let pid = child.id().unwrap_or_default();
        let (signals, signal_rx) = mpsc::unbounded_channel();
        tokio::spawn(own_child(
            child,
            launch.pod.clone(),
            signal_rx,
            self.events.clone(),
        ));
        let probe = tokio::spawn(probe::run(
            launch.pod.clone(),
            launch.http,
            launch.probe_period,
            self.events.clone(),
        ))
        .abort_handle();
        self.children
            .insert(launch.pod.clone(), Handle { signals, probe });
        Ok(pid)
    }

    fn signal(&mut self, pod: &str, signal: Signal) {
        if let Some(h) = self.children.get(pod) {
            let _ = h.signals.send(signal);
        }
    }

    fn reset(&mut self, call: &ResetCall) {
        let call = call.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            let reply = crate::reset_call::call(
                call.http,
                call.role,
                call.to_incarnation,
                &call.key,
                call.timeout,
            )
            .await;
            let _ = events.send(Input::Reset {
                pod: call.pod,
                to_incarnation: call.to_incarnation,
                reply,
            });
        });
    }
}

/// Wait for the child and deliver signals to it until it exits.
async fn own_child(
    mut child: Child,
    pod: String,
    mut signals: UnboundedReceiver<Signal>,
    events: UnboundedSender<Input>,
) {
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            Some(sig) = signals.recv() => {
                // `id()` is None once the child has been reaped: no stray signal.
                if let Some(pid) = child.id()
                    && let Err(e) = kill(Pid::from_raw(pid as i32), sig)
                {
                    tracing::warn!(pod, pid, signal = %sig, "signal failed: {e}");
                }
            }
        }
    };
    let (how, success) = match status {
        Ok(s) => (describe(s), s.success()),
        Err(e) => (format!("lost track of the process: {e}"), false),
    };
    let _ = events.send(Input::Exited { pod, how, success });
}

/// `exit code 1`, `killed by signal 9 (SIGKILL)`.
pub fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit code {code}");
    }
    match status.signal() {
        Some(sig) => {
            let name = Signal::try_from(sig).map_or("?", |s| s.as_str());
            format!("killed by signal {sig} ({name})")
        }
        None => format!("{status}"),
    }
}

/// The last non-empty line of a log file (read from its last 4 KiB).
pub fn last_line(path: &Path) -> Option<String> {
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(4096))).ok()?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?;
    let line = line.trim();
    Some(if line.chars().count() > 300 {
        format!("{}…", line.chars().take(300).collect::<String>())
    } else {
        line.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_in_words() {
        assert_eq!(describe(ExitStatus::from_raw(1 << 8)), "exit code 1");
        assert_eq!(describe(ExitStatus::from_raw(0)), "exit code 0");
        assert_eq!(
            describe(ExitStatus::from_raw(9)),
            "killed by signal 9 (SIGKILL)"
        );
    }

    #[test]
    fn the_last_log_line_is_found() {
        let p = std::env::temp_dir().join(format!("tandem-last-line-{}", std::process::id()));
        std::fs::write(&p, "first\nError: loading model: no such file\n\n").unwrap();
        assert_eq!(
            last_line(&p).as_deref(),
            Some("Error: loading model: no such file")
        );
        std::fs::remove_file(&p).unwrap();
        assert_eq!(last_line(&p), None);
    }
}
