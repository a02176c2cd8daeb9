//! What the user reads: the status (written with server-side apply), the `Degraded`
//! condition for failures the planner cannot see, and the Events.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::warn;

use super::{Error, FIELD_MANAGER, MAX_NOTE};
use crate::crd::{PDDeployment, PDDeploymentStatus, conditions};
use crate::names;
use crate::planner::{EventKind, PlannedEvent};
use crate::reasons::{ConditionReason, EventReason, Problem};

/// Mark `Degraded` True with `problem` unless the planner already reports a degradation,
/// in which case the message is appended.
pub(super) fn degrade(
    status: &mut PDDeploymentStatus,
    prev: Option<&PDDeploymentStatus>,
    problem: Problem,
    message: &str,
    now: Timestamp,
) {
    let generation = status.observed_generation;
    let idx = match status
        .conditions
        .iter()
        .position(|c| c.type_ == conditions::DEGRADED)
    {
        Some(i) => i,
        None => {
            status.conditions.push(Condition {
                type_: conditions::DEGRADED.into(),
                status: "False".into(),
                reason: ConditionReason::AsExpected.as_str().into(),
                message: String::new(),
                last_transition_time: Time(now),
                observed_generation: generation,
            });
            status.conditions.len() - 1
        }
    };
    let c = &mut status.conditions[idx];
    if c.status == "True" {
        if !c.message.contains(message) {
            c.message = format!("{}; {message}", c.message);
        }
        return;
    }
    let since = prev
        .and_then(|p| {
            p.conditions
                .iter()
                .find(|c| c.type_ == conditions::DEGRADED)
        })
        .filter(|c| c.status == "True")
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    *c = Condition {
        type_: conditions::DEGRADED.into(),
        status: "True".into(),
        reason: ConditionReason::from(problem).as_str().into(),
        message: message.into(),
        last_transition_time: since,
        observed_generation: c.observed_generation,
    };
}

/// Put `message` in the `Degraded` condition and publish it as a Warning Event, unless
/// the previous status already carried it (one Event per distinct message, not one per
/// reconcile).
pub(super) async fn report_once(
    recorder: &Recorder,
    pdd: &PDDeployment,
    status: &mut PDDeploymentStatus,
    problem: Problem,
    message: &str,
    now: Timestamp,
) {
    let prev = pdd.status.as_ref();
    let already = prev
        .and_then(|p| {
            p.conditions
                .iter()
                .find(|c| c.type_ == conditions::DEGRADED)
        })
        .is_some_and(|c| c.status == "True" && c.message.contains(message));
    if !already {
        publish(
            recorder,
            pdd,
            &PlannedEvent {
                type_: EventKind::Warning,
                reason: EventReason::from(problem),
                group: -1,
                message: message.into(),
            },
        )
        .await;
    }
    degrade(status, prev, problem, message, now);
}

pub(super) async fn write_status(
    api: &Api<PDDeployment>,
    name: &str,
    status: &PDDeploymentStatus,
) -> Result<(), Error> {
    let patch = json!({
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDDeployment",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(Error::kube("writing status"))?;
    Ok(())
}

/// Publish an event on the deployment. Events are best effort: a failure is logged and
/// never fails the reconcile.
pub(super) async fn publish(recorder: &Recorder, pdd: &PDDeployment, ev: &PlannedEvent) {
    let mut note = ev.message.clone();
    if note.len() > MAX_NOTE {
        let mut cut = MAX_NOTE;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    // The group's bootstrap Service stands for the group, so that events of different
    // groups are never folded together by the recorder.
    let secondary = (ev.group >= 0).then(|| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        name: Some(names::group_service_name(&pdd.name_any(), ev.group)),
        namespace: pdd.namespace(),
        ..Default::default()
    });
    let event = Event {
        type_: match ev.type_ {
            EventKind::Normal => EventType::Normal,
            EventKind::Warning => EventType::Warning,
        },
        reason: ev.reason.as_str().into(),
        note: Some(note),
        action: ev.reason.action().into(),
        secondary,
    };
    if let Err(e) = recorder.publish(&event, &pdd.object_ref(&())).await {
        warn!(reason = %ev.reason, group = ev.group, "publishing event failed: {e}");
    }
}
