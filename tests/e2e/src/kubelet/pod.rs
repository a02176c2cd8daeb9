//! One pod on one node: its sandbox (network namespace), its container process, its probes
//! and its status, from binding until the object is deleted.
//!
//! The worker follows the latest pod object (a `watch` channel; `None` once the object is
//! gone from the API). It starts the container once the configuration resolves, probes it
//! (startup first; then liveness and readiness), writes status by strategic merge patch of
//! `pods/status` (only the kubelet's own fields and conditions, so readiness-gate
//! conditions set by controllers survive), and on deletion sends SIGTERM, waits the
//! deletion grace period, sends SIGKILL, reports the container terminated, removes the
//! sandbox and deletes the object with grace 0 (the kubelet's final confirmation).
//!
//! While the node is down (heartbeats stopped) the worker does what a dead kubelet does:
//! nothing visible — no probes, no status, no reaction to deletion — while the process
//! keeps running; it catches up when the node comes back.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Api, ResourceExt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::NodeCtx;
use super::config::{self, NotStartable, Placement};
use super::probe::{self, ProbeSpec, Tracker};
use super::status::{
    self, CONTAINERS_READY, Conditions, ContainerView, INITIALIZED, READY, READY_TO_START, Runtime,
    Verdict,
};
use crate::net::{PodDns, PodSandbox};

/// What the node and the tests can see of a pod worker.
#[derive(Debug)]
pub struct PodShared {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// PID of the container process (0 when none runs).
    pub pid: AtomicI32,
    pub log: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Startup,
    Liveness,
    Readiness,
}

/// A finished probe: which one, and how it went.
type ProbeResult = (Kind, Result<(), String>);

struct ProbeState {
    spec: ProbeSpec,
    tracker: Tracker,
    next: Instant,
    in_flight: bool,
}

fn now() -> Timestamp {
    Timestamp::now()
}

fn signal_pid(pid: i32, sig: Signal) {
    if pid > 0 {
        let _ = kill(Pid::from_raw(pid), sig);
    }
}

/// Why a pod is admitted or refused by this kubelet.
fn admit(pod: &Pod) -> Result<&Container, String> {
    let spec = pod.spec.as_ref().ok_or("pod has no spec")?;
    if spec.restart_policy.as_deref() != Some("Never") {
        return Err(format!(
            "restartPolicy {:?}: this kubelet runs only restartPolicy Never",
            spec.restart_policy
        ));
    }
    if spec.init_containers.as_ref().is_some_and(|c| !c.is_empty()) {
        return Err("init containers are not supported".into());
    }
    match spec.containers.as_slice() {
        [c] => Ok(c),
        _ => Err("exactly one container per pod is supported".into()),
    }
}

pub struct Worker {
    ctx: Arc<NodeCtx>,
    shared: Arc<PodShared>,
    pod_rx: watch::Receiver<Option<Arc<Pod>>>,
    pod: Arc<Pod>,
    container: Container,
    view: ContainerView,
    conditions: Conditions,
    sandbox: Option<PodSandbox>,
    child: Option<Child>,
    start_time: Timestamp,
    started_at: Option<Instant>,
    probes: Vec<(Kind, ProbeState)>,
    results: (
        mpsc::UnboundedSender<ProbeResult>,
        mpsc::UnboundedReceiver<ProbeResult>,
    ),
    /// SIGKILL at this instant (set when termination begins).
    kill_at: Option<Instant>,
    last_written: Option<serde_json::Value>,
}

