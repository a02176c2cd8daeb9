//! What the runtime publishes after every reconcile: the router's endpoints, the terminal
//! display and `GET /status` all read this one value.

use std::path::PathBuf;

use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use super::executor::{Endpoint, Entry};
use super::member::Member;
use crate::crd::{GroupPhase, PDDeploymentStatus};
use crate::planner::Role;

/// Record entries carried in a snapshot (the newest).
pub const RECORD_TAIL: usize = 400;

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberView {
    #[serde(flatten)]
    pub member: Member,
    /// In words: loading, ready, not ready (why), terminating, exited.
    pub state: String,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub deployment: String,
    pub file: PathBuf,
    /// Base URL of the OpenAI endpoint.
    pub endpoint: String,
    pub log_dir: PathBuf,
    /// SIGTERM → SIGKILL delay of a stopped member.
    pub grace_seconds: u64,
    /// Bumped by every spec change read from the file.
    pub generation: i64,
    /// The latest manifest could not be used; the previous spec keeps running.
    pub spec_error: Option<String>,
    pub shutting_down: bool,
    /// The planner's status (its memory between reconciles).
    pub status: Option<PDDeploymentStatus>,
    pub members: Vec<MemberView>,
    pub endpoints: Vec<Endpoint>,
    /// Why no request can be served now (empty while some endpoint is up).
    pub unavailable: String,
    pub record: Vec<Entry>,
    pub time: Timestamp,
}

impl Snapshot {
    pub fn empty(
        deployment: &str,
        file: PathBuf,
        endpoint: String,
        log_dir: PathBuf,
        grace_seconds: u64,
    ) -> Self {
        Self {
            deployment: deployment.to_string(),
            file,
            endpoint,
            log_dir,
            grace_seconds,
            generation: 0,
            spec_error: None,
            shutting_down: false,
            status: None,
            members: Vec::new(),
            endpoints: Vec::new(),
            unavailable: "the local runtime is starting".into(),
            record: Vec::new(),
            time: Timestamp::now(),
        }
    }
}

/// Why the router has no decode to send a request to, in words for a 503 body.
pub fn why_unavailable(
    status: Option<&PDDeploymentStatus>,
    members: &[Member],
    shutting_down: bool,
    desired_groups: i32,
) -> String {
    if shutting_down {
        return "the local runtime is shutting down".into();
    }
    if desired_groups == 0 {
        return "spec.groups is 0: no group runs".into();
    }
    let Some(status) = status else {
        return "no group is ready yet: the local runtime is starting".into();
    };
    let mut why = Vec::new();
    for g in status
        .group_statuses
        .iter()
        .filter(|g| g.index < desired_groups)
    {
        let mut s = format!(
            "group {} is {:?} at incarnation {}",
            g.index, g.phase, g.incarnation
        );
        if let Some(m) = &g.message {
            s.push_str(&format!(" ({m})"));
        } else if g.phase == GroupPhase::Ready {
            let decode_state = members
                .iter()
                .filter(|m| m.group == g.index && m.role == Role::Decode)
                .map(|m| format!("{}: {}", m.name, m.readiness.detail))
                .collect::<Vec<_>>()
                .join(", ");
            s.push_str(&format!(" but no decode is ready ({decode_state})"));
        } else {
            let loading: Vec<&str> = members
                .iter()
                .filter(|m| m.group == g.index && m.alive() && !m.readiness.answered)
                .map(|m| m.role.as_str())
                .collect();
            if !loading.is_empty() {
                s.push_str(&format!(" ({} loading the model)", loading.join(" and ")));
            }
        }
        why.push(s);
    }
    if why.is_empty() {
        return "no group is ready yet".into();
    }
    format!("no group is ready: {}", why.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::GroupStatus;

    #[test]
    fn the_reason_names_each_group_and_what_it_waits_for() {
        let status = PDDeploymentStatus {
            group_statuses: vec![
                GroupStatus {
                    index: 0,
                    incarnation: 2,
                    phase: GroupPhase::Restarting,
                    message: Some("removing 1 pod(s) of the previous incarnation".into()),
                    ..Default::default()
                },
                GroupStatus {
                    index: 1,
                    incarnation: 1,
                    phase: GroupPhase::StartingPrefill,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let why = why_unavailable(Some(&status), &[], false, 2);
        assert_eq!(
            why,
            "no group is ready: group 0 is Restarting at incarnation 2 (removing 1 pod(s) of \
             the previous incarnation); group 1 is StartingPrefill at incarnation 1"
        );
        assert_eq!(
            why_unavailable(Some(&status), &[], true, 2),
            "the local runtime is shutting down"
        );
        assert!(why_unavailable(None, &[], false, 1).contains("starting"));
        assert!(why_unavailable(None, &[], false, 0).contains("spec.groups is 0"));
    }
}
