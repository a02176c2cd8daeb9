//! The local executor: carries out the planner's actions with processes instead of pods,
//! and keeps the bookkeeping the planner observes on the next reconcile.
//!
//! | planner action | on Kubernetes (controller) | here |
//! | --- | --- | --- |
//! | `CreatePod` | server-side apply of the pod | start a `tandem-dataplane` process with the same args and env ([`crate::resources::dataplane_invocation`]), on free loopback ports |
//! | `DeletePod` | delete (kubelet: SIGTERM, SIGKILL after the grace period; the short grace as `gracePeriodSeconds`) | SIGTERM, SIGKILL after the grace period (`--grace-period-seconds`, or the planner's short grace for a hung member, never longer); an exited process is removed at once |
//! | `SetGroupReadyGate` | patch the pod's `tandem.dev/group-ready` condition | add to / remove from the local router |
//! | `ResetMember` | `POST /admin/reset` to the pod, then its incarnation label moved on | the same call, in the background ([`Processes::reset`]); its answer ([`LocalExecutor::on_reset`]) moves the member's incarnation on |
//! | `CreateGroupSecret` | create the Secret with a random key | keep a random key in memory, given to the group's members |
//! | `ApplyClientService` | apply the client Service | the router is already listening: recorded |
//! | `ApplyRouter`, `DeleteRouter` | apply / delete the router's Deployment, Service and RBAC | the endpoint already is the router: recorded |
//! | `ApplyGroupService`, `ApplyNetworkPolicy` | apply | nothing to do on loopback: recorded |
//! | `DeleteGroupResources` | delete the three objects | forget the key and the records |
//! | `Event` | publish a Kubernetes Event | a line in the record and the log |
//!
//! No decision is made here: the order of deletes and creates is the planner's.
//! Processes are started and signalled through [`Processes`], so the bookkeeping is tested
//! without real processes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use nix::sys::signal::Signal;
use serde::Serialize;

use super::env::{self, PodFacts};
use super::member::{Exit, Member, ProbeOutcome, Readiness, Termination};
pub use super::record::{Entry, EntryKind, Record};
use crate::names;
use futures::FutureExt;

use crate::executor::{self, Executor, MemberDelete, MemberReset};
use crate::planner::{
    DeleteReason, EventKind, Grace, Observed, PlannedAction, PlannedEvent, PodIntent, Role,
};
use crate::resources::{self, DataplaneNetwork};

/// Starting and signalling processes (real ones in [`super::process`]).
pub trait Processes {
    /// `n` distinct free TCP ports on the loopback interface.
    fn free_ports(&mut self, n: usize) -> Result<Vec<u16>, String>;
    /// Start a member; its exit and probe results come back to the runtime as messages.
    fn spawn(&mut self, launch: &Launch) -> Result<u32, String>;
    /// Send `signal` to the member's process, unless it has exited.
    fn signal(&mut self, pod: &str, signal: Signal);
    /// Start an in-place reset call (`crate::reset_call`); its answer comes back to the
    /// runtime as a message, never waited for here.
    fn reset(&mut self, call: &ResetCall);
}

/// One in-place reset call to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetCall {
    pub pod: String,
    pub http: SocketAddr,
    pub role: Role,
    pub to_incarnation: i64,
    /// The group key (the proof's key; never sent).
    pub key: String,
    pub timeout: Duration,
}

/// Everything needed to start one member process.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub pod: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub log: PathBuf,
    /// Where its `/ready` is probed, and how often once it has been ready.
    pub http: SocketAddr,
    pub probe_period: Duration,
}

/// A decode the router may send traffic to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    pub pod: String,
    pub group: i32,
    pub incarnation: i64,
    pub addr: SocketAddr,
}

/// The objects that stand in for a group's Service, NetworkPolicy and Secret.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LocalObjects {
    pub client_service: bool,
    pub router: bool,
    pub group_services: BTreeSet<i32>,
    pub network_policies: BTreeSet<i32>,
    /// Group → key.
    pub keys: BTreeMap<i32, String>,
}

/// How the executor runs members.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    pub deployment: String,
    pub namespace: String,
    /// Loopback address the members bind to.
    pub host: IpAddr,
    /// SIGTERM → SIGKILL delay of a planned delete.
    pub grace: Duration,
    pub log_dir: PathBuf,
}

pub struct LocalExecutor<P> {
    pub config: ExecutorConfig,
    pub members: BTreeMap<String, Member>,
    pub objects: LocalObjects,
    pub record: Record,
    pub processes: P,
}

