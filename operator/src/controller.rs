//! The reconciler: observe what a `PDDeployment` owns, ask the planner what to do, do
//! it in the planner's order, and persist the planner's status. One module per job:
//! [`observe`] reads the cluster into the planner's view, [`execute`] carries out the
//! planner's actions, [`report`] writes the status, conditions and Events, [`run`] drives
//! the reconciles (watches, error backoff, shutdown); this file is the reconcile itself.
//!
//! Reads go straight to the API server on every reconcile (one GET of the deployment,
//! then label-selected lists of its pods, Services, NetworkPolicies and Secrets; the
//! last three as metadata only, so Secret data is never read). Cached reads would make a
//! reconcile triggered by a pod event see the status from before the previous reconcile's
//! write, and the planner would take an already-handled deletion for a new one. The
//! deployment is read before the pods, so the pods are never older than the status, which
//! is the direction the planner recovers from (it trusts pod labels over the status).
//!
//! Owned objects are watched (metadata only) by the [`Controller`] just to trigger
//! reconciles.
//!
//! One more read is not from the API server: a decode pod that runs, has started and is
//! not ready is asked why, with `GET http://<podIP>:<http port>/ready` (at most
//! [`READY_READS_AT_ONCE`] at a time, each bounded by [`crate::ready::TIMEOUT`]); the
//! planner puts the answer in the group status and the `BootstrapHealthy` condition. A
//! read that fails is a reason of its own (`probe_unreachable`, …), never a failed
//! reconcile.

mod execute;
mod observe;
mod report;
mod run;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Client, ResourceExt};
use tracing::{debug, instrument, warn};

use crate::crd::{PDDeployment, labels};
use crate::executor;
use crate::metrics::Metrics;
use crate::names;
use crate::planner::{self, PlanInput};
use crate::ready::{HttpFetcher, ReadyFetcher};
use crate::reasons::Problem;
use crate::reset_call::{HttpResetCaller, ResetCaller};
use crate::resources::{self, BuildError};

pub use observe::{Foreign, observe_pod, ready_target, restart_requested_at};
pub use run::{backoff, error_policy, run};

use execute::KubeExecutor;
use report::{report_once, write_status};

/// Field manager of every server-side apply.
pub const FIELD_MANAGER: &str = labels::MANAGER;
/// Reconcile at least this often even when nothing changes.
pub const DEFAULT_REQUEUE: Duration = Duration::from_secs(300);
pub(super) const ERROR_BACKOFF_BASE: Duration = Duration::from_secs(5);
pub(super) const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Kubernetes limits an event note to 1 kB.
pub(super) const MAX_NOTE: usize = 1024;
/// Most `/ready` reads of decode pods in flight at once during one reconcile.
pub const READY_READS_AT_ONCE: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error("PDDeployment has no namespace")]
    NoNamespace,
    /// An object with a name this deployment uses belongs to someone else.
    #[error(
        "{kind} {name} exists and is not owned by this PDDeployment ({owner}); it is not taken over"
    )]
    Conflict {
        kind: &'static str,
        name: String,
        owner: String,
    },
}

impl Error {
    pub(super) fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let action = action.into();
        move |source| Error::Kube { action, source }
    }

    /// Bounded label for `tandem_operator_reconcile_errors_total{reason}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube {
                source: kube::Error::Api(s),
                ..
            } => match s.code {
                403 => "forbidden",
                404 => "not_found",
                409 => "conflict",
                422 => "invalid",
                429 => "throttled",
                500..=599 => "server_error",
                _ => "api_error",
            },
            Error::Kube { .. } => "transport",
            Error::Build(_) => "build",
            Error::NoNamespace => "invalid_object",
            Error::Conflict { .. } => "object_conflict",
        }
    }

    /// What the user reads in the status and the Event: the action and the API server's
    /// own message, without the client library's wrapping.
    pub fn user_message(&self) -> String {
        match self {
            Error::Kube {
                action,
                source: kube::Error::Api(s),
            } => format!("{action}: {} ({} {})", s.message, s.code, s.reason),
            other => other.to_string(),
        }
    }

    /// The `Degraded` reason (and Event reason) this failure is reported under.
    pub(super) fn problem(&self) -> Problem {
        match self {
            Error::Conflict { .. } => Problem::ObjectConflict,
            _ => Problem::ApplyFailed,
        }
    }
}

