//! The local stand-in for the client Service: one HTTP endpoint that forwards `/v1/*` to
//! the decodes of Ready groups (gate open and the decode itself ready), round robin.
//!
//! - Response bodies are passed through frame by frame (SSE streams arrive as they are
//!   produced; nothing is buffered), and request bodies the same way.
//! - A client that goes away closes the connection to the decode, which aborts the
//!   request's room on both sides: the upstream connection lives exactly as long as the
//!   response body being sent to the client.
//! - No ready group: 503 at once with a JSON body saying why, never a wait.
//! - Also served: `/health` (the runtime's event loop answers), `/ready` (some group can
//!   take traffic), `/metrics` (the operator's metrics plus the router's), `/status` (the
//!   whole [`Snapshot`] as JSON: status, members, endpoints, the record) and
//!   `/status.txt` (the terminal display's text).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::executor::Endpoint;
use super::metrics::LocalMetrics;
use super::snapshot::Snapshot;
use crate::metrics::Metrics;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Longest wait for a decode to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a client may take to send a request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

pub struct Router {
    snapshot: watch::Receiver<Arc<Snapshot>>,
    metrics: Arc<Metrics>,
    local: LocalMetrics,
    next: AtomicUsize,
}

impl Router {
    pub fn new(
        snapshot: watch::Receiver<Arc<Snapshot>>,
        metrics: Arc<Metrics>,
        local: LocalMetrics,
    ) -> Self {
        Self {
            snapshot,
            metrics,
            local,
            next: AtomicUsize::new(0),
        }
    }
}

/// Accept connections until the task is dropped.
pub async fn serve(listener: TcpListener, router: Arc<Router>) {
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
        let router = router.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let router = router.clone();
                async move { Ok::<_, Infallible>(router.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_body(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

/// An OpenAI-style error body.
fn error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    let type_ = if status == StatusCode::SERVICE_UNAVAILABLE {
        "service_unavailable"
    } else {
        "upstream_error"
    };
    let mut r = json_body(
        status,
        &json!({"error": {"message": message, "type": type_, "code": code}}),
    );
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

fn strip_hop_by_hop(h: &mut HeaderMap) {
    for name in HOP_BY_HOP {
        h.remove(name);
    }
}

impl Router {
    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path();
        if path.starts_with("/v1/") {
            return self.forward(req).await;
        }
        let snap = self.snapshot.borrow().clone();
        match (req.method(), path) {
            (&Method::GET, "/health") => json_body(StatusCode::OK, &json!({"status": "ok"})),
            (&Method::GET, "/ready") => {
                if snap.endpoints.is_empty() {
                    error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no_ready_group",
                        &snap.unavailable,
                    )
                } else {
                    json_body(
                        StatusCode::OK,
                        &json!({"ready": true, "endpoints": snap.endpoints}),
                    )
                }
            }
            (&Method::GET, "/metrics") => {
                let mut text = String::new();
                if let Err(e) =
                    prometheus_client::encoding::text::encode(&mut text, &self.metrics.registry)
                {
                    return error(StatusCode::INTERNAL_SERVER_ERROR, "metrics", &e.to_string());
                }
                full(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                )
            }
            (&Method::GET, "/status.txt") => {
                let mut text =
                    super::display::render(&snap, k8s_openapi::jiff::Timestamp::now()).join("\n");
                text.push('\n');
                full(StatusCode::OK, "text/plain; charset=utf-8", text)
            }
            (&Method::GET, "/status") => match serde_json::to_string_pretty(&*snap) {
                Ok(s) => full(StatusCode::OK, "application/json", s),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "status", &e.to_string()),
            },
            _ => json_body(
                StatusCode::NOT_FOUND,
                &json!({"error": {"message": format!("no route for {} {path}: the OpenAI API is under /v1/, the runtime's own endpoints are /health, /ready, /metrics, /status and /status.txt", req.method()), "type": "not_found", "code": "not_found"}}),
            ),
        }
    }

    async fn forward(&self, req: Request<Incoming>) -> Response<Body> {
        let snap = self.snapshot.borrow().clone();
        if snap.endpoints.is_empty() {
            self.local.request("no_ready_group");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_ready_group",
                &snap.unavailable,
            );
        }
        let n = snap.endpoints.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let mut last = String::new();
        // Only the connection is retried on another decode: the request has not been
        // sent anywhere yet.
        for i in 0..n {
            let ep = &snap.endpoints[(start + i) % n];
            match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(ep.addr)).await {
                Ok(Ok(stream)) => return self.send(stream, ep, req).await,
                Ok(Err(e)) => last = format!("decode {} at {}: {e}", ep.pod, ep.addr),
                Err(_) => {
                    last = format!(
                        "decode {} at {}: no connection within {}s",
                        ep.pod,
                        ep.addr,
                        CONNECT_TIMEOUT.as_secs()
                    )
                }
            }
            tracing::warn!(pod = %ep.pod, group = ep.group, "forwarding failed: {last}");
            self.local.request("connect_failed");
        }
        // Every decode listed is unreachable: it died and the runtime has not seen the
        // exit yet. The endpoint is unavailable for now, like one with no ready group.
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream_unreachable",
            &last,
        )
    }

    async fn send(
        &self,
        stream: TcpStream,
        ep: &Endpoint,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) =
            match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                Ok(c) => c,
                Err(e) => {
                    self.local.request("upstream_failed");
                    return error(
                        StatusCode::BAD_GATEWAY,
                        "upstream_failed",
                        &format!("decode {}: {e}", ep.pod),
                    );
                }
            };
        // The connection lives while this request or its response body does.
        let conn = AbortOnDrop(
            tokio::spawn(async move {
                let _ = conn.await;
            })
            .abort_handle(),
        );
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        if let Ok(v) = HeaderValue::from_str(&ep.addr.to_string()) {
            parts.headers.insert(header::HOST, v);
        }
        match sender.send_request(Request::from_parts(parts, body)).await {
            Ok(resp) => {
                self.local.request("forwarded");
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                if let Ok(v) = HeaderValue::from_str(&ep.pod) {
                    parts.headers.insert("x-tandem-pod", v);
                }
                let body = Upstream { body, _conn: conn }
                    .map_err(|e| Box::new(e) as BoxError)
                    .boxed_unsync();
                Response::from_parts(parts, body)
            }
            Err(e) => {
                tracing::warn!(pod = %ep.pod, group = ep.group, "decode failed before answering: {e}");
                self.local.request("upstream_failed");
                error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_failed",
                    &format!("decode {} failed before answering: {e}", ep.pod),
                )
            }
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A decode's response body, holding its connection open until it is dropped.
struct Upstream {
    body: Incoming,
    _conn: AbortOnDrop,
}

impl hyper::body::Body for Upstream {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The address the router listens on, for messages.
pub fn base_url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}
