//! The planner's action sink: one trait that every executor implements, and the one
//! dispatch from a [`PlannedAction`] to it.
//!
//! Two executors carry out the planner's actions: the Kubernetes controller
//! (`controller::execute::KubeExecutor`: server-side apply, creates, deletes, gate patches,
//! Events) and the local runtime (`local::executor::LocalExecutor`: processes, a router, a
//! record). [`execute`] matches every action exhaustively and calls one method of
//! [`Executor`] for it, so a new action does not compile until it has a method here, and a
//! new method does not compile until both executors implement it. Neither executor
//! decides anything about a group: the order and the choice of actions are the planner's.
//!
//! | action | method |
//! | --- | --- |
//! | `ApplyClientService` | [`Executor::apply_client_service`] |
//! | `ApplyRouter` | [`Executor::apply_router`] |
//! | `DeleteRouter` | [`Executor::delete_router`] |
//! | `ApplyGroupService` | [`Executor::apply_group_service`] |
//! | `ApplyNetworkPolicy` | [`Executor::apply_network_policy`] |
//! | `CreateGroupSecret` | [`Executor::create_group_secret`] |
//! | `DeleteGroupResources` | [`Executor::delete_group_resources`] |
//! | `CreatePod` | [`Executor::create_member`] |
//! | `DeletePod` | [`Executor::delete_member`] |
//! | `ForceDeletePod` | [`Executor::force_delete_member`] |
//! | `ResetMember` | [`Executor::reset_member`] |
//! | `SetGroupReadyGate` | [`Executor::set_group_ready_gate`] |
//! | `Event` | [`Executor::publish_event`] |

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::planner::{DeleteReason, Grace, PlannedAction, PlannedEvent, PodIntent};
use crate::role::Role;

/// Carries out one kind of planned action per method. `now` is the plan's time. An error
/// leaves the world as it was as far as the executor can tell; the next plan asks again.
///
/// The methods are `async` because the Kubernetes executor waits for the API server; the
/// local executor never waits (its futures are ready at once). Both are used by their
/// concrete type, so no `Send` bound is named here: a caller that needs one (kube's
/// controller) gets it from the concrete executor's futures.
#[allow(async_fn_in_trait)]
pub trait Executor {
    type Error;

    /// The client Service `<name>` (decode pods of Ready groups).
    async fn apply_client_service(&mut self, now: Timestamp) -> Result<(), Self::Error>;
    /// The router's objects (`spec.router`): on a cluster a Deployment of
    /// `tandem-operator router`, its Service and its own RBAC.
    async fn apply_router(&mut self, now: Timestamp) -> Result<(), Self::Error>;
    /// Remove the router's objects (`spec.router` was removed).
    async fn delete_router(&mut self, now: Timestamp) -> Result<(), Self::Error>;
    /// A group's headless bootstrap Service.
    async fn apply_group_service(&mut self, group: i32, now: Timestamp) -> Result<(), Self::Error>;
    /// A group's NetworkPolicy (KV port only from its decodes).
    async fn apply_network_policy(&mut self, group: i32, now: Timestamp)
    -> Result<(), Self::Error>;
    /// A group's key Secret, created with a random key and never overwritten.
    async fn create_group_secret(&mut self, group: i32, now: Timestamp) -> Result<(), Self::Error>;
    /// The Service, NetworkPolicy and Secret of a group that was scaled away.
    async fn delete_group_resources(
        &mut self,
        group: i32,
        now: Timestamp,
    ) -> Result<(), Self::Error>;
    /// Start a member (a pod, or a process) as [`PodIntent`] describes it.
    async fn create_member(
        &mut self,
        intent: &PodIntent,
        now: Timestamp,
    ) -> Result<(), Self::Error>;
    /// Stop a member: SIGTERM, SIGKILL after `grace` (its own grace period, or the short
    /// one the planner chose for a hung or failed member).
    async fn delete_member(
        &mut self,
        delete: &MemberDelete<'_>,
        now: Timestamp,
    ) -> Result<(), Self::Error>;
    /// Remove a member whose deletion nobody confirmed in time (grace period 0).
    async fn force_delete_member(
        &mut self,
        pod: &str,
        group: i32,
        role: Role,
        now: Timestamp,
    ) -> Result<(), Self::Error>;
    /// Ask a live member to reset in place to a new incarnation (docs/in-place-reset.md).
    /// Once the member answers that it is ready there, the executor moves the member's
    /// observed incarnation on (a pod's `tandem.dev/incarnation` label and annotation; a
    /// local member's record). A member that cannot be asked or does not answer in time is
    /// no error: it stays at its incarnation, the planner asks again and in the end falls
    /// back to deleting it. The call is idempotent.
    async fn reset_member(
        &mut self,
        reset: &MemberReset<'_>,
        now: Timestamp,
    ) -> Result<(), Self::Error>;
    /// Open or close a decode's `tandem.dev/group-ready` gate (the client Service, or the
    /// local router, sends it traffic only while open).
    async fn set_group_ready_gate(
        &mut self,
        pod: &str,
        ready: bool,
        now: Timestamp,
    ) -> Result<(), Self::Error>;
    /// Publish an Event (best effort on a cluster; a record line locally).
    async fn publish_event(
        &mut self,
        event: &PlannedEvent,
        now: Timestamp,
    ) -> Result<(), Self::Error>;
}

