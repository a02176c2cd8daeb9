//! Every reason the operator gives, as types: why an Event was published (and the Event's
//! action), and why a status condition says what it says. The planner, both executors and
//! the reconcile name reasons only through these enums, so a reason cannot be misspelled
//! on one side, and a new one does not compile until it has an action and a string.
//!
//! The strings are the API: `kubectl describe`, `kubectl get events`, the status, the
//! local runtime's record and docs/operations.md show them.

use crate::crd::CoRestartReason;

/// What the reconcile reports beside the planner's status when something is wrong with the
/// deployment as a whole: `Degraded=True` with this reason, and a Warning Event with the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Problem {
    /// The deployment's name makes object names the API server would refuse.
    InvalidName,
    /// `spec.prefill.args` or `spec.decode.args` repeat a flag the operator sets.
    InvalidArgs,
    /// The `tandem.dev/restart-requested-at` annotation is not an RFC 3339 time.
    InvalidRestartRequest,
    /// The API server refused an action.
    ApplyFailed,
    /// An object with a name this deployment uses belongs to someone else.
    ObjectConflict,
}

impl Problem {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidName => "InvalidName",
            Self::InvalidArgs => "InvalidArgs",
            Self::InvalidRestartRequest => "InvalidRestartRequest",
            Self::ApplyFailed => "ApplyFailed",
            Self::ObjectConflict => "ObjectConflict",
        }
    }
}

/// Why an Event was published (the Event's `reason`). The local runtime's record uses the
/// same reasons, and four of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventReason {
    /// A group's co-restart began; the reason is its trigger.
    CoRestart(CoRestartReason),
    /// A group entered another phase.
    GroupPhaseChanged,
    /// A group at or above `spec.groups` is being removed.
    ScalingDown,
    /// A pod past its grace period and the margin was deleted with grace period 0.
    PodForceDeleted,
    /// A hung or failed member was deleted with `health.unresponsiveGraceSeconds` instead
    /// of its full grace period.
    UnresponsiveMemberDeleted,
    /// A group's members all reset in place to its new incarnation.
    InPlaceResetCompleted,
    /// An in-place reset did not complete in time, or a member failed during it: the
    /// group's pods are deleted instead.
    InPlaceResetFailed,
    /// See [`Problem`].
    Problem(Problem),
    /// Local runtime: the edited manifest is refused (the running spec stays).
    InvalidSpec,
    /// Local runtime: the manifest's spec changed.
    SpecChanged,
    /// Local runtime: the manifest's `tandem.dev/restart-requested-at` changed.
    RestartRequestChanged,
    /// Local runtime: an action could not be carried out (retried with a backoff).
    ActionFailed,
}

impl EventReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CoRestart(r) => r.as_str(),
            Self::GroupPhaseChanged => "GroupPhaseChanged",
            Self::ScalingDown => "ScalingDown",
            Self::PodForceDeleted => "PodForceDeleted",
            Self::UnresponsiveMemberDeleted => "UnresponsiveMemberDeleted",
            Self::InPlaceResetCompleted => "InPlaceResetCompleted",
            Self::InPlaceResetFailed => "InPlaceResetFailed",
            Self::Problem(p) => p.as_str(),
            Self::InvalidSpec => "InvalidSpec",
            Self::SpecChanged => "SpecChanged",
            Self::RestartRequestChanged => "RestartRequestChanged",
            Self::ActionFailed => "ActionFailed",
        }
    }

    /// The Event's `action`: what the operator was doing.
    pub fn action(self) -> &'static str {
        match self {
            Self::CoRestart(_) => "CoRestart",
            Self::GroupPhaseChanged => "UpdateGroupPhase",
            Self::ScalingDown => "ScaleDown",
            Self::PodForceDeleted => "ForceDelete",
            Self::UnresponsiveMemberDeleted => "Delete",
            Self::InPlaceResetCompleted | Self::InPlaceResetFailed => "ResetInPlace",
            Self::Problem(Problem::InvalidRestartRequest) | Self::RestartRequestChanged => {
                "ParseAnnotation"
            }
            Self::Problem(Problem::ApplyFailed | Problem::ObjectConflict) | Self::ActionFailed => {
                "Apply"
            }
            Self::Problem(Problem::InvalidName | Problem::InvalidArgs) | Self::InvalidSpec => {
                "Validate"
            }
            Self::SpecChanged => "ReadSpec",
        }
    }
}

impl From<Problem> for EventReason {
    fn from(p: Problem) -> Self {
        Self::Problem(p)
    }
}

impl std::fmt::Display for EventReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for EventReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Why a condition (of the PDDeployment, or a decode pod's readiness gate) has its status.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ConditionReason {
    /// `Available`: enough groups are Ready / too few are.
    MinimumGroupsAvailable,
    GroupsUnavailable,
    /// `Progressing`: rolled out / paused / groups still being updated.
    Complete,
    Paused,
    Updating,
    /// `Degraded`: a co-restart held back by backoff / by `restart.policy: None`, a broken
    /// group, nothing wrong, or a [`Problem`] of the reconcile.
    CoRestartBackoff,
    CoRestartSuppressed,
    GroupBroken,
    AsExpected,
    Problem(Problem),
    /// `BootstrapHealthy`: every channel is healthy; a not-ready decode that gave no usable
    /// reason; no decode gave one.
    AllChannelsHealthy,
    DecodeNotReady,
    ChannelNotReady,
    /// `BootstrapHealthy`: a not-ready decode's own `/ready` reason (docs/readiness.md),
    /// verbatim. Only a reason the API server accepts ([`is_condition_reason`]) is kept.
    ReportedByDecode(String),
    /// The decode pod's `tandem.dev/group-ready` condition.
    GroupReady,
    GroupNotReady,
}

impl ConditionReason {
    pub fn as_str(&self) -> &str {
        match self {
            Self::MinimumGroupsAvailable => "MinimumGroupsAvailable",
            Self::GroupsUnavailable => "GroupsUnavailable",
            Self::Complete => "Complete",
            Self::Paused => "Paused",
            Self::Updating => "Updating",
            Self::CoRestartBackoff => "CoRestartBackoff",
            Self::CoRestartSuppressed => "CoRestartSuppressed",
            Self::GroupBroken => "GroupBroken",
            Self::AsExpected => "AsExpected",
            Self::Problem(p) => p.as_str(),
            Self::AllChannelsHealthy => "AllChannelsHealthy",
            Self::DecodeNotReady => "DecodeNotReady",
            Self::ChannelNotReady => "ChannelNotReady",
            Self::ReportedByDecode(r) => r,
            Self::GroupReady => "GroupReady",
            Self::GroupNotReady => "GroupNotReady",
        }
    }

    /// A decode's own reason when the API server accepts it as a condition reason, else
    /// [`Self::DecodeNotReady`].
    pub fn from_decode(reason: &str) -> Self {
        if is_condition_reason(reason) {
            Self::ReportedByDecode(reason.to_string())
        } else {
            Self::DecodeNotReady
        }
    }
}

impl From<Problem> for ConditionReason {
    fn from(p: Problem) -> Self {
        Self::Problem(p)
    }
}

/// Whether the API server accepts `s` as a condition's `reason`: at most 1024 characters
/// matching `^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`.
pub fn is_condition_reason(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b',' | b':');
    match (b.first(), b.last()) {
        (Some(first), Some(last)) => {
            b.len() <= 1024
                && first.is_ascii_alphabetic()
                && (last.is_ascii_alphanumeric() || *last == b'_')
                && b.iter().all(inner)
        }
        _ => false,
    }
}
