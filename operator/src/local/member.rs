//! A member process as the local runtime knows it, and how it reads to the planner.
//!
//! The mapping mirrors what the kubelet reports for a pod with `restartPolicy: Never`:
//! - a running process is phase `Running`; one that exited is `Succeeded` (exit code 0)
//!   or `Failed` (anything else) and stays so until the planner deletes it;
//! - `ready` is the container's readiness (`ContainersReady`): false at start, true after
//!   one successful `/ready` probe, false again after `failureThreshold` failures in a
//!   row; `not_ready_since` is when it last turned false;
//! - `ready_detail` of a decode that has answered once and is not ready is the reason of
//!   its latest `/ready` body (what the controller reads from a started pod), or
//!   `probe_unreachable` when it stopped answering;
//! - a member the runtime has signalled (a planned delete) is `terminating` until it
//!   exits, and is then gone;
//! - the readiness gate is membership in the local router.

use std::net::SocketAddr;
use std::path::PathBuf;

use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use crate::crd::HealthSpec;
use crate::planner::{ObservedPod, PodPhase, ReadyDetail, Role};
use crate::ready;

/// What one `/ready` probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// 200.
    Ready,
    /// The server answered, but not 200: the reason from its `/ready` body.
    NotReady(ReadyDetail),
    /// No answer: refused (still loading the model), timed out, or reset.
    Unreachable(String),
}

/// Readiness as the kubelet derives it from probes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Readiness {
    pub ready: bool,
    /// When `ready` last changed (or the process started).
    pub since: Timestamp,
    /// The HTTP server has answered at least once: the model is loaded.
    pub answered: bool,
    /// Consecutive failed probes.
    pub failures: u32,
    /// Latest probe result in words.
    pub detail: String,
    /// Why the latest probe failed, once the server has answered: its body's reason, or
    /// `probe_unreachable`. `None` after a success.
    pub reason: Option<ReadyDetail>,
}

impl Readiness {
    pub fn new(now: Timestamp) -> Self {
        Self {
            ready: false,
            since: now,
            answered: false,
            failures: 0,
            detail: "loading the model".into(),
            reason: None,
        }
    }

    /// Apply one probe result; returns true when `ready` changed.
    pub fn record(
        &mut self,
        outcome: ProbeOutcome,
        failure_threshold: i32,
        now: Timestamp,
    ) -> bool {
        let was = self.ready;
        match outcome {
            ProbeOutcome::Ready => {
                self.answered = true;
                self.failures = 0;
                self.ready = true;
                self.detail = "ready".into();
                self.reason = None;
            }
            ProbeOutcome::NotReady(why) => {
                self.answered = true;
                self.fail(failure_threshold);
                self.detail = format!("not ready: {}: {}", why.reason, why.message);
                self.reason = Some(why);
            }
            ProbeOutcome::Unreachable(why) => {
                self.fail(failure_threshold);
                if self.answered {
                    self.detail = format!("no answer: {why}");
                    self.reason = Some(ReadyDetail::new(ready::UNREACHABLE, why));
                } else {
                    self.detail = "loading the model".into();
                }
            }
        }
        if self.ready != was {
            self.since = now;
        }
        self.ready != was
    }

    fn fail(&mut self, threshold: i32) {
        self.failures = self.failures.saturating_add(1);
        if self.failures >= threshold.max(1) as u32 {
            self.ready = false;
        }
    }
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Exit {
    pub at: Timestamp,
    /// `exit code 1`, `killed by signal 9 (SIGKILL)`, …
    pub how: String,
    pub success: bool,
}

/// A planned delete in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Termination {
    pub since: Timestamp,
    /// SIGKILL follows at this time if the process is still there.
    pub kill_at: Timestamp,
    pub killed: bool,
    pub reason: String,
}

/// One member process.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Member {
    pub name: String,
    pub group: i32,
    #[serde(serialize_with = "role_str")]
    pub role: Role,
    pub index: i32,
    pub incarnation: i64,
    pub revision: String,
    pub pid: u32,
    /// The dataplane's HTTP address (OpenAI API, `/ready`).
    pub http: SocketAddr,
    /// Its KV port (the prefill's bootstrap address; unused by a decode).
    pub kv_port: u16,
    pub started: Timestamp,
    #[serde(skip)]
    pub health: HealthSpec,
    pub readiness: Readiness,
    pub exit: Option<Exit>,
    pub terminating: Option<Termination>,
    /// Set when the runtime killed the process for not starting in time.
    pub startup_failure: Option<String>,
    /// In the router (the readiness gate is open).
    pub gate: bool,
    pub log: PathBuf,
    /// The incarnation an in-place reset call in flight asks for.
    pub resetting: Option<i64>,
    /// In-place resets this process has completed (its weights were kept each time).
    pub resets: u32,
}

