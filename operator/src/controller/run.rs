//! Driving the reconciles: the watches that trigger them, the per-object error backoff,
//! and a graceful stop.

use std::sync::Arc;
use std::time::Duration;

use futures::{Future, StreamExt};
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ListParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use tracing::{debug, info, warn};

use super::{Context, ERROR_BACKOFF_BASE, ERROR_BACKOFF_MAX, Error, key, reconcile};
use crate::crd::{PDDeployment, labels};

/// Log, count and requeue with a per-object exponential backoff.
pub fn error_policy(pdd: Arc<PDDeployment>, error: &Error, ctx: Arc<Context>) -> Action {
    let reason = error.metric_label();
    ctx.metrics.reconcile_failed(reason);
    let n = {
        let mut failures = ctx.failures();
        let n = failures.entry(key(&pdd)).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay = backoff(n);
    warn!(
        deployment = %pdd.name_any(),
        namespace = pdd.namespace().unwrap_or_default(),
        reason,
        attempt = n,
        retry_in_s = delay.as_secs(),
        "reconcile failed: {error}"
    );
    Action::requeue(delay)
}

/// Retry delay after `n` consecutive failures: 5 s × 2^(n-1), at most 5 min.
pub fn backoff(n: u32) -> Duration {
    let shift = n.saturating_sub(1).min(16);
    ERROR_BACKOFF_BASE
        .saturating_mul(1 << shift)
        .min(ERROR_BACKOFF_MAX)
}

/// Run the controller until `shutdown` resolves (then finish running reconciles).
/// `namespace: None` watches every namespace.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), Error> {
    let client = ctx.watch_client.clone();
    fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let pdds: Api<PDDeployment> = api(&client, namespace);
    // Fail fast with a clear message when the CRD is missing or RBAC forbids listing.
    pdds.list(&ListParams::default().limit(1))
        .await
        .map_err(Error::kube("listing PDDeployments (is the CRD installed?)"))?;
    let owned =
        watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, labels::MANAGER));
    Controller::new(pdds, watcher::Config::default().any_semantic())
        .owns(api::<Pod>(&client, namespace), owned.clone())
        .owns(api::<Service>(&client, namespace), owned.clone())
        .owns(api::<NetworkPolicy>(&client, namespace), owned.clone())
        .owns(api::<Secret>(&client, namespace), owned)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(object = %obj, "reconciled"),
                Err(kube::runtime::controller::Error::ReconcilerFailed(..)) => {
                    // Already logged and counted by error_policy.
                }
                Err(e) => warn!("controller: {e}"),
            }
        })
        .await;
    info!("controller stopped");
    Ok(())
}