impl Worker {
    pub fn new(
        ctx: Arc<NodeCtx>,
        shared: Arc<PodShared>,
        pod_rx: watch::Receiver<Option<Arc<Pod>>>,
        pod: Arc<Pod>,
    ) -> Worker {
        let container = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first().cloned())
            .unwrap_or_default();
        let view = ContainerView {
            name: container.name.clone(),
            image: container.image.clone().unwrap_or_default(),
            container_id: None,
            runtime: Runtime::Waiting {
                reason: "ContainerCreating".into(),
                message: None,
            },
            started: false,
            ready: false,
        };
        let conditions = Conditions::from_pod(&pod);
        let start_time = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map(|t| t.0)
            .unwrap_or_else(now);
        Worker {
            ctx,
            shared,
            pod_rx,
            pod,
            container,
            view,
            conditions,
            sandbox: None,
            child: None,
            start_time,
            started_at: None,
            probes: Vec::new(),
            results: mpsc::unbounded_channel(),
            kill_at: None,
            last_written: None,
        }
    }

    fn alive(&self) -> bool {
        *self.ctx.alive.borrow()
    }

    fn deleting(&self) -> bool {
        self.pod.metadata.deletion_timestamp.is_some()
    }

    fn api(&self) -> Api<Pod> {
        Api::namespaced(
            self.ctx.client.clone(),
            &self.pod.namespace().unwrap_or_default(),
        )
    }

    fn grace(&self) -> Duration {
        let secs = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30);
        Duration::from_secs(secs.max(0) as u64)
    }

    /// Run until the pod object is gone. Never panics on API errors: they are logged and
    /// retried.
    pub async fn run(mut self) {
        if let Err(why) = admit(&self.pod) {
            self.reject(&why).await;
        } else {
            self.live().await;
        }
        self.shared.pid.store(0, Ordering::SeqCst);
        if let Some(sb) = self.sandbox.take()
            && let Err(e) = self.ctx.network.remove_pod(&sb).await
        {
            warn!(pod = %self.shared.name, "removing the sandbox: {e:#}");
        }
    }

    /// Refuse the pod (as kubelet admission does): phase Failed with the reason.
    async fn reject(&mut self, why: &str) {
        warn!(pod = %self.shared.name, "refusing pod: {why}");
        let patch =
            json!({"status": {"phase": "Failed", "reason": "UnsupportedPod", "message": why}});
        loop {
            if self.alive() {
                let _ = self
                    .api()
                    .patch_status(
                        &self.shared.name,
                        &PatchParams::default(),
                        &Patch::Strategic(&patch),
                    )
                    .await;
            }
            if self.deleting() && self.alive() {
                self.confirm_deletion().await;
                return;
            }
            if self.next_pod(Duration::from_secs(5)).await.is_none() {
                return;
            }
        }
    }

    /// Wait for the next pod object (or `within`); `None` when the object is gone.
    async fn next_pod(&mut self, within: Duration) -> Option<()> {
        let _ = tokio::time::timeout(within, self.pod_rx.changed()).await;
        let latest = self.pod_rx.borrow().clone();
        match latest {
            Some(p) => {
                self.pod = p;
                Some(())
            }
            None => None,
        }
    }

    async fn live(&mut self) {
        // Sandbox and configuration, retried until they work or the pod goes away.
        let mut attempt_at = Instant::now();
        loop {
            let gone = self.pod_rx.borrow().is_none();
            if gone {
                return;
            }
            if self.alive() && self.deleting() {
                self.finish().await;
                return;
            }
            if self.alive() && Instant::now() >= attempt_at {
                match self.try_start().await {
                    Ok(()) => break,
                    Err(ns) => {
                        debug!(pod = %self.shared.name, reason = ns.reason, "not started: {}", ns.message);
                        self.view.runtime = Runtime::Waiting {
                            reason: ns.reason.into(),
                            message: Some(ns.message),
                        };
                        attempt_at = Instant::now() + Duration::from_secs(1);
                    }
                }
            }
            self.write_status().await;
            if self.next_pod(Duration::from_millis(500)).await.is_none() {
                return;
            }
        }
        self.supervise().await;
    }

    /// Create the sandbox (once), resolve the configuration and start the process.
    async fn try_start(&mut self) -> Result<(), NotStartable> {
        let spec = self.pod.spec.clone().unwrap_or_default();
        let ns = self.pod.namespace().unwrap_or_default();
        if self.sandbox.is_none() {
            let hostname = spec
                .hostname
                .clone()
                .unwrap_or_else(|| self.shared.name.clone());
            let dns = PodDns {
                namespace: &ns,
                hostname: &hostname,
                subdomain: spec.subdomain.as_deref(),
            };
            let key = self.shared.uid.replace('-', "");
            let key = &key[..key.len().min(8)];
            let sb = self
                .ctx
                .network
                .add_pod(key, &dns)
                .await
                .map_err(|e| NotStartable {
                    reason: "ContainerCreating",
                    message: format!("FailedCreatePodSandBox: {e:#}"),
                })?;
            self.sandbox = Some(sb);
        }
        let sb = self.sandbox.clone().expect("sandbox just made");
        let place = Placement {
            node_name: &self.ctx.node_name,
            pod_ip: sb.addr,
            host_ip: &self.ctx.host_ip,
        };
        let scratch = self.ctx.pod_dir(&self.shared.uid);
        let cfg = config::resolve(
            &self.ctx.client,
            &self.pod,
            &self.container,
            &place,
            &self.ctx.entrypoint,
            &scratch,
        )
        .await?;

        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.shared.log)
            .map_err(|e| NotStartable {
                reason: "RunContainerError",
                message: format!("opening the log: {e}"),
            })?;
        let log2 = log.try_clone().map_err(|e| NotStartable {
            reason: "RunContainerError",
            message: e.to_string(),
        })?;
        let mut cmd = Command::new(&self.ctx.pod_exec);
        cmd.arg("--netns")
            .arg(sb.netns_path())
            .arg("--etc")
            .arg(sb.etc_dir())
            .arg("--hostname")
            .arg(
                spec.hostname
                    .clone()
                    .unwrap_or_else(|| self.shared.name.clone()),
            )
            .arg("--uid")
            .arg(cfg.uid.to_string())
            .arg("--gid")
            .arg(cfg.gid.to_string());
        if !cfg.groups.is_empty() {
            let g: Vec<String> = cfg.groups.iter().map(u32::to_string).collect();
            cmd.arg("--groups").arg(g.join(","));
        }
        for m in &cfg.mounts {
            cmd.arg("--mount").arg(format!(
                "{}:{}:{}",
                m.source.display(),
                m.target,
                if m.read_only { "ro" } else { "rw" }
            ));
        }
        if cfg.read_only_root {
            cmd.arg("--read-only-root");
        }
        if cfg.no_new_privs {
            cmd.arg("--no-new-privs");
        }
        if let Some(w) = &cfg.workdir {
            cmd.arg("--workdir").arg(w);
        }
        cmd.arg("--")
            .arg(&cfg.program)
            .args(&cfg.args)
            .env_clear()
            .envs(cfg.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(|e| NotStartable {
            reason: "RunContainerError",
            message: format!("starting {}: {e}", cfg.program.display()),
        })?;
        let pid = child.id().map(|p| p as i32).unwrap_or(0);
        info!(pod = %self.shared.name, namespace = %ns, pid, ip = %sb.addr, node = %self.ctx.node_name, "container started");
        self.shared.pid.store(pid, Ordering::SeqCst);
        self.child = Some(child);
        self.started_at = Some(Instant::now());
        self.view.container_id = Some(format!("e2e://{}/{pid}", self.ctx.node_name));
        self.view.runtime = Runtime::Running { started_at: now() };
        self.setup_probes();
        Ok(())
    }

    fn setup_probes(&mut self) {
        let start = Instant::now();
        let c = &self.container;
        let mut probes = Vec::new();
        for (kind, p) in [
            (Kind::Startup, &c.startup_probe),
            (Kind::Liveness, &c.liveness_probe),
            (Kind::Readiness, &c.readiness_probe),
        ] {
            if let Some(p) = p {
                let spec = ProbeSpec::from_api(p, c);
                let next = start + spec.initial_delay;
                probes.push((
                    kind,
                    ProbeState {
                        spec,
                        tracker: Tracker::default(),
                        next,
                        in_flight: false,
                    },
                ));
            }
        }
        self.view.started = !probes.iter().any(|(k, _)| *k == Kind::Startup);
        self.view.ready = self.view.started && !probes.iter().any(|(k, _)| *k == Kind::Readiness);
        self.probes = probes;
    }

    fn pod_ip(&self) -> Option<Ipv4Addr> {
        self.sandbox.as_ref().map(|s| s.addr)
    }

    /// Launch every probe that is due.
    fn launch_probes(&mut self) {
        let Some(ip) = self.pod_ip() else { return };
        let started = self.view.started;
        let now = Instant::now();
        for (kind, st) in &mut self.probes {
            let runs = match kind {
                Kind::Startup => !started,
                Kind::Liveness | Kind::Readiness => started,
            };
            if !runs || st.in_flight || now < st.next {
                continue;
            }
            st.in_flight = true;
            st.next = now + st.spec.period;
            let spec = st.spec.clone();
            let tx = self.results.0.clone();
            let kind = *kind;
            tokio::spawn(async move {
                let r = probe::run(&spec, ip).await;
                let _ = tx.send((kind, r));
            });
        }
    }

    /// Take a probe result; returns a kill reason when liveness or startup gave up.
    fn on_probe(&mut self, kind: Kind, result: Result<(), String>) -> Option<String> {
        let name = self.shared.name.clone();
        let (_, st) = self.probes.iter_mut().find(|(k, _)| *k == kind)?;
        st.in_flight = false;
        if let Err(e) = &result {
            debug!(pod = %name, ?kind, "probe failed: {e}");
        }
        let changed = st.tracker.record(&st.spec, &result);
        match kind {
            Kind::Startup => {
                if st.tracker.passing {
                    self.view.started = true;
                    let now = Instant::now();
                    // Liveness and readiness start counting now.
                    for (k, s) in &mut self.probes {
                        if *k != Kind::Startup {
                            s.next = now + s.spec.initial_delay;
                        }
                    }
                    if !self.probes.iter().any(|(k, _)| *k == Kind::Readiness) {
                        self.view.ready = true;
                    }
                } else if st.tracker.exhausted(&st.spec) {
                    return Some(format!(
                        "Startup probe failed: {}",
                        st.tracker.last_error.clone().unwrap_or_default()
                    ));
                }
            }
            Kind::Liveness => {
                if !st.tracker.passing && st.tracker.exhausted(&st.spec) && st.tracker.failures > 0
                {
                    return Some(format!(
                        "Liveness probe failed: {}",
                        st.tracker.last_error.clone().unwrap_or_default()
                    ));
                }
            }
            Kind::Readiness => {
                if changed {
                    info!(pod = %name, ready = st.tracker.passing, "readiness changed");
                }
                self.view.ready = st.tracker.passing;
            }
        }
        None
    }

    /// The running phase: probes, pod updates, process exit, termination.
    async fn supervise(&mut self) {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut alive_rx = self.ctx.alive.clone();
        loop {
            let alive = self.alive();
            if alive && self.deleting() && self.kill_at.is_none() && self.child.is_some() {
                self.begin_termination("deleted", self.grace());
            }
            if alive && self.child.is_some() && self.kill_at.is_none() {
                self.launch_probes();
            }
            if let Some(at) = self.kill_at
                && Instant::now() >= at
                && alive
            {
                signal_pid(self.shared.pid.load(Ordering::SeqCst), Signal::SIGKILL);
            }
            if self.child.is_none() {
                // Terminated: report, tear the sandbox down, wait for the deletion.
                if alive {
                    self.write_status().await;
                    if let Some(sb) = self.sandbox.take() {
                        let _ = self.ctx.network.remove_pod(&sb).await;
                    }
                    if self.deleting() {
                        self.confirm_deletion().await;
                        return;
                    }
                }
                if self.next_pod(Duration::from_secs(1)).await.is_none() {
                    return;
                }
                continue;
            }
            if alive {
                self.write_status().await;
            }
            let child = self.child.as_mut().expect("checked above");
            tokio::select! {
                exit = child.wait() => {
                    let finished_at = now();
                    let started = match &self.view.runtime {
                        Runtime::Running { started_at } => Some(*started_at),
                        _ => None,
                    };
                    let (exit_code, sig) = match exit {
                        Ok(s) => {
                            use std::os::unix::process::ExitStatusExt;
                            match (s.code(), s.signal()) {
                                (Some(c), _) => (c, None),
                                (None, Some(sig)) => (128 + sig, Some(sig)),
                                _ => (-1, None),
                            }
                        }
                        Err(e) => {
                            warn!(pod = %self.shared.name, "waiting for the container: {e}");
                            (-1, None)
                        }
                    };
                    info!(pod = %self.shared.name, exit_code, signal = ?sig, "container exited");
                    self.child = None;
                    self.shared.pid.store(0, Ordering::SeqCst);
                    self.view.ready = false;
                    let reason = if exit_code == 0 { "Completed" } else { "Error" };
                    self.view.runtime = Runtime::Terminated {
                        exit_code,
                        signal: sig,
                        reason: reason.into(),
                        message: None,
                        started_at: started,
                        finished_at,
                    };
                }
                changed = self.pod_rx.changed() => {
                    if changed.is_err() || self.pod_rx.borrow().is_none() {
                        // The object is gone (force-deleted): stop the process as the
                        // kubelet does for a pod it no longer knows.
                        self.orphaned().await;
                        return;
                    }
                    let latest = self.pod_rx.borrow().clone();
                    if let Some(p) = latest {
                        self.pod = p;
                    }
                }
                Some((kind, r)) = self.results.1.recv() => {
                    if !self.alive() {
                        continue;
                    }
                    if let Some(why) = self.on_probe(kind, r) {
                        warn!(pod = %self.shared.name, "{why}: killing the container");
                        let grace = self
                            .pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.termination_grace_period_seconds)
                            .unwrap_or(30);
                        self.begin_termination(&why, Duration::from_secs(grace.max(0) as u64));
                    }
                }
                _ = alive_rx.changed() => {}
                _ = tick.tick() => {}
            }
        }
    }

    fn begin_termination(&mut self, why: &str, grace: Duration) {
        info!(pod = %self.shared.name, grace_s = grace.as_secs(), "stopping the container: {why}");
        signal_pid(self.shared.pid.load(Ordering::SeqCst), Signal::SIGTERM);
        self.kill_at = Some(Instant::now() + grace);
    }

    /// The object vanished while the process runs: SIGTERM, grace, SIGKILL, clean up.
    async fn orphaned(&mut self) {
        info!(pod = %self.shared.name, "pod removed from the API: stopping its container");
        let pid = self.shared.pid.load(Ordering::SeqCst);
        signal_pid(pid, Signal::SIGTERM);
        let grace = self.grace();
        if let Some(child) = self.child.as_mut()
            && tokio::time::timeout(grace, child.wait()).await.is_err()
        {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        self.child = None;
    }

    /// A pod deleted before its container ran: nothing to stop.
    async fn finish(&mut self) {
        self.view.runtime = Runtime::Terminated {
            exit_code: 0,
            signal: None,
            reason: "ContainerStatusUnknown".into(),
            message: Some("the container was never started".into()),
            started_at: None,
            finished_at: now(),
        };
        self.write_status().await;
        self.confirm_deletion().await;
    }

    /// Delete the object with grace 0, for this UID only (the kubelet's last word).
    async fn confirm_deletion(&mut self) {
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.shared.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        for _ in 0..20 {
            match self.api().delete(&self.shared.name, &dp).await {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return,
                Err(e) => {
                    warn!(pod = %self.shared.name, "final delete failed: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Write the status if it changed since the last successful write.
    async fn write_status(&mut self) {
        let phase = status::phase(std::slice::from_ref(&self.view));
        let t = now();
        let verdict = |ok| Verdict {
            ok,
            reason: None,
            message: None,
        };
        // The sandbox exists from its creation until the container has terminated.
        let terminated = matches!(self.view.runtime, Runtime::Terminated { .. });
        self.conditions.set(
            READY_TO_START,
            verdict(self.sandbox.is_some() && !terminated),
            t,
        );
        self.conditions.set(INITIALIZED, verdict(true), t);
        let cr = status::containers_ready(std::slice::from_ref(&self.view), phase);
        let ready = status::pod_ready(&self.pod, &cr);
        self.conditions.set(CONTAINERS_READY, cr, t);
        self.conditions.set(READY, ready, t);
        let mut st = json!({
            "phase": phase,
            "conditions": self.conditions.to_conditions(),
            "hostIP": self.ctx.host_ip,
            "hostIPs": [{"ip": self.ctx.host_ip}],
            "startTime": Time(self.start_time),
            "containerStatuses": [self.view.to_status()],
        });
        if let Some(ip) = self.pod_ip().or_else(|| self.reported_ip()) {
            st["podIP"] = json!(ip.to_string());
            st["podIPs"] = json!([{"ip": ip.to_string()}]);
        }
        let patch = json!({ "status": st });
        if self.last_written.as_ref() == Some(&patch) {
            return;
        }
        match self
            .api()
            .patch_status(
                &self.shared.name,
                &PatchParams::default(),
                &Patch::Strategic(&patch),
            )
            .await
        {
            Ok(_) => self.last_written = Some(patch),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => warn!(pod = %self.shared.name, "status update failed: {e}"),
        }
    }

    fn reported_ip(&self) -> Option<Ipv4Addr> {
        self.pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok())
    }
}