fn after(t: Timestamp, d: Duration) -> Timestamp {
    t.checked_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX))
        .unwrap_or(Timestamp::MAX)
}

/// How long a member may take before its HTTP server answers.
fn startup_allowance(m: &Member) -> Duration {
    Duration::from_secs(m.health.startup_timeout_seconds.max(1) as u64)
}

fn delete_reason(r: DeleteReason) -> String {
    match r {
        DeleteReason::CoRestart(reason) => format!("co-restart ({reason})"),
        DeleteReason::ScaleDown => "scale-down".into(),
    }
}

impl<P: Processes> LocalExecutor<P> {
    pub fn new(config: ExecutorConfig, processes: P) -> Self {
        Self {
            config,
            members: BTreeMap::new(),
            objects: LocalObjects::default(),
            record: Record::default(),
            processes,
        }
    }

    /// The cluster as the planner sees it.
    pub fn observed(&self) -> Observed {
        Observed {
            pods: self.members.values().map(Member::observe).collect(),
            client_service: self.objects.client_service,
            router: self.objects.router,
            group_services: self.objects.group_services.clone(),
            network_policies: self.objects.network_policies.clone(),
            group_secrets: self.objects.keys.keys().copied().collect(),
        }
    }

    /// Decodes the router may use.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        self.members
            .values()
            .filter(|m| m.serving())
            .map(|m| Endpoint {
                pod: m.name.clone(),
                group: m.group,
                incarnation: m.incarnation,
                addr: m.http,
            })
            .collect()
    }

    /// Carry out one action (through [`crate::executor::execute`], the dispatch the
    /// controller uses too). An error leaves the state as it was (the next reconcile plans
    /// the action again).
    pub fn execute(&mut self, action: &PlannedAction, now: Timestamp) -> Result<(), String> {
        executor::execute(self, action, now)
            .now_or_never()
            .expect("the local executor never waits")
    }

    /// Carry out a plan's actions in order, stopping at the first failure
    /// ([`crate::executor::execute_all`]).
    pub fn execute_all<'a>(
        &mut self,
        actions: &'a [PlannedAction],
        now: Timestamp,
    ) -> Result<(), executor::Failed<'a, String>> {
        executor::execute_all(self, actions, now)
            .now_or_never()
            .expect("the local executor never waits")
    }

    fn create(&mut self, intent: &PodIntent, now: Timestamp) -> Result<(), String> {
        if self.members.contains_key(&intent.name) {
            return Ok(());
        }
        let cfg = &self.config;
        let host = cfg.host;
        let peers = match intent.role {
            Role::Prefill => Vec::new(),
            Role::Decode => (0..intent.template.prefill.replicas.max(1))
                .map(|k| {
                    let p = names::pod_name(
                        &cfg.deployment,
                        intent.group,
                        intent.incarnation,
                        Role::Prefill,
                        k,
                    );
                    self.members
                        .get(&p)
                        .filter(|m| m.alive())
                        .map(|m| SocketAddr::new(host, m.kv_port).to_string())
                        .ok_or_else(|| format!("{}: its prefill {p} is not running", intent.name))
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let ports = self.processes.free_ports(2)?;
        let (http_port, kv_port) = (ports[0], ports[1]);
        let net = DataplaneNetwork {
            host: Some(host.to_string()),
            http_port,
            kv_port,
            prefill_peers: peers,
        };
        let inv = resources::dataplane_invocation(&cfg.deployment, intent, &net);
        let secrets: BTreeMap<String, String> = self
            .objects
            .keys
            .iter()
            .map(|(g, k)| (names::group_secret_name(&cfg.deployment, *g), k.clone()))
            .collect();
        let env = env::resolve(
            &inv.env,
            PodFacts {
                name: &intent.name,
                namespace: &cfg.namespace,
            },
            &secrets,
        )?;
        let health = intent.template.health.clone();
        let launch = Launch {
            pod: intent.name.clone(),
            args: inv.args,
            env,
            log: cfg.log_dir.join(format!("{}.log", intent.name)),
            http: SocketAddr::new(host, http_port),
            probe_period: Duration::from_secs(health.probe_period_seconds.max(1) as u64),
        };
        let pid = self.processes.spawn(&launch)?;
        let member = Member {
            name: intent.name.clone(),
            group: intent.group,
            role: intent.role,
            index: intent.index,
            incarnation: intent.incarnation,
            revision: intent.revision.clone(),
            pid,
            http: launch.http,
            kv_port,
            started: now,
            health,
            readiness: Readiness::new(now),
            exit: None,
            terminating: None,
            startup_failure: None,
            gate: false,
            log: launch.log.clone(),
            resetting: None,
            resets: 0,
        };
        self.record.push(
            now,
            EntryKind::Started,
            false,
            intent.group,
            Some(&intent.name),
            None,
            format!(
                "started {} {} (pid {pid}, incarnation {}, http {}, kv port {kv_port}); log {}",
                intent.role.as_str(),
                intent.name,
                intent.incarnation,
                launch.http,
                launch.log.display()
            ),
        );
        self.members.insert(intent.name.clone(), member);
        Ok(())
    }

    /// SIGKILL now (the planner never asks this of a local member, whose deletion has no
    /// deadline it could miss; carried out for completeness of the executor).
    fn force_delete(&mut self, pod: &str, now: Timestamp) {
        let Some(m) = self.members.get_mut(pod) else {
            return;
        };
        if m.exit.is_some() {
            return;
        }
        self.processes.signal(pod, Signal::SIGKILL);
        if let Some(t) = &mut m.terminating {
            t.killed = true;
        }
        let (group, msg) = (
            m.group,
            format!("SIGKILL to {pod} (pid {}): force delete", m.pid),
        );
        self.record.push(
            now,
            EntryKind::Terminating,
            true,
            group,
            Some(pod),
            None,
            msg,
        );
    }

    fn delete(&mut self, pod: &str, role: Role, why: &str, grace: Grace, now: Timestamp) {
        let Some(m) = self.members.get_mut(pod) else {
            return;
        };
        let group = m.group;
        if let Some(e) = &m.exit {
            let msg = format!(
                "removed {} {pod} ({why}); it had exited: {}",
                role.as_str(),
                e.how
            );
            self.members.remove(pod);
            self.record
                .push(now, EntryKind::Removed, false, group, Some(pod), None, msg);
            return;
        }
        if m.terminating.is_some() {
            return;
        }
        self.processes.signal(pod, Signal::SIGTERM);
        // The short grace never lengthens the runtime's own.
        let (wait, unresponsive) = match grace {
            Grace::Full => (self.config.grace, None),
            Grace::Unresponsive { seconds, cause } => (
                Duration::from_secs(seconds.max(1) as u64).min(self.config.grace),
                Some(cause),
            ),
        };
        m.terminating = Some(Termination {
            since: now,
            kill_at: after(now, wait),
            killed: false,
            reason: why.to_string(),
        });
        let mut msg = format!(
            "SIGTERM to {} {pod} (pid {}, incarnation {}) for {why}; SIGKILL after {}s if still running",
            role.as_str(),
            m.pid,
            m.incarnation,
            wait.as_secs()
        );
        if let Some(c) = unresponsive {
            msg.push_str(&format!(
                " (the short grace of an unresponsive member: {})",
                c.describe()
            ));
        }
        self.record.push(
            now,
            EntryKind::Terminating,
            unresponsive.is_some(),
            group,
            Some(pod),
            None,
            msg,
        );
    }

    /// Stop every running member of `role` as a planned delete would (shutdown).
    pub fn terminate_role(&mut self, role: Role, why: &str, now: Timestamp) {
        let pods: Vec<String> = self
            .members
            .values()
            .filter(|m| m.role == role && m.alive())
            .map(|m| m.name.clone())
            .collect();
        for p in pods {
            self.delete(&p, role, why, Grace::Full, now);
        }
    }

    /// SIGKILL every process still running (a second Ctrl-C, or the end of shutdown).
    pub fn kill_all(&mut self, why: &str, now: Timestamp) {
        for m in self.members.values_mut().filter(|m| m.alive()) {
            self.processes.signal(&m.name, Signal::SIGKILL);
            if let Some(t) = &mut m.terminating {
                t.killed = true;
            }
            self.record.push(
                now,
                EntryKind::Killed,
                true,
                m.group,
                Some(&m.name),
                None,
                format!("SIGKILL to {} (pid {}): {why}", m.name, m.pid),
            );
        }
    }

    pub fn running(&self) -> usize {
        self.members.values().filter(|m| m.alive()).count()
    }

    pub fn running_of(&self, role: Role) -> usize {
        self.members
            .values()
            .filter(|m| m.alive() && m.role == role)
            .count()
    }

    /// A member's process ended. `last_log` is the last line it wrote, for the record.
    pub fn on_exit(
        &mut self,
        pod: &str,
        how: String,
        success: bool,
        last_log: Option<String>,
        now: Timestamp,
    ) {
        let Some(m) = self.members.get_mut(pod) else {
            return;
        };
        let group = m.group;
        let tail = last_log
            .filter(|l| !l.is_empty())
            .map(|l| format!("; last log line: {l}"))
            .unwrap_or_default();
        if let Some(t) = &m.terminating {
            let took = now.duration_since(t.since).as_secs_f64();
            let msg = format!(
                "{} {pod} (pid {}) exited {took:.1}s after SIGTERM ({}): {how}",
                m.role.as_str(),
                m.pid,
                t.reason
            );
            self.members.remove(pod);
            self.record
                .push(now, EntryKind::Exited, false, group, Some(pod), None, msg);
            return;
        }
        let how = match &m.startup_failure {
            Some(f) => format!("{how}: {f}"),
            None => how,
        };
        let msg = format!(
            "{} {pod} (pid {}) exited on its own: {how}; log {}{tail}",
            m.role.as_str(),
            m.pid,
            m.log.display()
        );
        m.exit = Some(Exit {
            at: now,
            how,
            success,
        });
        self.record
            .push(now, EntryKind::Exited, true, group, Some(pod), None, msg);
    }

    /// A probe result; returns true when the member's readiness changed, or the reason a
    /// not-ready decode gives.
    pub fn on_probe(&mut self, pod: &str, outcome: ProbeOutcome, now: Timestamp) -> bool {
        let Some(m) = self.members.get_mut(pod) else {
            return false;
        };
        if !m.alive() || m.terminating.is_some() {
            return false;
        }
        let threshold = m.health.failure_threshold;
        let before = m.observe().ready_detail.map(|d| d.reason);
        if !m.readiness.record(outcome, threshold, now) {
            // Readiness unchanged; a new reason of a not-ready decode is news for the
            // status (`handshaking` → `auth_failed`), so the planner runs again.
            let Some(now_says) = m.observe().ready_detail else {
                return false;
            };
            if before.as_ref() == Some(&now_says.reason) {
                return false;
            }
            let msg = format!(
                "{} {pod} is not ready: {}: {}",
                m.role.as_str(),
                now_says.reason,
                now_says.message
            );
            let g = m.group;
            self.record
                .push(now, EntryKind::NotReady, true, g, Some(pod), None, msg);
            return true;
        }
        let (kind, msg) = if m.readiness.ready {
            (
                EntryKind::Ready,
                format!(
                    "{} {pod} is ready ({:.1}s after start)",
                    m.role.as_str(),
                    now.duration_since(m.started).as_secs_f64()
                ),
            )
        } else {
            (
                EntryKind::NotReady,
                format!(
                    "{} {pod} is not ready after {threshold} failed probe(s): {}",
                    m.role.as_str(),
                    m.readiness.detail
                ),
            )
        };
        let (g, warning) = (m.group, !m.readiness.ready);
        self.record
            .push(now, kind, warning, g, Some(pod), None, msg);
        true
    }

    /// Send the SIGKILLs that are due: a planned delete past its grace period, and a
    /// process whose HTTP server has not answered within its `health.startupTimeoutSeconds`
    /// (the startup probe's limit on a cluster; it then reads as Failed). Loading the
    /// model within that time is never taken for a failure.
    pub fn enforce_deadlines(&mut self, now: Timestamp) {
        for m in self.members.values_mut().filter(|m| m.alive()) {
            let allowance = startup_allowance(m);
            let mut kill = None;
            if let Some(t) = &mut m.terminating {
                if !t.killed && t.kill_at <= now {
                    t.killed = true;
                    kill = Some(format!(
                        "grace period over: SIGKILL to {} (pid {}), still running {:.0}s after SIGTERM",
                        m.name,
                        m.pid,
                        now.duration_since(t.since).as_secs_f64()
                    ));
                }
            } else if !m.readiness.answered
                && m.startup_failure.is_none()
                && after(m.started, allowance) <= now
            {
                let why = format!(
                    "its HTTP server did not answer within health.startupTimeoutSeconds ({}s)",
                    allowance.as_secs()
                );
                kill = Some(format!("SIGKILL to {} (pid {}): {why}", m.name, m.pid));
                m.startup_failure = Some(why);
            }
            if let Some(msg) = kill {
                self.processes.signal(&m.name, Signal::SIGKILL);
                self.record.push(
                    now,
                    EntryKind::Killed,
                    true,
                    m.group,
                    Some(&m.name),
                    None,
                    msg,
                );
            }
        }
    }

    /// The next time [`Self::enforce_deadlines`] has something to do.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.members
            .values()
            .filter(|m| m.alive())
            .filter_map(|m| match &m.terminating {
                Some(t) if !t.killed => Some(t.kill_at),
                Some(_) => None,
                None if !m.readiness.answered && m.startup_failure.is_none() => {
                    Some(after(m.started, startup_allowance(m)))
                }
                None => None,
            })
            .min()
    }
}

impl<P: Processes> Executor for LocalExecutor<P> {
    type Error = String;

    /// The router is already listening: recorded.
    async fn apply_client_service(&mut self, _now: Timestamp) -> Result<(), String> {
        self.objects.client_service = true;
        Ok(())
    }

    /// The endpoint already is the router (`spec.router` asks for one on a cluster):
    /// recorded.
    async fn apply_router(&mut self, _now: Timestamp) -> Result<(), String> {
        self.objects.router = true;
        Ok(())
    }

    async fn delete_router(&mut self, _now: Timestamp) -> Result<(), String> {
        self.objects.router = false;
        Ok(())
    }

    /// Nothing to do on loopback: recorded.
    async fn apply_group_service(&mut self, group: i32, _now: Timestamp) -> Result<(), String> {
        self.objects.group_services.insert(group);
        Ok(())
    }

    /// Nothing to do on loopback: recorded.
    async fn apply_network_policy(&mut self, group: i32, _now: Timestamp) -> Result<(), String> {
        self.objects.network_policies.insert(group);
        Ok(())
    }

    async fn create_group_secret(&mut self, group: i32, now: Timestamp) -> Result<(), String> {
        // Never overwrite a key: members may be using it.
        if let std::collections::btree_map::Entry::Vacant(slot) = self.objects.keys.entry(group) {
            slot.insert(resources::random_group_key());
            self.record.push(
                now,
                EntryKind::Object,
                false,
                group,
                None,
                None,
                format!("group {group}: generated its group key"),
            );
        }
        Ok(())
    }

    async fn delete_group_resources(&mut self, group: i32, now: Timestamp) -> Result<(), String> {
        let o = &mut self.objects;
        o.group_services.remove(&group);
        o.network_policies.remove(&group);
        if o.keys.remove(&group).is_some() {
            self.record.push(
                now,
                EntryKind::Object,
                false,
                group,
                None,
                None,
                format!("group {group}: removed its group key"),
            );
        }
        Ok(())
    }

    async fn create_member(&mut self, intent: &PodIntent, now: Timestamp) -> Result<(), String> {
        self.create(intent, now)
    }

    async fn delete_member(&mut self, d: &MemberDelete<'_>, now: Timestamp) -> Result<(), String> {
        self.delete(d.pod, d.role, &delete_reason(d.reason), d.grace, now);
        Ok(())
    }

    async fn force_delete_member(
        &mut self,
        pod: &str,
        _group: i32,
        _role: Role,
        now: Timestamp,
    ) -> Result<(), String> {
        self.force_delete(pod, now);
        Ok(())
    }

    async fn reset_member(&mut self, r: &MemberReset<'_>, now: Timestamp) -> Result<(), String> {
        self.reset(r, now);
        Ok(())
    }

    async fn set_group_ready_gate(
        &mut self,
        pod: &str,
        ready: bool,
        now: Timestamp,
    ) -> Result<(), String> {
        if let Some(m) = self.members.get_mut(pod)
            && m.gate != ready
        {
            m.gate = ready;
            let (kind, what) = if ready {
                (EntryKind::GateOpened, "in the router: its group is Ready")
            } else {
                (
                    EntryKind::GateClosed,
                    "out of the router: its group is not Ready",
                )
            };
            let (g, msg) = (m.group, format!("{pod}: {what}"));
            self.record.push(now, kind, !ready, g, Some(pod), None, msg);
        }
        Ok(())
    }

    async fn publish_event(&mut self, event: &PlannedEvent, now: Timestamp) -> Result<(), String> {
        let warning = event.type_ == EventKind::Warning;
        self.record.push(
            now,
            EntryKind::Event,
            warning,
            event.group,
            None,
            Some(event.reason),
            event.message.clone(),
        );
        Ok(())
    }
}

mod in_place;
#[cfg(test)]
mod reset_tests;
#[cfg(test)]
mod tests;
