//! The cluster router (`tandem-operator router`): the host of `tandem-router` that the
//! operator runs as a Deployment for a PDDeployment with `spec.router` (docs/routing.md,
//! "On a cluster"). The same policy, proxy, retry and metrics as the local runtime's
//! endpoint; only the list of decodes comes from elsewhere: the PDDeployment's status
//! (each group's phase and current incarnation) and its decode pods (pod IP, HTTP port,
//! incarnation label, the `tandem.dev/group-ready` gate), watched through the API server.
//!
//! Served besides `/v1/*`, never behind the API keys: `/health` (the process answers),
//! `/ready` (the router has read its deployment and answers for it) and `/metrics`
//! (`tandem_router_*`).
//!
//! Why `/ready` does not wait for a Ready group: the router's readiness gates its own
//! Service. A router taken out of its Service while the deployment's groups co-restart
//! leaves its clients with a Service without endpoints: kube-proxy refuses with ICMP, which
//! the node's kernel rate-limits per destination host (one a second), so a busy client's
//! SYNs go unanswered and are retried with TCP's backoff (seconds apart), and a request
//! sent then is answered late or not at all. A ready router answers each such
//! request at once: 503 `no_ready_group`, the reason and `Retry-After`. Whether a group can
//! take traffic is in the `/ready` body (`groupsReady`).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::{FutureExt, StreamExt};
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use prometheus_client::registry::Registry;
use tandem_router::proxy::{error, full};
use tandem_router::{Body, RouterConfig, Target, Targets};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::crd::{GroupPhase, PDDeployment, PDDeploymentStatus, conditions, labels};
use crate::resources::{CONTAINER, HTTP_PORT_NAME};
use crate::role::Role;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the watch of {what} ended")]
    WatchEnded { what: &'static str },
}

/// The decodes the router may use: every decode pod of `deployment` with a pod IP, not
/// terminating, whose `tandem.dev/group-ready` gate is open, with its group's phase and
/// current incarnation from `status` (only those of groups Ready at it are chosen).
/// `http_port` is the spec's, for a pod that does not name its `http` port.
pub fn targets_from(
    status: Option<&PDDeploymentStatus>,
    pods: &[Arc<Pod>],
    deployment: &str,
    http_port: i32,
) -> Targets {
    let groups = status
        .map(|s| s.group_statuses.as_slice())
        .unwrap_or_default();
    let mut targets: Vec<Target> = pods
        .iter()
        .filter_map(|p| decode_target(p, deployment, http_port))
        .map(|(pod, group, incarnation, addr)| {
            let g = groups.iter().find(|g| g.index == group);
            Target {
                pod,
                group,
                incarnation,
                addr,
                group_ready: g.is_some_and(|g| g.phase == GroupPhase::Ready),
                group_incarnation: g.map_or(-1, |g| g.incarnation),
            }
        })
        .collect();
    targets.sort_by(|a, b| (a.group, &a.pod).cmp(&(b.group, &b.pod)));
    let unavailable = if status.is_none() {
        format!("no group is ready: PDDeployment {deployment} has no status yet")
    } else if targets.is_empty() {
        let why: Vec<String> = groups
            .iter()
            .map(|g| {
                format!(
                    "group {} is {:?} at incarnation {}",
                    g.index, g.phase, g.incarnation
                )
            })
            .collect();
        format!(
            "no group is ready: no decode pod has its group gate open ({})",
            why.join("; ")
        )
    } else {
        crate::local::router::no_ready_group(&targets, groups)
    };
    Targets {
        targets,
        unavailable,
    }
}

