//! The local runtime's OpenAI endpoint: the host of `tandem-router` (the same policy and
//! proxy a cluster router runs; docs/routing.md). It forwards `/v1/*` to the decodes of
//! groups Ready at their current incarnation, by prefix affinity balanced by load (or
//! round robin), with one retry on another group when a decode fails before the first
//! byte of its answer.
//!
//! - The decodes it may use come from the runtime's snapshot ([`targets_of`]: the serving
//!   decodes, and each group's phase and incarnation from the planner's status).
//! - Answers pass through frame by frame once their first frame is there (SSE streams
//!   stay streams); a client that goes away closes the connection to the decode, which
//!   aborts the request on both roles.
//! - No eligible group: 503 at once with a JSON body saying why, never a wait.
//! - Also served, never behind the API keys: `/health` (the runtime's event loop
//!   answers), `/ready` (some group can take traffic), `/metrics` (the operator's metrics,
//!   then the router's `tandem_router_*`). Behind them when keys are set, like `/v1/*`:
//!   `/status` (the whole [`Snapshot`] as JSON) and `/status.txt` (the terminal display's
//!   text), which name the members and their logs.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use serde_json::json;
use tandem_router::proxy::{error, full};
use tandem_router::{Body, RouterConfig, Secret, Target, Targets};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::snapshot::Snapshot;
use crate::crd::GroupPhase;
use crate::metrics::Metrics;

/// Longest a client may take to send a request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// How the endpoint picks a group (`--routing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Routing {
    /// The group holding the longest cached prefix of the prompt, balanced by load.
    PrefixLoad,
    /// Ready groups in turn (the baseline).
    RoundRobin,
}

/// The router's configuration from the runtime's flags. Keys come from `--api-key` (or
/// `TANDEM_API_KEY`) and `--api-key-file` (or `TANDEM_API_KEY_FILE`); the router presents
/// the first to the decodes, which require it too when they were given keys (members
/// inherit the runtime's environment, so keys given through the variables protect their
/// loopback ports as well).
pub fn config(
    routing: Routing,
    retries: u8,
    stall_limit: Duration,
    api_key: Option<&str>,
    api_key_file: Option<&std::path::Path>,
) -> super::Result<RouterConfig> {
    let api_keys = tandem_contract::api_keys::ApiKeys::load(api_key, api_key_file)
        .map_err(|e| super::Error::ApiKeys(e.to_string()))?;
    let upstream_key = match (api_key, api_key_file) {
        (Some(k), _) => Some(Secret(k.trim().to_string())),
        (None, Some(f)) => std::fs::read_to_string(f).ok().and_then(|t| {
            t.lines()
                .map(str::trim)
                .find(|l| !l.is_empty() && !l.starts_with('#'))
                .map(|k| Secret(k.to_string()))
        }),
        (None, None) => None,
    };
    let mut cfg = RouterConfig {
        retries: retries.min(1),
        stall_limit,
        api_keys,
        upstream_key,
        ..RouterConfig::default()
    };
    if routing == Routing::RoundRobin {
        cfg.policy.mode = tandem_router::policy::Mode::RoundRobin;
    }
    Ok(cfg)
}

pub struct Router {
    snapshot: watch::Receiver<Arc<Snapshot>>,
    metrics: Arc<Metrics>,
    /// The router's own metrics (`tandem_router_*`).
    registry: Registry,
    targets: watch::Sender<Arc<Targets>>,
    inner: tandem_router::Router,
}

impl Router {
    pub fn new(
        snapshot: watch::Receiver<Arc<Snapshot>>,
        metrics: Arc<Metrics>,
        cfg: RouterConfig,
    ) -> Self {
        let first = targets_of(&snapshot.borrow());
        let (targets, rx) = watch::channel(Arc::new(first));
        let mut registry = Registry::with_prefix("tandem_router");
        let inner = tandem_router::Router::new(cfg, rx, &mut registry);
        Self {
            snapshot,
            metrics,
            registry,
            targets,
            inner,
        }
    }
}

/// Why none of `targets` (decodes that serve) may be chosen: no group of theirs is Ready at
/// its current incarnation. Shared by both hosts (`crate::cluster_router` too).
pub(crate) fn no_ready_group(targets: &[Target], groups: &[crate::crd::GroupStatus]) -> String {
    let why: Vec<String> = targets
        .iter()
        .map(|t| {
            let phase = groups
                .iter()
                .find(|g| g.index == t.group)
                .map_or("unknown".to_string(), |g| format!("{:?}", g.phase));
            format!(
                "group {} is {phase} at incarnation {} (decode {} serves at incarnation {})",
                t.group, t.group_incarnation, t.pod, t.incarnation
            )
        })
        .collect();
    format!("no group is ready: {}", why.join("; "))
}

