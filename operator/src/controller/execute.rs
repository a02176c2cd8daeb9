//! Carrying out the planner's actions on the API server: server-side apply of Services
//! and NetworkPolicies, create-only Secrets and pods, deletes, and the readiness-gate patch.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role as RbacRole, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::Recorder;
use serde_json::json;
use tracing::{info, warn};

use super::observe::{Foreign, PodAddrs};
use super::report::publish;
use super::{Context, Error, FIELD_MANAGER, is_status};
use crate::crd::labels;
use crate::crd::{PDDeployment, conditions};
use crate::executor::{Executor, MemberDelete, MemberReset};
use crate::names;
use crate::planner::{Grace, PlannedEvent, PodIntent};
use crate::reasons::ConditionReason;
use crate::reset_call::ResetReply;
use crate::resources;
use crate::role::Role;

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

/// The Kubernetes executor of one reconcile: carries out the planner's actions on the API
/// server for one deployment. Objects of [`Foreign`] are never written.
pub(super) struct KubeExecutor<'a> {
    pub(super) ctx: &'a Context,
    pub(super) pdd: &'a PDDeployment,
    pub(super) foreign: &'a Foreign,
    pub(super) pod_addrs: &'a PodAddrs,
    pub(super) recorder: &'a Recorder,
    pub(super) namespace: String,
    pub(super) name: String,
}

impl KubeExecutor<'_> {
    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.ctx.client.clone(), &self.namespace)
    }
}

impl KubeExecutor<'_> {
    /// The group key from the group's Secret: read only to sign an in-place reset.
    async fn group_key(&self, group: i32) -> Result<String, String> {
        let name = names::group_secret_name(&self.name, group);
        let secret = self
            .api::<Secret>()
            .get(&name)
            .await
            .map_err(|e| format!("reading secret {name}: {e}"))?;
        let key = secret
            .data
            .as_ref()
            .and_then(|d| d.get(resources::SECRET_KEY))
            .ok_or_else(|| format!("secret {name} has no {:?}", resources::SECRET_KEY))?;
        String::from_utf8(key.0.clone()).map_err(|_| format!("secret {name}: the key is not text"))
    }
}

