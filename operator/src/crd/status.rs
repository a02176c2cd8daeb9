//! The `PDDeployment`'s status: the user's view of every group and the operator's memory
//! between reconciles (incarnations, co-restarts and their reasons, backoff deadlines).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::RevisionedSpec;

/// Observed state, and the operator's memory of each group.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PDDeploymentStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Groups that currently exist (have at least one pod or are being built).
    #[serde(default)]
    pub groups: i32,
    #[serde(default)]
    pub ready_groups: i32,
    #[serde(default)]
    pub updated_groups: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_revision: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_revision: Option<String>,
    /// Label selector of the decode pods, for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// One entry per group, ordered by index.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group_statuses: Vec<GroupStatus>,
    /// Pod-shaping part of the spec at `currentRevision`, kept so that groups held back
    /// by `partition` or `paused` can be rebuilt at their revision after a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_template: Option<RevisionedSpec>,
}

/// Life-cycle phase of a group.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum GroupPhase {
    /// Nothing exists yet.
    #[default]
    Pending,
    /// Prefill pods exist; waiting for all of them to be Ready.
    StartingPrefill,
    /// Decode pods exist; waiting for all of them to be Ready.
    StartingDecode,
    /// Every member Ready at one incarnation; the decode pods receive traffic.
    Ready,
    /// A member is not Ready (or gone, or failed); a co-restart may follow.
    Broken,
    /// Old members are being removed, decode first, before the rebuild.
    Restarting,
    /// The members are resetting in place to the new incarnation, prefill first, without
    /// exiting (`status.groups[].reset`); on failure or after
    /// `restart.inPlaceResetSeconds` the group goes to `Restarting`.
    Resetting,
    /// Index at or above `spec.groups`: being removed, decode first.
    ScalingDown,
}

/// Why a group was co-restarted (used in events, status and metrics).
#[derive(
    Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
pub enum CoRestartReason {
    MemberFailed,
    MemberDeleted,
    MemberNotReady,
    IncarnationMismatch,
    RevisionChanged,
    RestartRequested,
}

impl CoRestartReason {
    pub const ALL: [CoRestartReason; 6] = [
        Self::MemberFailed,
        Self::MemberDeleted,
        Self::MemberNotReady,
        Self::IncarnationMismatch,
        Self::RevisionChanged,
        Self::RestartRequested,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::MemberFailed => "MemberFailed",
            Self::MemberDeleted => "MemberDeleted",
            Self::MemberNotReady => "MemberNotReady",
            Self::IncarnationMismatch => "IncarnationMismatch",
            Self::RevisionChanged => "RevisionChanged",
            Self::RestartRequested => "RestartRequested",
        }
    }
}

impl std::fmt::Display for CoRestartReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CoRestartRecord {
    pub time: Time,
    pub reason: CoRestartReason,
    /// Carried out in place (the members reset without exiting and kept their weights);
    /// false when the pods were deleted and recreated.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_place: bool,
}

/// An in-place co-restart in progress (`GroupPhase::Resetting`).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InPlaceReset {
    /// The incarnation the members are leaving (the group's `incarnation` is the one they
    /// reset to).
    pub from_incarnation: i64,
    /// When the reset began; it falls back to deleting the pods once
    /// `restart.inPlaceResetSeconds` have passed.
    pub started: Time,
}

/// The operator's view of one bootstrap group.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupStatus {
    pub index: i32,
    /// Revision the group's pods are (or are being) built from.
    #[serde(default)]
    pub revision: String,
    /// Monotonic per group; bumped by every co-restart.
    #[serde(default)]
    pub incarnation: i64,
    #[serde(default)]
    pub phase: GroupPhase,
    /// Names of the group's pods seen at this incarnation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// Every decode pod reports its channel to every prefill healthy.
    #[serde(default)]
    pub bootstrap_healthy: bool,
    #[serde(default)]
    pub co_restarts: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_co_restart: Option<CoRestartRecord>,
    /// A co-restart is held back by the backoff until this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_restart_after: Option<Time>,
    /// When the current incarnation began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// When the group first became Ready at this incarnation (cleared by a co-restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_since: Option<Time>,
    /// Failure co-restarts since the group was last stable: the backoff's exponent.
    #[serde(default)]
    pub backoff_streak: i32,
    /// A reason for the current phase, when it is not self-explanatory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Why a running decode pod of this incarnation is not ready, in the dataplane's own
    /// words (its `/ready` body, docs/readiness.md); absent when no decode reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_not_ready: Option<DecodeNotReady>,
    /// The in-place co-restart in progress, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<InPlaceReset>,
}

/// A decode pod's answer to `/ready` while it is not ready.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DecodeNotReady {
    /// The decode pod.
    pub pod: String,
    /// The `/ready` body's `reason` (`auth_failed`, `probe_timeout`, …), or the
    /// operator's own when the body could not be read (`probe_unreachable`,
    /// `probe_unknown_format`, `probe_malformed`).
    pub reason: String,
    /// The body's `message` as it was when this reason first appeared (kept while the
    /// reason stays the same, so that the status does not change on every probe).
    pub message: String,
}
