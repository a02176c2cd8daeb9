//! Summarize group memories into the PDDeployment status: counts, revisions and the four
//! conditions (`Available`, `Progressing`, `Degraded`, `BootstrapHealthy`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use super::{Ctx, decode_selector};
use crate::crd::{DecodeNotReady, GroupPhase, GroupStatus, PDDeploymentStatus, conditions};
use crate::reasons::ConditionReason;

/// Groups whose decode reason is spelled out in the `BootstrapHealthy` message.
const MAX_REPORTED_GROUPS: usize = 5;

pub(super) fn summarize(
    ctx: &Ctx<'_>,
    prev: &PDDeploymentStatus,
    group_statuses: Vec<GroupStatus>,
) -> PDDeploymentStatus {
    let input = ctx.input;
    let desired = input.spec.groups.max(0);
    let now = input.now;
    let in_range = || group_statuses.iter().filter(|g| g.index < desired);
    let existing = group_statuses
        .iter()
        .filter(|g| g.phase != GroupPhase::Pending)
        .count() as i32;
    let ready = in_range().filter(|g| g.phase == GroupPhase::Ready).count() as i32;
    let updated = in_range()
        .filter(|g| g.revision == ctx.update_revision && g.phase != GroupPhase::Pending)
        .count() as i32;
    let rolled_out = in_range().count() as i32 == desired
        && in_range().all(|g| g.revision == ctx.update_revision && g.phase == GroupPhase::Ready)
        && group_statuses.iter().all(|g| g.index < desired);

    // The current revision advances once every group runs the update revision and is
    // Ready; until then it is the one held-back groups are rebuilt at.
    let (current_revision, current_template) = if rolled_out {
        (ctx.update_revision.clone(), ctx.update.clone())
    } else {
        (ctx.current_revision.clone(), ctx.current.clone())
    };

    let prev_conds = prev.conditions.as_slice();
    let generation = input.generation;
    let mut conditions = Vec::new();
    let max_unavailable = input.spec.rollout.max_unavailable_groups.max(1);
    let needed = (desired - max_unavailable).max(if desired > 0 { 1 } else { 0 });
    set_condition(
        &mut conditions,
        prev_conds,
        conditions::AVAILABLE,
        ready >= needed,
        if ready >= needed {
            ConditionReason::MinimumGroupsAvailable
        } else {
            ConditionReason::GroupsUnavailable
        },
        format!("{ready} of {desired} groups ready (at least {needed} needed)"),
        now,
        generation,
    );

    let paused = input.spec.rollout.paused;
    let (progressing, reason, message) = if rolled_out {
        (
            false,
            ConditionReason::Complete,
            format!("{desired} groups ready at revision {}", ctx.update_revision),
        )
    } else if paused {
        (false, ConditionReason::Paused, "rollout paused".to_string())
    } else {
        (
            true,
            ConditionReason::Updating,
            format!(
                "{ready} of {desired} groups ready, {updated} at revision {}",
                ctx.update_revision
            ),
        )
    };
    set_condition(
        &mut conditions,
        prev_conds,
        conditions::PROGRESSING,
        progressing,
        reason,
        message,
        now,
        generation,
    );

    let held: Vec<&GroupStatus> = group_statuses
        .iter()
        .filter(|g| g.phase == GroupPhase::Broken && g.message.is_some())
        .collect();
    let backoff: Vec<i32> = group_statuses
        .iter()
        .filter(|g| g.next_restart_after.as_ref().is_some_and(|t| t.0 > now))
        .filter(|g| g.phase == GroupPhase::Broken)
        .map(|g| g.index)
        .collect();
    let broken: Vec<i32> = group_statuses
        .iter()
        .filter(|g| g.phase == GroupPhase::Broken)
        .map(|g| g.index)
        .collect();
    let (degraded, reason, message) = if !backoff.is_empty() {
        (
            true,
            ConditionReason::CoRestartBackoff,
            format!(
                "co-restart held back by backoff for groups {}",
                list(&backoff)
            ),
        )
    } else if let Some(g) = held.first() {
        (
            true,
            ConditionReason::CoRestartSuppressed,
            g.message.clone().unwrap_or_default(),
        )
    } else if !broken.is_empty() {
        (
            true,
            ConditionReason::GroupBroken,
            format!("groups {} broken", list(&broken)),
        )
    } else {
        (
            false,
            ConditionReason::AsExpected,
            "no group is broken".to_string(),
        )
    };
    set_condition(
        &mut conditions,
        prev_conds,
        conditions::DEGRADED,
        degraded,
        reason,
        message,
        now,
        generation,
    );

    let unhealthy: Vec<i32> = in_range()
        .filter(|g| !g.bootstrap_healthy)
        .map(|g| g.index)
        .collect();
    let healthy = unhealthy.is_empty();
    // What the not-ready decode pods say about themselves, lowest group first.
    let reported: Vec<(i32, &DecodeNotReady)> = in_range()
        .filter(|g| !g.bootstrap_healthy)
        .filter_map(|g| g.decode_not_ready.as_ref().map(|d| (g.index, d)))
        .collect();
    let (reason, message) = if healthy {
        (
            ConditionReason::AllChannelsHealthy,
            format!("every decode of {desired} groups reports its KV channel healthy"),
        )
    } else {
        let mut message = format!("KV channel not healthy in groups {}", list(&unhealthy));
        for (g, d) in reported.iter().take(MAX_REPORTED_GROUPS) {
            message.push_str(&format!(
                "; group {g} decode pod {}: {}: {}",
                d.pod, d.reason, d.message
            ));
        }
        if reported.len() > MAX_REPORTED_GROUPS {
            message.push_str(&format!(
                "; {} more groups report a reason",
                reported.len() - MAX_REPORTED_GROUPS
            ));
        }
        // The first decode's own reason, verbatim when Kubernetes accepts it as a
        // condition reason (every reason of docs/readiness.md does).
        let reason = match reported.first() {
            Some((_, d)) => ConditionReason::from_decode(&d.reason),
            None => ConditionReason::ChannelNotReady,
        };
        (reason, message)
    };
    set_condition(
        &mut conditions,
        prev_conds,
        conditions::BOOTSTRAP_HEALTHY,
        healthy,
        reason,
        message,
        now,
        generation,
    );

    PDDeploymentStatus {
        observed_generation: generation,
        groups: existing,
        ready_groups: ready,
        updated_groups: updated,
        current_revision: Some(current_revision),
        update_revision: Some(ctx.update_revision.clone()),
        selector: Some(decode_selector(input.name)),
        conditions,
        group_statuses,
        current_template: Some(current_template),
    }
}

fn list(groups: &[i32]) -> String {
    groups
        .iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Conditions are only re-stamped when their status changes (Kubernetes convention).
#[allow(clippy::too_many_arguments)]
fn set_condition(
    conditions: &mut Vec<Condition>,
    prev: &[Condition],
    type_: &str,
    ok: bool,
    reason: ConditionReason,
    message: String,
    now: Timestamp,
    generation: Option<i64>,
) {
    let status = if ok { "True" } else { "False" }.to_string();
    let last = prev
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    conditions.push(Condition {
        type_: type_.to_string(),
        status,
        reason: reason.as_str().to_string(),
        message,
        last_transition_time: last,
        observed_generation: generation,
    });
}