/// The decodes the router may use, from a snapshot: every serving decode, with its
/// group's phase and current incarnation (only those of groups Ready at it are ever
/// chosen).
pub fn targets_of(s: &Snapshot) -> Targets {
    let groups = s
        .status
        .as_ref()
        .map(|st| st.group_statuses.as_slice())
        .unwrap_or_default();
    let targets: Vec<Target> = s
        .endpoints
        .iter()
        .map(|e| {
            let g = groups.iter().find(|g| g.index == e.group);
            Target {
                pod: e.pod.clone(),
                group: e.group,
                incarnation: e.incarnation,
                addr: e.addr,
                group_ready: g.is_some_and(|g| g.phase == GroupPhase::Ready),
                group_incarnation: g.map_or(-1, |g| g.incarnation),
            }
        })
        .collect();
    let unavailable = if !s.unavailable.is_empty() {
        s.unavailable.clone()
    } else {
        // Decodes serve, but none of a group Ready at its current incarnation.
        no_ready_group(&targets, groups)
    };
    Targets {
        targets,
        unavailable,
    }
}

/// Accept HTTP/1.1 connections on `listener` forever, each served by `handle` on its own
/// task (request heads bounded by [`HEADER_TIMEOUT`]). Both router hosts use it (the local
/// endpoint and `crate::cluster_router`).
pub(crate) async fn accept_connections<H, F>(listener: TcpListener, handle: H)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + 'static,
    F: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let answer = handle(req);
                async move { Ok::<_, Infallible>(answer.await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Accept connections, follow the snapshot's decodes and poll their reports, until the
/// task is dropped.
pub async fn serve(listener: TcpListener, router: Arc<Router>) {
    let follow = {
        let router = router.clone();
        async move {
            let mut rx = router.snapshot.clone();
            while rx.changed().await.is_ok() {
                let t = targets_of(&rx.borrow_and_update());
                router.targets.send_replace(Arc::new(t));
            }
        }
    };
    let poll = router.inner.poller().run();
    let accept = accept_connections(listener, move |req| {
        let router = router.clone();
        async move { router.handle(req).await }
    });
    tokio::select! {
        _ = follow => {}
        _ = poll => {}
        _ = accept => {}
    }
}

fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_body(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    text(status, "application/json", v.to_string())
}

/// OpenMetrics text of `registry` without its `# EOF` line (so two registries make one
/// exposition).
fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, registry)?;
    if let Some(body) = s.strip_suffix("# EOF\n") {
        s.truncate(body.len());
    }
    Ok(s)
}

impl Router {
    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path();
        if path.starts_with("/v1/") {
            return self.inner.forward(req).await;
        }
        match (req.method(), path) {
            (&Method::GET, "/health") => json_body(StatusCode::OK, &json!({"status": "ok"})),
            (&Method::GET, "/ready") => {
                let t = self.inner.targets();
                if t.eligible() == 0 {
                    error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no_ready_group",
                        &t.unavailable,
                    )
                } else {
                    let endpoints: Vec<&Target> =
                        t.targets.iter().filter(|t| t.eligible()).collect();
                    json_body(
                        StatusCode::OK,
                        &json!({"ready": true, "endpoints": endpoints.iter().map(|t| json!({
                            "pod": t.pod, "group": t.group, "incarnation": t.incarnation, "addr": t.addr,
                        })).collect::<Vec<_>>()}),
                    )
                }
            }
            (&Method::GET, "/metrics") => {
                match (encode(&self.metrics.registry), encode(&self.registry)) {
                    (Ok(a), Ok(b)) => text(
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        format!("{a}{b}# EOF\n"),
                    ),
                    (Err(e), _) | (_, Err(e)) => {
                        error(StatusCode::INTERNAL_SERVER_ERROR, "metrics", &e.to_string())
                    }
                }
            }
            (&Method::GET, "/status.txt" | "/status") => {
                if let Err(r) = self.inner.authorize(req.headers()) {
                    return r;
                }
                let snap = self.snapshot.borrow().clone();
                if path == "/status" {
                    match serde_json::to_string_pretty(&*snap) {
                        Ok(s) => text(StatusCode::OK, "application/json", s),
                        Err(e) => {
                            error(StatusCode::INTERNAL_SERVER_ERROR, "status", &e.to_string())
                        }
                    }
                } else {
                    let mut t = super::display::render(&snap, k8s_openapi::jiff::Timestamp::now())
                        .join("\n");
                    t.push('\n');
                    text(StatusCode::OK, "text/plain; charset=utf-8", t)
                }
            }
            _ => json_body(
                StatusCode::NOT_FOUND,
                &json!({"error": {"message": format!("no route for {} {path}: the OpenAI API is under /v1/, the runtime's own endpoints are /health, /ready, /metrics, /status and /status.txt", req.method()), "type": "not_found", "code": "not_found"}}),
            ),
        }
    }
}

/// The address the router listens on, for messages.
pub fn base_url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}