/// A [`PlannedAction::DeletePod`], as the executors receive it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberDelete<'a> {
    pub pod: &'a str,
    pub group: i32,
    pub role: Role,
    pub incarnation: i64,
    pub reason: DeleteReason,
    pub grace: Grace,
}

/// A [`PlannedAction::ResetMember`], as the executors receive it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberReset<'a> {
    pub pod: &'a str,
    pub group: i32,
    pub role: Role,
    pub from_incarnation: i64,
    pub to_incarnation: i64,
    pub timeout: Duration,
}

/// Carry out one action with `executor`.
pub async fn execute<E: Executor>(
    executor: &mut E,
    action: &PlannedAction,
    now: Timestamp,
) -> Result<(), E::Error> {
    match action {
        PlannedAction::ApplyClientService => executor.apply_client_service(now).await,
        PlannedAction::ApplyRouter => executor.apply_router(now).await,
        PlannedAction::DeleteRouter => executor.delete_router(now).await,
        PlannedAction::ApplyGroupService { group } => {
            executor.apply_group_service(*group, now).await
        }
        PlannedAction::ApplyNetworkPolicy { group } => {
            executor.apply_network_policy(*group, now).await
        }
        PlannedAction::CreateGroupSecret { group } => {
            executor.create_group_secret(*group, now).await
        }
        PlannedAction::DeleteGroupResources { group } => {
            executor.delete_group_resources(*group, now).await
        }
        PlannedAction::CreatePod(intent) => executor.create_member(intent, now).await,
        PlannedAction::DeletePod {
            name,
            group,
            role,
            incarnation,
            reason,
            grace,
        } => {
            let delete = MemberDelete {
                pod: name,
                group: *group,
                role: *role,
                incarnation: *incarnation,
                reason: *reason,
                grace: *grace,
            };
            executor.delete_member(&delete, now).await
        }
        PlannedAction::ForceDeletePod { name, group, role } => {
            executor.force_delete_member(name, *group, *role, now).await
        }
        PlannedAction::ResetMember {
            name,
            group,
            role,
            from_incarnation,
            to_incarnation,
            timeout,
        } => {
            let reset = MemberReset {
                pod: name,
                group: *group,
                role: *role,
                from_incarnation: *from_incarnation,
                to_incarnation: *to_incarnation,
                timeout: *timeout,
            };
            executor.reset_member(&reset, now).await
        }
        PlannedAction::SetGroupReadyGate { pod, ready } => {
            executor.set_group_ready_gate(pod, *ready, now).await
        }
        PlannedAction::Event(ev) => executor.publish_event(ev, now).await,
    }
}

/// An action of a plan that could not be carried out, and why.
#[derive(Debug)]
pub struct Failed<'a, E> {
    pub action: &'a PlannedAction,
    pub error: E,
}

/// Carry out a plan's actions in its order, stopping at the first failure: later actions
/// may depend on earlier ones (decode pods are removed before prefill pods, the Secret is
/// made before the pods that read it).
pub async fn execute_all<'a, E: Executor>(
    executor: &mut E,
    actions: &'a [PlannedAction],
    now: Timestamp,
) -> Result<(), Failed<'a, E::Error>> {
    for action in actions {
        if let Err(error) = execute(executor, action, now).await {
            return Err(Failed { action, error });
        }
    }
    Ok(())
}