/// Shared state of every reconcile.
pub struct Context {
    /// For requests (bounded by a read timeout).
    pub client: Client,
    /// For the controller's watches (a watch may be quiet for minutes).
    pub watch_client: Client,
    pub metrics: Arc<Metrics>,
    /// Who publishes events.
    pub reporter: Reporter,
    /// The planner's notion of now (fixed in tests).
    pub clock: Arc<dyn Fn() -> Timestamp + Send + Sync>,
    /// Reads a not-ready decode pod's `/ready` (HTTP; canned in tests).
    pub ready: Arc<dyn ReadyFetcher>,
    /// Makes in-place reset calls to pods (HTTP; canned in tests).
    pub resetter: Arc<dyn ResetCaller>,
    /// The image of `spec.router`'s pods (`TANDEM_ROUTER_IMAGE`; the chart sets the
    /// operator's own image, which serves `tandem-operator router`).
    pub router_image: Option<String>,
    /// Consecutive failed reconciles per `namespace/name`, for the error backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(client: Client, metrics: Arc<Metrics>, reporter: Reporter) -> Self {
        Self {
            watch_client: client.clone(),
            client,
            metrics,
            reporter,
            clock: Arc::new(Timestamp::now),
            ready: Arc::new(HttpFetcher::default()),
            resetter: Arc::new(HttpResetCaller),
            router_image: None,
            failures: Mutex::default(),
        }
    }

    /// Run `spec.router`'s pods from `image`.
    pub fn with_router_image(mut self, image: Option<String>) -> Self {
        self.router_image = image;
        self
    }

    /// Read `/ready` bodies with `fetcher` (tests).
    pub fn with_ready_fetcher(mut self, fetcher: impl ReadyFetcher + 'static) -> Self {
        self.ready = Arc::new(fetcher);
        self
    }

    /// Make in-place reset calls with `caller` (tests).
    pub fn with_reset_caller(mut self, caller: impl ResetCaller + 'static) -> Self {
        self.resetter = Arc::new(caller);
        self
    }

    /// Use `client` for the watches (and the context's client for everything else).
    pub fn with_watch_client(mut self, client: Client) -> Self {
        self.watch_client = client;
        self
    }

    /// Same, with a fixed clock (tests).
    pub fn with_clock(mut self, clock: impl Fn() -> Timestamp + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    pub(super) fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.failures.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(super) fn key(pdd: &PDDeployment) -> String {
    format!("{}/{}", pdd.namespace().unwrap_or_default(), pdd.name_any())
}

pub(super) fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Reconcile one `PDDeployment`.
#[instrument(skip_all, fields(deployment = %trigger.name_any(), namespace = trigger.namespace().unwrap_or_default()))]
pub async fn reconcile(trigger: Arc<PDDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started();
    let ns = trigger.namespace().ok_or(Error::NoNamespace)?;
    let name = trigger.name_any();
    let api: Api<PDDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(pdd) = api
        .get_opt(&name)
        .await
        .map_err(Error::kube("reading the PDDeployment"))?
    else {
        return Ok(Action::await_change());
    };
    if pdd.metadata.deletion_timestamp.is_some() {
        // Owner references let the garbage collector remove the children.
        return Ok(Action::await_change());
    }
    let now = (ctx.clock)();
    let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
    let invalid = names::validate_deployment_name(&name)
        .map_err(|why| (Problem::InvalidName, why))
        .and_then(|()| {
            resources::check_role_args(&pdd.spec).map_err(|why| (Problem::InvalidArgs, why))
        });
    if let Err((problem, why)) = invalid {
        // Children could never be created (the API server refuses their names) or would
        // exit at once (the dataplane refuses their command line): say so once, and
        // wait for the user instead of retrying forever.
        warn!("{why}");
        let mut status = pdd.status.clone().unwrap_or_default();
        status.observed_generation = pdd.metadata.generation;
        report_once(&recorder, &pdd, &mut status, problem, &why, now).await;
        write_status(&api, &name, &status).await?;
        return Ok(Action::await_change());
    }
    let (observed, foreign, pod_addrs) = observe::observe(&ctx, &pdd, &ns, &name).await?;
    let (restart_requested_at, bad_annotation) = match restart_requested_at(&pdd) {
        Ok(t) => (t, None),
        Err(why) => (None, Some(why)),
    };
    let plan = planner::plan(&PlanInput {
        name: &name,
        generation: pdd.metadata.generation,
        spec: &pdd.spec,
        status: pdd.status.as_ref(),
        restart_requested_at,
        observed: &observed,
        now,
    });
    debug!(actions = plan.actions.len(), "planned");

    // A fresh recorder per reconcile: kube's recorder folds events with the same
    // (type, reason, action, related) into a series for 6 minutes and keeps the first
    // note, which would hide a group's later phase changes.
    let mut kube = KubeExecutor {
        ctx: &ctx,
        pdd: &pdd,
        foreign: &foreign,
        pod_addrs: &pod_addrs,
        recorder: &recorder,
        namespace: ns.clone(),
        name: name.clone(),
    };
    let result = executor::execute_all(&mut kube, &plan.actions, now)
        .await
        .map_err(|failed| failed.error);
    let mut status = plan.status.clone();
    if let Some(why) = &bad_annotation {
        warn!("{why}");
        report_once(
            &recorder,
            &pdd,
            &mut status,
            Problem::InvalidRestartRequest,
            why,
            now,
        )
        .await;
    }
    if let Err(e) = &result {
        // The API server's answer goes where the user looks: the Degraded condition and a
        // Warning Event (once per distinct message).
        let problem = e.problem();
        let message = e.user_message();
        warn!(reason = problem.as_str(), "{message}");
        report_once(&recorder, &pdd, &mut status, problem, &message, now).await;
    }
    // The status is written even after a failed action: it carries the planner's memory
    // (a co-restart's new incarnation), which must not be decided twice.
    write_status(&api, &name, &status).await?;
    ctx.metrics.plan_applied(&plan);
    result?;
    ctx.failures().remove(&key(&pdd));
    Ok(Action::requeue(
        plan.requeue_after.unwrap_or(DEFAULT_REQUEUE),
    ))
}

#[cfg(test)]
mod grace_tests;
#[cfg(test)]
mod mock_api;
#[cfg(test)]
mod observe_tests;
#[cfg(test)]
mod reset_tests;
#[cfg(test)]
mod router_tests;
#[cfg(test)]
mod tests;
