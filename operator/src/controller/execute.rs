//! Carrying out the planner's actions on the API server: server-side apply of Services
//! and NetworkPolicies, create-only Secrets and pods, deletes, and the readiness-gate patch.

use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::Recorder;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use super::observe::Foreign;
use super::report::publish;
use super::{Context, Error, FIELD_MANAGER, is_status};
use crate::crd::{PDDeployment, conditions};
use crate::names;
use crate::planner::PlannedAction;
use crate::resources;

fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

async fn server_side_apply<K>(api: &Api<K>, obj: &K, what: &str) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(&name, &apply_params(), &Patch::Apply(obj))
        .await
        .map_err(Error::kube(format!("applying {what} {name}")))?;
    Ok(())
}

/// Delete, treating "already gone" as success.
async fn delete<K>(api: &Api<K>, name: &str, what: &str, dp: &DeleteParams) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, dp).await {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 404) => Ok(()),
        Err(e) => Err(Error::kube(format!("deleting {what} {name}"))(e)),
    }
}

/// Refuse to touch `(kind, name)` when it belongs to someone else.
fn check_not_foreign(foreign: &Foreign, kind: &'static str, name: &str) -> Result<(), Error> {
    match foreign.get(&(kind, name.to_string())) {
        Some(owner) => Err(Error::Conflict {
            kind,
            name: name.to_string(),
            owner: owner.clone(),
        }),
        None => Ok(()),
    }
}

/// Create `obj`, never overwriting: the planner only creates what the fresh lists did not
/// show as ours, so an object that already exists belongs to someone else (listed reads
/// are consistent, and one reconcile runs at a time per deployment). That is a reported
/// conflict, not a success and not a takeover.
async fn create_if_missing<K>(api: &Api<K>, obj: &K, kind: &'static str) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 409) => Err(Error::Conflict {
            kind,
            name,
            owner: "it appeared after this reconcile listed the namespace".into(),
        }),
        Err(e) => Err(Error::kube(format!("creating {kind} {name}"))(e)),
    }
}

/// Carry out one planned action. Objects of [`Foreign`] are never written.
pub(super) async fn apply(
    ctx: &Context,
    pdd: &PDDeployment,
    foreign: &Foreign,
    recorder: &Recorder,
    action: &PlannedAction,
) -> Result<(), Error> {
    let ns = pdd.namespace().ok_or(Error::NoNamespace)?;
    let name = pdd.name_any();
    let client = ctx.client.clone();
    match action {
        PlannedAction::ApplyClientService => {
            check_not_foreign(foreign, "service", &name)?;
            let api = Api::<Service>::namespaced(client, &ns);
            server_side_apply(&api, &resources::client_service(pdd)?, "service").await
        }
        PlannedAction::ApplyGroupService { group } => {
            check_not_foreign(
                foreign,
                "service",
                &names::group_service_name(&name, *group),
            )?;
            let api = Api::<Service>::namespaced(client, &ns);
            server_side_apply(&api, &resources::group_service(pdd, *group)?, "service").await
        }
        PlannedAction::ApplyNetworkPolicy { group } => {
            check_not_foreign(
                foreign,
                "networkpolicy",
                &names::network_policy_name(&name, *group),
            )?;
            let api = Api::<NetworkPolicy>::namespaced(client, &ns);
            let np = resources::network_policy(pdd, *group)?;
            server_side_apply(&api, &np, "network policy").await
        }
        PlannedAction::CreateGroupSecret { group } => {
            check_not_foreign(foreign, "secret", &names::group_secret_name(&name, *group))?;
            let api = Api::<Secret>::namespaced(client, &ns);
            let secret = resources::group_secret(pdd, *group, &resources::random_group_key())?;
            // Never overwrite an existing key: pods may be using it.
            create_if_missing(&api, &secret, "secret").await
        }
        PlannedAction::CreatePod(intent) => {
            check_not_foreign(foreign, "pod", &intent.name)?;
            info!(pod = %intent.name, group = intent.group, role = intent.role.as_str(), incarnation = intent.incarnation, "creating pod");
            let api = Api::<Pod>::namespaced(client, &ns);
            // Created, never applied: a pod of another owner with this name (a deployment
            // of the same name being deleted) must not be taken over.
            create_if_missing(&api, &resources::pod(pdd, intent)?, "pod").await
        }
        PlannedAction::DeletePod {
            name: pod,
            group,
            role,
            reason,
        } => {
            info!(pod, group, role = role.as_str(), ?reason, "deleting pod");
            delete(
                &Api::<Pod>::namespaced(client, &ns),
                pod,
                "pod",
                &DeleteParams::default(),
            )
            .await
        }
        PlannedAction::ForceDeletePod {
            name: pod,
            group,
            role,
        } => {
            warn!(
                pod,
                group,
                role = role.as_str(),
                "pod still terminating past its grace period: deleting it with grace 0"
            );
            ctx.metrics.force_deleted_pods.inc();
            delete(
                &Api::<Pod>::namespaced(client, &ns),
                pod,
                "pod",
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..Default::default()
                },
            )
            .await
        }
        PlannedAction::SetGroupReadyGate { pod, ready } => {
            set_gate(
                &Api::<Pod>::namespaced(client, &ns),
                pod,
                *ready,
                (ctx.clock)(),
            )
            .await
        }
        PlannedAction::DeleteGroupResources { group } => {
            let g = *group;
            let dp = DeleteParams::default();
            let svc = names::group_service_name(&name, g);
            if !foreign.contains_key(&("service", svc.clone())) {
                delete(
                    &Api::<Service>::namespaced(client.clone(), &ns),
                    &svc,
                    "service",
                    &dp,
                )
                .await?;
            }
            let np = names::network_policy_name(&name, g);
            if !foreign.contains_key(&("networkpolicy", np.clone())) {
                delete(
                    &Api::<NetworkPolicy>::namespaced(client.clone(), &ns),
                    &np,
                    "network policy",
                    &dp,
                )
                .await?;
            }
            let secret = names::group_secret_name(&name, g);
            if !foreign.contains_key(&("secret", secret.clone())) {
                delete(
                    &Api::<Secret>::namespaced(client, &ns),
                    &secret,
                    "secret",
                    &dp,
                )
                .await?;
            }
            Ok(())
        }
        PlannedAction::Event(ev) => {
            publish(recorder, pdd, ev).await;
            Ok(())
        }
    }
}

/// Set the `tandem.dev/group-ready` condition of a decode pod.
///
/// A strategic merge patch of the `status` subresource: `PodStatus.conditions` has
/// patch strategy `merge` keyed by `type`, so the API server merges our one condition
/// into the kubelet's list instead of replacing it. This is how readiness-gate
/// controllers set their conditions; JSON merge patch would replace the whole list, and
/// the kubelet never touches conditions it does not own.
async fn set_gate(api: &Api<Pod>, pod: &str, ready: bool, now: Timestamp) -> Result<(), Error> {
    let (status, reason, message) = if ready {
        (
            "True",
            "GroupReady",
            "every member of the group is ready at one incarnation",
        )
    } else {
        ("False", "GroupNotReady", "the group is not ready")
    };
    let patch = json!({
        "status": {
            "conditions": [{
                "type": conditions::GROUP_READY,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": Time(now),
            }]
        }
    });
    match api
        .patch_status(
            pod,
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            },
            &Patch::Strategic(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 404) => Ok(()),
        Err(e) => Err(Error::kube(format!("setting the group gate of pod {pod}"))(
            e,
        )),
    }
}