/// (pod, group, incarnation, address) of a serving decode pod of `deployment`.
fn decode_target(
    pod: &Pod,
    deployment: &str,
    http_port: i32,
) -> Option<(String, i32, i64, SocketAddr)> {
    let l = pod.labels();
    if l.get(labels::DEPLOYMENT).map(String::as_str) != Some(deployment)
        || l.get(labels::ROLE).map(String::as_str) != Some(Role::Decode.as_str())
        || pod.metadata.deletion_timestamp.is_some()
    {
        return None;
    }
    let group = l.get(labels::GROUP)?.parse::<i32>().ok()?;
    let incarnation = l.get(labels::INCARNATION)?.parse::<i64>().ok()?;
    let status = pod.status.as_ref()?;
    let gate_open = status
        .conditions
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == conditions::GROUP_READY && c.status == "True");
    if !gate_open {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let port = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == CONTAINER))
        .and_then(|c| c.ports.as_ref())
        .and_then(|ps| {
            ps.iter()
                .find(|p| p.name.as_deref() == Some(HTTP_PORT_NAME))
        })
        .map_or(http_port, |p| p.container_port);
    let port = u16::try_from(port).ok()?;
    Some((
        pod.name_any(),
        group,
        incarnation,
        SocketAddr::new(ip, port),
    ))
}

/// Where the router's keys come from: every file of `dir` (a mounted Secret: one file per
/// key of the Secret, each holding one key or several, one a line). Names starting with
/// `.` are the volume's own bookkeeping.
pub fn api_keys_from_dir(
    dir: &std::path::Path,
) -> Result<tandem_contract::api_keys::ApiKeys, String> {
    let mut text = String::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut names: Vec<_> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.'))
                && p.is_file()
        })
        .collect();
    names.sort();
    for p in &names {
        let t = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        text.push_str(&t);
        text.push('\n');
    }
    let name = dir.display().to_string();
    tandem_contract::api_keys::ApiKeys::from_parts(None, Some((&name, &text)))
        .map_err(|e| e.to_string())
}

/// The router of one PDDeployment.
pub struct ClusterRouter {
    registry: Registry,
    targets: watch::Sender<Arc<Targets>>,
    inner: tandem_router::Router,
    /// The first full lists of the PDDeployment and its decode pods have been read: the
    /// targets published are the API server's, not the placeholder of a router starting.
    synced: AtomicBool,
}

impl ClusterRouter {
    pub fn new(cfg: RouterConfig) -> Self {
        let (targets, rx) = watch::channel(Arc::new(Targets {
            targets: vec![],
            unavailable: "no group is ready: the router has not read the PDDeployment yet".into(),
        }));
        let mut registry = Registry::with_prefix("tandem_router");
        let inner = tandem_router::Router::new(cfg, rx, &mut registry);
        Self {
            registry,
            targets,
            inner,
            synced: AtomicBool::new(false),
        }
    }

    /// Publish a new list of decodes.
    pub fn set_targets(&self, t: Targets) {
        self.targets.send_replace(Arc::new(t));
    }

    /// The targets published from now on come from complete lists of the deployment and
    /// its pods: `/ready` answers 200 (once; it stays so while the process lives, since a
    /// watch that fails is retried and the last view is the best there is).
    pub fn mark_synced(&self) {
        if !self.synced.swap(true, Ordering::SeqCst) {
            info!("read the deployment and its decode pods: ready");
        }
    }
}