fn role_str<S: serde::Serializer>(r: &Role, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

impl Member {
    pub fn alive(&self) -> bool {
        self.exit.is_none()
    }

    /// Traffic may go to this member: a decode whose group gate is open and whose own
    /// readiness holds (a Service's endpoints need both, like the pod's `Ready`).
    pub fn serving(&self) -> bool {
        self.role == Role::Decode
            && self.gate
            && self.readiness.ready
            && self.alive()
            && self.terminating.is_none()
    }

    /// The pod the planner sees.
    pub fn observe(&self) -> ObservedPod {
        let phase = match &self.exit {
            None => PodPhase::Running,
            Some(e) if e.success => PodPhase::Succeeded,
            Some(_) => PodPhase::Failed,
        };
        let ready = self.alive() && self.readiness.ready;
        let not_ready_since = match (&self.exit, ready) {
            (_, true) => None,
            (Some(e), false) if self.readiness.ready => Some(e.at),
            (_, false) => Some(self.readiness.since),
        };
        // What the controller would read: only from a decode that runs, has started and
        // is not ready.
        let ready_detail =
            if self.role == Role::Decode && self.alive() && self.terminating.is_none() && !ready {
                self.readiness.reason.clone()
            } else {
                None
            };
        ObservedPod {
            name: self.name.clone(),
            group: self.group,
            role: self.role,
            index: self.index,
            revision: self.revision.clone(),
            incarnation: self.incarnation,
            phase,
            terminating: self.terminating.is_some(),
            ready,
            not_ready_since,
            group_ready_gate: self.gate,
            // The local router drops a member from its endpoint as the gate closes.
            gate_closed_since: None,
            // The executor sends SIGKILL itself when the grace period ends, so a local
            // member never needs the planner's force-delete (a remedy for lost nodes).
            deletion_deadline: None,
            // Every member runs on this machine, which is never lost to itself.
            node_lost: false,
            // A local member runs as soon as it is spawned (a spawn failure is an exit).
            waiting: None,
            exit: self.exit.as_ref().map(|e| e.how.clone()),
            ready_detail,
        }
    }

    /// A short state for people: loading, ready, not ready (why), terminating, exited.
    pub fn state(&self, now: Timestamp) -> String {
        let secs = |t: Timestamp| {
            let d = now.duration_since(t).as_secs_f64().max(0.0);
            format!("{d:.0}s")
        };
        if let Some(e) = &self.exit {
            return format!("exited {} ago: {}", secs(e.at), e.how);
        }
        if let Some(t) = &self.terminating {
            return format!(
                "terminating for {}{}",
                secs(t.since),
                if t.killed { " (SIGKILL sent)" } else { "" }
            );
        }
        if !self.readiness.answered {
            return format!("loading the model ({})", secs(self.started));
        }
        if self.readiness.ready {
            format!("ready for {}", secs(self.readiness.since))
        } else {
            format!(
                "{} (for {})",
                self.readiness.detail,
                secs(self.readiness.since)
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    pub(crate) fn member(role: Role) -> Member {
        Member {
            name: "demo-g0-i1-d0".into(),
            group: 0,
            role,
            index: 0,
            incarnation: 1,
            revision: "r1".into(),
            pid: 42,
            http: "127.0.0.1:1".parse().unwrap(),
            kv_port: 2,
            started: t(0),
            health: HealthSpec::default(),
            readiness: Readiness::new(t(0)),
            exit: None,
            terminating: None,
            startup_failure: None,
            gate: false,
            log: PathBuf::from("/dev/null"),
            resetting: None,
            resets: 0,
        }
    }

    fn not_ready(message: &str) -> ProbeOutcome {
        ProbeOutcome::NotReady(ReadyDetail::new("probe_timeout", message))
    }

    #[test]
    fn readiness_follows_the_kubelet_rules() {
        let mut r = Readiness::new(t(0));
        // Loading: refused connections keep it not ready without flipping anything.
        assert!(!r.record(ProbeOutcome::Unreachable("refused".into()), 3, t(1)));
        assert_eq!(r.detail, "loading the model");
        assert_eq!(r.since, t(0));
        // One success is enough.
        assert!(r.record(ProbeOutcome::Ready, 3, t(2)));
        assert!(r.ready && r.answered);
        assert_eq!(r.since, t(2));
        // Failures below the threshold keep it ready.
        assert!(!r.record(not_ready("channel down"), 3, t(3)));
        assert!(!r.record(ProbeOutcome::Unreachable("timed out".into()), 3, t(4)));
        assert!(r.ready);
        assert_eq!(r.detail, "no answer: timed out");
        // The threshold-th failure in a row flips it, stamped now.
        assert!(r.record(not_ready("channel down"), 3, t(5)));
        assert!(!r.ready);
        assert_eq!(r.since, t(5));
        assert_eq!(r.detail, "not ready: probe_timeout: channel down");
        assert_eq!(r.reason.as_ref().unwrap().reason, "probe_timeout");
        // A success in between resets the count.
        assert!(r.record(ProbeOutcome::Ready, 3, t(6)));
        r.record(not_ready("x"), 3, t(7));
        r.record(ProbeOutcome::Ready, 3, t(8));
        r.record(not_ready("x"), 3, t(9));
        r.record(not_ready("x"), 3, t(10));
        assert!(r.ready, "never three failures in a row");
        assert!(r.record(ProbeOutcome::Ready, 3, t(11)) || r.ready);
        assert_eq!(r.reason, None, "a success forgets the reason");
    }

    #[test]
    fn a_not_ready_decode_tells_the_planner_why_once_it_has_answered() {
        let mut m = member(Role::Decode);
        // Loading: refused connections are no reason (a pod before its startup probe).
        m.readiness
            .record(ProbeOutcome::Unreachable("refused".into()), 3, t(1));
        assert_eq!(m.observe().ready_detail, None);
        m.readiness.record(not_ready("no session"), 3, t(2));
        let d = m.observe().ready_detail.unwrap();
        assert_eq!(
            (d.reason.as_str(), d.message.as_str()),
            ("probe_timeout", "no session")
        );
        // Once it has answered, silence is a reason of its own.
        m.readiness.record(
            ProbeOutcome::Unreachable("timed out after 1s".into()),
            3,
            t(3),
        );
        let d = m.observe().ready_detail.unwrap();
        assert_eq!(
            (d.reason.as_str(), d.message.as_str()),
            ("probe_unreachable", "timed out after 1s")
        );
        // Ready: nothing to say; a prefill is never asked.
        m.readiness.record(ProbeOutcome::Ready, 3, t(4));
        assert_eq!(m.observe().ready_detail, None);
        let mut p = member(Role::Prefill);
        p.readiness.record(not_ready("x"), 3, t(2));
        assert_eq!(p.observe().ready_detail, None);
    }

    #[test]
    fn a_running_member_reads_as_a_running_pod() {
        let mut m = member(Role::Decode);
        let o = m.observe();
        assert_eq!(o.phase, PodPhase::Running);
        assert!(!o.ready && !o.terminating && !o.group_ready_gate);
        assert_eq!(o.not_ready_since, Some(t(0)), "not ready since it started");
        m.readiness.record(ProbeOutcome::Ready, 3, t(2));
        m.gate = true;
        let o = m.observe();
        assert!(o.ready && o.group_ready_gate);
        assert_eq!(o.not_ready_since, None);
        assert!(m.serving());
    }

    #[test]
    fn an_exited_member_is_failed_or_succeeded_and_not_ready() {
        let mut m = member(Role::Prefill);
        m.readiness.record(ProbeOutcome::Ready, 3, t(2));
        m.exit = Some(Exit {
            at: t(5),
            how: "killed by signal 9 (SIGKILL)".into(),
            success: false,
        });
        let o = m.observe();
        assert_eq!(o.phase, PodPhase::Failed);
        assert!(!o.ready);
        assert_eq!(o.not_ready_since, Some(t(5)));
        m.exit.as_mut().unwrap().success = true;
        assert_eq!(m.observe().phase, PodPhase::Succeeded);
    }

    #[test]
    fn a_signalled_member_is_terminating_and_serves_nothing() {
        let mut m = member(Role::Decode);
        m.readiness.record(ProbeOutcome::Ready, 3, t(2));
        m.gate = true;
        m.terminating = Some(Termination {
            since: t(3),
            kill_at: t(33),
            killed: false,
            reason: "CoRestart".into(),
        });
        assert!(m.observe().terminating);
        assert!(!m.serving());
        assert_eq!(m.state(t(5)), "terminating for 2s");
    }
}
