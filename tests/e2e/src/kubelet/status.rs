//! Pod status by the kubelet's rules (pure; the pod worker feeds it what it observed).
//!
//! - `ContainersReady` is True when every container is ready (its readiness probe passed,
//!   or it has none and is running and started); False with reason `ContainersNotReady` and
//!   a message naming the unready containers; False with reason `PodFailed` or
//!   `PodCompleted` once the pod is in a terminal phase.
//! - `Ready` copies `ContainersReady` while that is not True; otherwise it is True only if
//!   every readiness gate's condition exists on the pod and is True, else False with reason
//!   `ReadinessGatesNotReady` and a message naming the gates.
//! - Phase with `restartPolicy: Never`: Pending until the container starts, Running while
//!   it runs, then Succeeded (exit 0) or Failed.
//!
//! A condition's `lastTransitionTime` changes only when its status does.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, Pod, PodCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

pub const CONTAINERS_READY: &str = "ContainersReady";
pub const READY: &str = "Ready";
pub const INITIALIZED: &str = "Initialized";
pub const READY_TO_START: &str = "PodReadyToStartContainers";

/// What the runtime knows about a container.
#[derive(Debug, Clone, PartialEq)]
pub enum Runtime {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started_at: Timestamp,
    },
    Terminated {
        exit_code: i32,
        signal: Option<i32>,
        reason: String,
        message: Option<String>,
        started_at: Option<Timestamp>,
        finished_at: Timestamp,
    },
}

/// One container as the pod worker sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerView {
    pub name: String,
    pub image: String,
    pub container_id: Option<String>,
    pub runtime: Runtime,
    /// The startup probe has succeeded (or there is none and the container runs).
    pub started: bool,
    /// The readiness probe's verdict (or: no probe and started).
    pub ready: bool,
}

impl ContainerView {
    pub fn to_status(&self) -> ContainerStatus {
        let state = match &self.runtime {
            Runtime::Waiting { reason, message } => ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.clone()),
                    message: message.clone(),
                }),
                ..Default::default()
            },
            Runtime::Running { started_at } => ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(Time(*started_at)),
                }),
                ..Default::default()
            },
            Runtime::Terminated {
                exit_code,
                signal,
                reason,
                message,
                started_at,
                finished_at,
            } => ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: *exit_code,
                    signal: *signal,
                    reason: Some(reason.clone()),
                    message: message.clone(),
                    started_at: started_at.map(Time),
                    finished_at: Some(Time(*finished_at)),
                    container_id: self.container_id.clone(),
                }),
                ..Default::default()
            },
        };
        let running = matches!(self.runtime, Runtime::Running { .. });
        ContainerStatus {
            name: self.name.clone(),
            image: self.image.clone(),
            image_id: format!("e2e-local://{}", self.image),
            container_id: self.container_id.clone(),
            ready: self.ready && running,
            started: Some(self.started && running),
            restart_count: 0,
            state: Some(state),
            ..Default::default()
        }
    }
}

/// Phase with `restartPolicy: Never` (the only policy the operator uses; `Always` and
/// `OnFailure` are not supported by this kubelet and are refused at admission).
pub fn phase(containers: &[ContainerView]) -> &'static str {
    let all_terminated = containers
        .iter()
        .all(|c| matches!(c.runtime, Runtime::Terminated { .. }));
    if !containers.is_empty() && all_terminated {
        let all_ok = containers
            .iter()
            .all(|c| matches!(c.runtime, Runtime::Terminated { exit_code: 0, .. }));
        return if all_ok { "Succeeded" } else { "Failed" };
    }
    if containers.iter().any(|c| {
        matches!(
            c.runtime,
            Runtime::Running { .. } | Runtime::Terminated { .. }
        )
    }) {
        "Running"
    } else {
        "Pending"
    }
}

/// Status, reason and message of a condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub ok: bool,
    pub reason: Option<String>,
    pub message: Option<String>,
}

impl Verdict {
    fn yes() -> Self {
        Verdict {
            ok: true,
            reason: None,
            message: None,
        }
    }
    fn no(reason: &str, message: Option<String>) -> Self {
        Verdict {
            ok: false,
            reason: Some(reason.into()),
            message,
        }
    }
}

pub fn containers_ready(containers: &[ContainerView], phase: &str) -> Verdict {
    match phase {
        "Failed" => return Verdict::no("PodFailed", None),
        "Succeeded" => return Verdict::no("PodCompleted", None),
        _ => {}
    }
    let unready: Vec<&str> = containers
        .iter()
        .filter(|c| !(c.ready && matches!(c.runtime, Runtime::Running { .. })))
        .map(|c| c.name.as_str())
        .collect();
    if unready.is_empty() {
        Verdict::yes()
    } else {
        Verdict::no(
            "ContainersNotReady",
            Some(format!(
                "containers with unready status: [{}]",
                unready.join(" ")
            )),
        )
    }
}

/// `Ready` from `ContainersReady` and the readiness gates (conditions as on the API object).
pub fn pod_ready(pod: &Pod, containers_ready: &Verdict) -> Verdict {
    if !containers_ready.ok {
        return containers_ready.clone();
    }
    let api_conditions = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let gates = pod
        .spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_deref())
        .unwrap_or_default();
    let mut problems = Vec::new();
    for gate in gates {
        match api_conditions
            .iter()
            .find(|c| c.type_ == gate.condition_type)
        {
            None => problems.push(format!(
                "corresponding condition of pod readiness gate \"{}\" does not exist.",
                gate.condition_type
            )),
            Some(c) if c.status != "True" => problems.push(format!(
                "the status of pod readiness gate \"{}\" is not \"True\", but {}",
                gate.condition_type, c.status
            )),
            Some(_) => {}
        }
    }
    if problems.is_empty() {
        Verdict::yes()
    } else {
        Verdict::no("ReadinessGatesNotReady", Some(problems.join(", ")))
    }
}