/// Follow `deployment`'s status and decode pods in `namespace`, poll the decodes and serve
/// `listener`, until a watch ends (never, short of the API server going away for good:
/// watch errors are retried with backoff).
pub async fn run(
    client: Client,
    namespace: &str,
    deployment: &str,
    listener: TcpListener,
    router: Arc<ClusterRouter>,
) -> Result<(), Error> {
    let pods_api = Api::<Pod>::namespaced(client.clone(), namespace);
    let pdd_api = Api::<PDDeployment>::namespaced(client, namespace);
    let selector = format!(
        "{}={deployment},{}={}",
        labels::DEPLOYMENT,
        labels::ROLE,
        Role::Decode.as_str()
    );
    let (pod_store, pod_writer) = reflector::store::<Pod>();
    let (pdd_store, pdd_writer) = reflector::store::<PDDeployment>();
    let pods = reflector(
        pod_writer,
        watcher(pods_api, watcher::Config::default().labels(&selector)),
    )
    .default_backoff()
    .map(|e| e.map(|_| ()).map_err(|e| ("pods", e)));
    let pdds = reflector(
        pdd_writer,
        watcher(
            pdd_api,
            watcher::Config::default().fields(&format!("metadata.name={deployment}")),
        ),
    )
    .default_backoff()
    .map(|e| e.map(|_| ()).map_err(|e| ("pddeployment", e)));
    let follow = {
        let router = router.clone();
        async move {
            let mut events = std::pin::pin!(futures::stream::select(pods, pdds));
            let mut last_eligible = usize::MAX;
            while let Some(ev) = events.next().await {
                if let Err((what, e)) = ev {
                    warn!(what, deployment, "watch failed (retried): {e}");
                    continue;
                }
                let pdd = pdd_store.state().into_iter().next();
                let http_port = pdd.as_ref().map_or(8000, |p| p.spec.transfer.http_port);
                let status = pdd.as_ref().and_then(|p| p.status.as_ref());
                let t = targets_from(status, &pod_store.state(), deployment, http_port);
                let eligible = t.eligible();
                if eligible != last_eligible {
                    info!(
                        deployment,
                        eligible,
                        decodes = t.targets.len(),
                        "decodes to route to"
                    );
                    last_eligible = eligible;
                }
                router.set_targets(t);
                // Both stores have their first full list once their `InitDone` passed.
                let listed = |ready: Option<Result<(), _>>| ready.is_some_and(|r| r.is_ok());
                if !router.synced.load(Ordering::SeqCst)
                    && listed(pod_store.wait_until_ready().now_or_never())
                    && listed(pdd_store.wait_until_ready().now_or_never())
                {
                    router.mark_synced();
                }
            }
        }
    };
    let poll = router.inner.poller().run();
    tokio::select! {
        _ = follow => Err(Error::WatchEnded { what: "pods or the PDDeployment" }),
        _ = poll => Ok(()),
        _ = accept(listener, router.clone()) => Ok(()),
    }
}

async fn accept(listener: TcpListener, router: Arc<ClusterRouter>) {
    crate::local::router::accept_connections(listener, move |req| {
        let router = router.clone();
        async move { router.handle(req).await }
    })
    .await
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

impl ClusterRouter {
    pub async fn handle<B>(&self, req: Request<B>) -> Response<Body>
    where
        B: hyper::body::Body<Data = bytes::Bytes>,
        B::Error: Into<tandem_router::BoxError>,
    {
        let path = req.uri().path().to_string();
        if path.starts_with("/v1/") {
            return self.inner.forward(req).await;
        }
        match (req.method(), path.as_str()) {
            (&Method::GET, "/health") => text(
                StatusCode::OK,
                "application/json",
                r#"{"status":"ok"}"#.into(),
            ),
            (&Method::GET, "/ready") => {
                let t = self.inner.targets();
                if !self.synced.load(Ordering::SeqCst) {
                    return error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not_synced",
                        "the router has not yet read its PDDeployment and decode pods from the API server",
                    );
                }
                let endpoints: Vec<serde_json::Value> = t
                    .targets
                    .iter()
                    .filter(|t| t.eligible())
                    .map(|t| serde_json::json!({"pod": t.pod, "group": t.group, "incarnation": t.incarnation, "addr": t.addr}))
                    .collect();
                let mut body = serde_json::json!({
                    "ready": true,
                    "groupsReady": !endpoints.is_empty(),
                    "endpoints": endpoints,
                });
                if body["endpoints"].as_array().is_some_and(Vec::is_empty) {
                    body["unavailable"] = t.unavailable.clone().into();
                }
                text(StatusCode::OK, "application/json", body.to_string())
            }
            (&Method::GET, "/metrics") => {
                let mut s = String::new();
                match prometheus_client::encoding::text::encode(&mut s, &self.registry) {
                    Ok(()) => text(
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        s,
                    ),
                    Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "metrics", &e.to_string()),
                }
            }
            _ => error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!(
                    "no route for {} {path}: the OpenAI API is under /v1/, the router's own endpoints are /health, /ready and /metrics",
                    req.method()
                ),
            ),
        }
    }
}

#[cfg(test)]
mod tests;