impl Executor for KubeExecutor<'_> {
    type Error = Error;

    async fn apply_client_service(&mut self, _now: Timestamp) -> Result<(), Error> {
        check_not_foreign(self.foreign, "service", &self.name)?;
        let svc = resources::client_service(self.pdd)?;
        server_side_apply(&self.api::<Service>(), &svc, "service").await
    }

    /// Its RBAC first (the pods read the API server from their start), then the
    /// Deployment and the Service. Every object is `<name>-router`; only the Service is
    /// observed (a foreign one stops all five).
    async fn apply_router(&mut self, _now: Timestamp) -> Result<(), Error> {
        let name = names::router_name(&self.name);
        check_not_foreign(self.foreign, "service", &name)?;
        let image = self
            .ctx
            .router_image
            .as_deref()
            .ok_or(resources::BuildError::NoRouterImage)?;
        let sa = resources::router_service_account(self.pdd)?;
        server_side_apply(&self.api::<ServiceAccount>(), &sa, "service account").await?;
        let role = resources::router_role(self.pdd)?;
        server_side_apply(&self.api::<RbacRole>(), &role, "role").await?;
        let binding = resources::router_role_binding(self.pdd)?;
        server_side_apply(&self.api::<RoleBinding>(), &binding, "role binding").await?;
        let deployment = resources::router_deployment(self.pdd, image)?;
        server_side_apply(&self.api::<Deployment>(), &deployment, "deployment").await?;
        let svc = resources::router_service(self.pdd)?;
        server_side_apply(&self.api::<Service>(), &svc, "service").await
    }

    /// The Service last: it is what the next reconcile observes, so a delete that stopped
    /// half-way is asked again.
    async fn delete_router(&mut self, _now: Timestamp) -> Result<(), Error> {
        let name = names::router_name(&self.name);
        if self.foreign.contains_key(&("service", name.clone())) {
            return Ok(());
        }
        info!(deployment = %self.name, "spec.router removed: deleting the router");
        let dp = DeleteParams::default();
        delete(&self.api::<Deployment>(), &name, "deployment", &dp).await?;
        delete(&self.api::<RoleBinding>(), &name, "role binding", &dp).await?;
        delete(&self.api::<RbacRole>(), &name, "role", &dp).await?;
        delete(&self.api::<ServiceAccount>(), &name, "service account", &dp).await?;
        delete(&self.api::<Service>(), &name, "service", &dp).await
    }

    async fn apply_group_service(&mut self, group: i32, _now: Timestamp) -> Result<(), Error> {
        let svc_name = names::group_service_name(&self.name, group);
        check_not_foreign(self.foreign, "service", &svc_name)?;
        let svc = resources::group_service(self.pdd, group)?;
        server_side_apply(&self.api::<Service>(), &svc, "service").await
    }

    async fn apply_network_policy(&mut self, group: i32, _now: Timestamp) -> Result<(), Error> {
        let np_name = names::network_policy_name(&self.name, group);
        check_not_foreign(self.foreign, "networkpolicy", &np_name)?;
        let np = resources::network_policy(self.pdd, group)?;
        server_side_apply(&self.api::<NetworkPolicy>(), &np, "network policy").await
    }

    async fn create_group_secret(&mut self, group: i32, _now: Timestamp) -> Result<(), Error> {
        let secret_name = names::group_secret_name(&self.name, group);
        check_not_foreign(self.foreign, "secret", &secret_name)?;
        let secret = resources::group_secret(self.pdd, group, &resources::random_group_key())?;
        // Never overwrite an existing key: pods may be using it.
        create_if_missing(&self.api::<Secret>(), &secret, "secret").await
    }

    async fn delete_group_resources(&mut self, group: i32, _now: Timestamp) -> Result<(), Error> {
        let dp = DeleteParams::default();
        let svc = names::group_service_name(&self.name, group);
        if !self.foreign.contains_key(&("service", svc.clone())) {
            delete(&self.api::<Service>(), &svc, "service", &dp).await?;
        }
        let np = names::network_policy_name(&self.name, group);
        if !self.foreign.contains_key(&("networkpolicy", np.clone())) {
            delete(&self.api::<NetworkPolicy>(), &np, "network policy", &dp).await?;
        }
        let secret = names::group_secret_name(&self.name, group);
        if !self.foreign.contains_key(&("secret", secret.clone())) {
            delete(&self.api::<Secret>(), &secret, "secret", &dp).await?;
        }
        Ok(())
    }

    async fn create_member(&mut self, intent: &PodIntent, _now: Timestamp) -> Result<(), Error> {
        check_not_foreign(self.foreign, "pod", &intent.name)?;
        info!(pod = %intent.name, group = intent.group, role = intent.role.as_str(), incarnation = intent.incarnation, "creating pod");
        // Created, never applied: a pod of another owner with this name (a deployment of
        // the same name being deleted) must not be taken over.
        let pod = resources::pod(self.pdd, intent)?;
        create_if_missing(&self.api::<Pod>(), &pod, "pod").await
    }

    /// The full grace is the pod's own (`terminationGracePeriodSeconds`): the delete names
    /// none. The short one is the delete's `gracePeriodSeconds`; the API server then sets
    /// `deletionTimestamp` that much ahead, which is what the planner's force-delete
    /// follows.
    async fn delete_member(&mut self, d: &MemberDelete<'_>, _now: Timestamp) -> Result<(), Error> {
        let (pod, group, role, incarnation) = (d.pod, d.group, d.role.as_str(), d.incarnation);
        let reason = d.reason.as_str();
        let dp = match d.grace {
            Grace::Full => {
                info!(pod, group, role, incarnation, reason, "deleting pod");
                DeleteParams::default()
            }
            Grace::Unresponsive { seconds, cause } => {
                warn!(
                    pod,
                    group,
                    role,
                    incarnation,
                    reason,
                    cause = cause.as_str(),
                    grace_seconds = seconds,
                    "deleting an unresponsive pod with a short grace period: {}",
                    cause.describe()
                );
                DeleteParams {
                    grace_period_seconds: Some(u32::try_from(seconds.max(1)).unwrap_or(1)),
                    ..Default::default()
                }
            }
        };
        delete(&self.api::<Pod>(), pod, "pod", &dp).await
    }

    async fn force_delete_member(
        &mut self,
        pod: &str,
        group: i32,
        role: Role,
        _now: Timestamp,
    ) -> Result<(), Error> {
        warn!(
            pod,
            group,
            role = role.as_str(),
            "pod still terminating past its grace period: deleting it with grace 0"
        );
        self.ctx.metrics.force_deleted_pods.inc();
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        delete(&self.api::<Pod>(), pod, "pod", &dp).await
    }

    /// The call to the pod's IP (the reconcile waits for its answer, bounded by the
    /// planner's timeout), then, once the member is ready at the new incarnation, its
    /// `tandem.dev/incarnation` label and annotation moved on. A member that could not be
    /// asked or did not answer is logged and counted, not an error: the next plan asks
    /// again until the planner falls back to deleting it.
    async fn reset_member(&mut self, r: &MemberReset<'_>, now: Timestamp) -> Result<(), Error> {
        let (pod, group, role) = (r.pod, r.group, r.role.as_str());
        let (from, to) = (r.from_incarnation, r.to_incarnation);
        let Some(&addr) = self.pod_addrs.get(pod) else {
            warn!(
                pod,
                group, role, from, to, "cannot reset in place: the pod has no IP and http port"
            );
            self.ctx.metrics.reset_call("no_address");
            return Ok(());
        };
        let key = match self.group_key(group).await {
            Ok(k) => k,
            Err(why) => {
                warn!(pod, group, role, from, to, "cannot reset in place: {why}");
                self.ctx.metrics.reset_call("no_key");
                return Ok(());
            }
        };
        info!(pod, group, role, from, to, %addr, "asking the pod to reset in place");
        let reply = self
            .ctx
            .resetter
            .call(addr, r.role, to, key, r.timeout)
            .await;
        self.ctx.metrics.reset_call(reply.outcome());
        match reply {
            ResetReply::Ready {
                reset,
                incarnation,
                took_ms,
            } => {
                info!(pod, group, role, from, to, reset, took_ms, process_incarnation = %incarnation, "pod serves the new incarnation (weights kept)");
                let patch = json!({
                    "metadata": {
                        "labels": { labels::INCARNATION: to.to_string() },
                        "annotations": {
                            labels::INCARNATION: to.to_string(),
                            labels::RESET_AT: now.to_string(),
                        },
                    }
                });
                match self
                    .api::<Pod>()
                    .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(e) if is_status(&e, 404) => Ok(()),
                    Err(e) => Err(Error::kube(format!(
                        "moving the incarnation of pod {pod} to {to}"
                    ))(e)),
                }
            }
            ResetReply::Refused {
                status,
                reason,
                message,
            } => {
                warn!(
                    pod,
                    group, role, from, to, status, reason, "pod did not reset in place: {message}"
                );
                Ok(())
            }
            ResetReply::Failed(why) => {
                warn!(
                    pod,
                    group, role, from, to, "pod did not answer the reset call: {why}"
                );
                Ok(())
            }
        }
    }

    async fn set_group_ready_gate(
        &mut self,
        pod: &str,
        ready: bool,
        now: Timestamp,
    ) -> Result<(), Error> {
        set_gate(&self.api::<Pod>(), pod, ready, now).await
    }

    async fn publish_event(&mut self, event: &PlannedEvent, _now: Timestamp) -> Result<(), Error> {
        // Best effort: a failure is logged and never fails the reconcile.
        publish(self.recorder, self.pdd, event).await;
        Ok(())
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
            ConditionReason::GroupReady,
            "every member of the group is ready at one incarnation",
        )
    } else {
        (
            "False",
            ConditionReason::GroupNotReady,
            "the group is not ready",
        )
    };
    let patch = json!({
        "status": {
            "conditions": [{
                "type": conditions::GROUP_READY,
                "status": status,
                "reason": reason.as_str(),
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