/// The kubelet-owned conditions, remembering when each last changed.
#[derive(Debug, Clone, Default)]
pub struct Conditions {
    current: BTreeMap<&'static str, (Verdict, Timestamp)>,
}

impl Conditions {
    /// Start from what the API object says (a kubelet restart keeps transition times).
    pub fn from_pod(pod: &Pod) -> Conditions {
        let mut c = Conditions::default();
        let existing = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_deref())
            .unwrap_or_default();
        for t in [READY_TO_START, INITIALIZED, CONTAINERS_READY, READY] {
            if let Some(pc) = existing.iter().find(|pc| pc.type_ == t)
                && let Some(at) = &pc.last_transition_time
            {
                c.current.insert(
                    t,
                    (
                        Verdict {
                            ok: pc.status == "True",
                            reason: pc.reason.clone(),
                            message: pc.message.clone(),
                        },
                        at.0,
                    ),
                );
            }
        }
        c
    }

    pub fn set(&mut self, type_: &'static str, v: Verdict, now: Timestamp) {
        let at = match self.current.get(type_) {
            Some((old, at)) if old.ok == v.ok => *at,
            _ => now,
        };
        self.current.insert(type_, (v, at));
    }

    pub fn get(&self, type_: &str) -> Option<&Verdict> {
        self.current.get(type_).map(|(v, _)| v)
    }

    pub fn to_conditions(&self) -> Vec<PodCondition> {
        [READY_TO_START, INITIALIZED, CONTAINERS_READY, READY]
            .iter()
            .filter_map(|t| self.current.get(t).map(|c| (t, c)))
            .map(|(t, (v, at))| PodCondition {
                type_: (*t).to_string(),
                status: if v.ok { "True" } else { "False" }.into(),
                reason: v.reason.clone(),
                message: v.message.clone(),
                last_transition_time: Some(Time(*at)),
                ..Default::default()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodReadinessGate, PodSpec, PodStatus};

    fn running(ready: bool) -> ContainerView {
        ContainerView {
            name: "dataplane".into(),
            image: "img".into(),
            container_id: Some("e2e://1".into()),
            runtime: Runtime::Running {
                started_at: Timestamp::UNIX_EPOCH,
            },
            started: true,
            ready,
        }
    }

    fn gated_pod(gate: Option<&str>) -> Pod {
        Pod {
            spec: Some(PodSpec {
                readiness_gates: Some(vec![PodReadinessGate {
                    condition_type: "tandem.dev/group-ready".into(),
                }]),
                ..Default::default()
            }),
            status: Some(PodStatus {
                conditions: gate.map(|s| {
                    vec![PodCondition {
                        type_: "tandem.dev/group-ready".into(),
                        status: s.into(),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn ready_needs_containers_ready_and_every_gate() {
        let cr = containers_ready(&[running(true)], "Running");
        assert!(cr.ok);
        let missing = pod_ready(&gated_pod(None), &cr);
        assert_eq!(missing.reason.as_deref(), Some("ReadinessGatesNotReady"));
        assert!(missing.message.unwrap().contains("does not exist"));
        let closed = pod_ready(&gated_pod(Some("False")), &cr);
        assert!(!closed.ok);
        assert!(
            closed
                .message
                .unwrap()
                .contains("is not \"True\", but False")
        );
        assert!(pod_ready(&gated_pod(Some("True")), &cr).ok);

        let not = containers_ready(&[running(false)], "Running");
        assert_eq!(not.reason.as_deref(), Some("ContainersNotReady"));
        assert_eq!(
            not.message.as_deref(),
            Some("containers with unready status: [dataplane]")
        );
        let r = pod_ready(&gated_pod(Some("True")), &not);
        assert_eq!(r, not, "Ready copies ContainersReady when that is not True");
    }

    #[test]
    fn phase_follows_the_container_with_restart_policy_never() {
        let waiting = ContainerView {
            runtime: Runtime::Waiting {
                reason: "ContainerCreating".into(),
                message: None,
            },
            ..running(false)
        };
        assert_eq!(phase(&[waiting]), "Pending");
        assert_eq!(phase(&[running(false)]), "Running");
        let exited = |code| ContainerView {
            runtime: Runtime::Terminated {
                exit_code: code,
                signal: None,
                reason: "Error".into(),
                message: None,
                started_at: None,
                finished_at: Timestamp::UNIX_EPOCH,
            },
            ..running(false)
        };
        assert_eq!(phase(&[exited(0)]), "Succeeded");
        assert_eq!(phase(&[exited(137)]), "Failed");
        assert_eq!(
            containers_ready(&[exited(137)], "Failed").reason.as_deref(),
            Some("PodFailed")
        );
    }

    #[test]
    fn transition_time_changes_only_with_the_status() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        let t2 = Timestamp::from_second(3_000).unwrap();
        let mut c = Conditions::default();
        c.set(READY, Verdict::no("ContainersNotReady", None), t0);
        c.set(READY, Verdict::no("ReadinessGatesNotReady", None), t1);
        let at = |c: &Conditions| c.to_conditions()[0].last_transition_time.clone().unwrap().0;
        assert_eq!(at(&c), t0, "same status, new reason: time kept");
        c.set(READY, Verdict::yes(), t2);
        assert_eq!(at(&c), t2);
    }
}
