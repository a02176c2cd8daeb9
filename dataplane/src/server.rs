//! OpenAI-compatible HTTP server (hyper 1, HTTP/1.1) with health, readiness and metrics.

mod api_error;
mod completions;
mod fields;
mod messages;
mod output;
mod params;
#[cfg(test)]
mod tests;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

pub use api_error::ApiError;

use crate::chat::ChatTemplate;
use crate::metrics::Metrics;
use crate::scheduler::EngineHandle;
use crate::tokenizer::Tokenizer;

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Largest accepted request body.
const MAX_BODY: usize = 8 << 20;

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    /// None when the model has no `tokenizer.chat_template`.
    pub chat: Option<ChatTemplate>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    pub model_name: String,
    pub context_length: usize,
    /// max_tokens when a request gives none (capped by the room left in the context).
    pub default_max_tokens: usize,
    pub metrics: Arc<Metrics>,
    /// `/ready` fails when the engine loop has not gone round for this long.
    pub max_heartbeat_age: Duration,
    /// Longest a client may take to send a request head (and an idle keep-alive
    /// connection may wait for the next one) before the connection is closed.
    pub header_read_timeout: Duration,
    pub role: &'static str,
    /// Where the process is in shutting down (readiness fails while draining; requests
    /// still in flight at the drain deadline end with a `shutdown` error).
    pub shutdown: Shutdown,
    /// PD roles: the KV channel (readiness checks; the decode's room client).
    pub pd: Option<crate::pd::PdRole>,
    /// `POST /debug/fault` exists (only with `--fault-injection` and
    /// `TANDEM_ALLOW_FAULT_INJECTION=yes`; see `pd::supervise`).
    pub fault_injection: bool,
}

/// Shutdown state shared by `serve`, `/ready` and the request handlers.
pub struct Shutdown {
    draining: AtomicBool,
    /// Turns true at the drain deadline.
    deadline: tokio::sync::watch::Sender<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self {
            draining: AtomicBool::new(false),
            deadline: tokio::sync::watch::channel(false).0,
        }
    }
}

impl Shutdown {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    fn begin_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    fn deadline_passed(&self) {
        self.deadline.send_replace(true);
    }

    /// Resolves once the drain deadline has passed (never, while serving).
    pub async fn deadline(&self) {
        let mut rx = self.deadline.subscribe();
        // The guard `wait_for` returns is not Send: drop it inside the future.
        drop(rx.wait_for(|passed| *passed).await);
    }
}

/// When the drain begins, how long a connection that has not started a request yet gets
/// to start one (it was accepted just before, so its request is on its way).
const FIRST_REQUEST_AT_DRAIN: Duration = Duration::from_millis(500);

/// After the drain deadline, how long requests still in flight get to send their
/// `shutdown` error before their connections are closed.
const DEADLINE_GRACE: Duration = Duration::from_millis(150);

pub fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed_unsync());
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.status, &e.body())
}

/// Serve until `shutdown` resolves; then drain: readiness fails, the PD side takes no new
/// work, and open connections finish the requests they have in flight (streams included)
/// for up to `drain`. While draining, new connections are still accepted, one request
/// each, so that probes and scrapes see why (`/ready` 503 with reason `draining`), but new
/// completions get 503 `draining`. At the deadline, requests still in flight end with a
/// `shutdown` error. Returns when nothing is left in flight or at the deadline.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = accept(&listener, &state) => {
                if let Some((stream, peer)) = accepted {
                    conns.spawn(connection(stream, peer, state.clone(), stop_rx.clone(), true));
                }
            }
        }
    }
    state.shutdown.begin_drain();
    if let Some(pd) = &state.pd {
        pd.drain();
    }
    let _ = stop_tx.send(true);
    tracing::info!(open_connections = conns.len(), deadline = ?drain, "draining: no new requests; in-flight requests may finish");
    // Connections opened while draining serve one request (a probe, a scrape, or a refusal)
    // and are not waited for.
    let mut late = JoinSet::new();
    let deadline = tokio::time::Instant::now() + drain;
    let idle =
        |conns: &JoinSet<()>| conns.is_empty() && state.pd.as_ref().is_none_or(|p| p.is_idle());
    while !idle(&conns) {
        tokio::select! {
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            Some(_) = late.join_next(), if !late.is_empty() => {}
            accepted = accept(&listener, &state) => {
                if let Some((stream, peer)) = accepted {
                    late.spawn(connection(stream, peer, state.clone(), stop_rx.clone(), false));
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    drop(listener);
    if idle(&conns) {
        tracing::info!("drained: nothing left in flight");
        late.abort_all();
        return;
    }
    tracing::warn!(
        open_connections = conns.len(),
        "drain deadline passed; ending the requests still in flight with a shutdown error"
    );
    state.metrics.fail("drain_deadline");
    state.shutdown.deadline_passed();
    let all_done = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(DEADLINE_GRACE, all_done)
        .await
        .is_err()
    {
        tracing::warn!(
            open_connections = conns.len(),
            "closing the connections left"
        );
        conns.abort_all();
    }
    late.abort_all();
}

/// The next connection, or `None` after a failed accept (typically EMFILE: counted, and
/// backed off instead of spinning).
async fn accept(
    listener: &TcpListener,
    state: &AppState,
) -> Option<(tokio::net::TcpStream, SocketAddr)> {
    match listener.accept().await {
        Ok(a) => Some(a),
        Err(e) => {
            tracing::warn!(error = %e, "accept failed");
            state.metrics.fail("accept_error");
            tokio::time::sleep(Duration::from_millis(50)).await;
            None
        }
    }
}

/// After `serve` returned: stop the PD loops (rooms left fail with a reason pushed to the
/// peers, sockets close with a bounded linger), release the engine and wait for its thread.
/// Every wait is bounded by `grace` in all; a thread still running then is abandoned on
/// purpose (logged): the process exits without it.
pub fn finish(state: Arc<AppState>, engine_thread: JoinHandle<()>, grace: Duration) {
    let start = Instant::now();
    if let Some(pd) = &state.pd {
        let left = pd.stop(start + grace / 2);
        if left.is_empty() {
            tracing::info!("KV loops stopped");
        } else {
            tracing::warn!(loops = ?left, "KV loops still running at the deadline; abandoned");
        }
    }
    // The last engine handles go with the state (the prefill's loop dropped its own): the
    // engine thread then ends what is left and exits.
    drop(state);
    while !engine_thread.is_finished() && start.elapsed() < grace {
        std::thread::sleep(Duration::from_millis(5));
    }
    if !engine_thread.is_finished() {
        tracing::warn!("engine thread still busy at the shutdown deadline; abandoned");
    } else if engine_thread.join().is_err() {
        tracing::error!("engine thread panicked during shutdown");
    } else {
        tracing::info!("shutdown complete");
    }
}

async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    state: Arc<AppState>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    keep_alive: bool,
) {
    let state_metrics = state.metrics.clone();
    let header_timeout = state.header_read_timeout;
    let started = Arc::new(AtomicBool::new(false));
    let svc = service_fn({
        let started = started.clone();
        move |req| {
            started.store(true, Ordering::Relaxed);
            let state = state.clone();
            async move { Ok::<_, Infallible>(route(state, req).await) }
        }
    });
    // A client that never finishes its request head must not hold a connection (and its
    // task) forever: hyper closes it after `header_timeout` with a timeout error.
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(keep_alive)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let res = tokio::select! {
        r = conn.as_mut() => r,
        // The guard `wait_for` returns is not Send: drop it inside the future. (A
        // connection without keep-alive serves one request and closes by itself.)
        _ = async { drop(stop.wait_for(|s| *s).await) }, if keep_alive => {
            // A connection accepted just before the drain began may not have had its
            // request read yet (a probe, a scrape): a graceful shutdown now would close it
            // unanswered. Let it start its request first (bounded), then finish the
            // request in flight (a stream runs to its end) and close.
            let first_request = async {
                let t0 = tokio::time::Instant::now();
                while !started.load(Ordering::Relaxed) && t0.elapsed() < FIRST_REQUEST_AT_DRAIN {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::select! {
                r = conn.as_mut() => r,
                _ = first_request => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            }
        }
    };
    if let Err(e) = res {
        let kind = connection_error_kind(&e);
        state_metrics.connection_error(kind);
        if kind == "io_error" {
            // Typically a client that went away mid-response: common, not a server fault.
            tracing::debug!(%peer, kind, error = %e, "connection ended with an error");
        } else {
            tracing::info!(%peer, kind, error = %e, "connection ended with a protocol error");
        }
    }
}

/// Metric label of an HTTP connection error (hyper answered 400 / 431 itself when it could).
fn connection_error_kind(e: &hyper::Error) -> &'static str {
    if e.is_parse_too_large() {
        "header_too_large"
    } else if e.is_parse() {
        "parse_error"
    } else if e.is_incomplete_message() {
        "incomplete_request"
    } else if e.is_timeout() {
        "timeout"
    } else if e.is_body_write_aborted() {
        "body_write_aborted"
    } else {
        "io_error"
    }
}

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let endpoint = match path.as_str() {
        "/v1/chat/completions"
        | "/v1/completions"
        | "/v1/models"
        | "/health"
        | "/ready"
        | "/metrics" => path.as_str(),
        _ => "other",
    };
    let res = match (method.clone(), path.as_str()) {
        (Method::GET, "/health") => Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))),
        (Method::GET, "/ready") => Ok(ready(&state)),
        (Method::GET, "/metrics") => Ok(metrics(&state)),
        (Method::GET, "/v1/models") => Ok(models(&state)),
        (Method::POST, "/debug/fault") if state.fault_injection => {
            debug_fault(&state, req.uri().query())
        }
        (Method::POST, "/v1/chat/completions" | "/v1/completions")
            if state.shutdown.is_draining() =>
        {
            Err(ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "draining",
                "the server is shutting down and takes no new requests",
            ))
        }
        (Method::POST, "/v1/chat/completions") => match body(req).await {
            Ok(b) => completions::chat(state.clone(), b).await,
            Err(e) => Err(e),
        },
        (Method::POST, "/v1/completions") => match body(req).await {
            Ok(b) => completions::completions(state.clone(), b).await,
            Err(e) => Err(e),
        },
        (
            _,
            "/health"
            | "/ready"
            | "/metrics"
            | "/v1/models"
            | "/v1/chat/completions"
            | "/v1/completions",
        ) => Err(ApiError::method_not_allowed(format!(
            "method {method} is not allowed on {path}"
        ))),
        _ => Err(ApiError::not_found(format!("no route for {method} {path}"))),
    };
    let res = res.unwrap_or_else(|e| {
        if e.status.is_server_error() {
            tracing::warn!(%method, %path, status = e.status.as_u16(), error = %e.message, "request failed");
        } else {
            tracing::info!(%method, %path, status = e.status.as_u16(), error = %e.message, "request rejected");
        }
        if e.status.is_client_error() {
            state.metrics.rejected(e.code.unwrap_or("invalid_request"));
        }
        error_response(&e)
    });
    state.metrics.request(endpoint, res.status().as_u16());
    res
}

async fn body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        ..ApiError::invalid(None, format!("the request body exceeds {MAX_BODY} bytes"))
            .with_code("body_too_large")
    };
    // A declared length beyond the limit is refused before reading a byte of it.
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(
            ApiError::invalid(None, format!("could not read the request body: {e}"))
                .with_code("body_read_error"),
        ),
    }
}

/// Version of the `/ready` body's format (docs/readiness.md); bumped on any change that
/// could break a reader.
pub const READY_FORMAT: u32 = 1;

/// Every `/ready` check of this process: the engine, the drain, and the PD channel.
pub fn ready_checks(state: &AppState) -> Vec<crate::pd::Check> {
    use crate::pd::Check;
    let health = state.engine.health();
    let age = health.heartbeat_age();
    let engine = if health.stopped() {
        Check::new(
            "engine_heartbeat",
            false,
            "engine_stopped",
            "engine thread stopped".into(),
        )
    } else {
        Check::new(
            "engine_heartbeat",
            age <= state.max_heartbeat_age,
            "engine_stalled",
            format!(
                "engine loop last went round {} ms ago (limit {} ms)",
                age.as_millis(),
                state.max_heartbeat_age.as_millis()
            ),
        )
    };
    let draining = state.shutdown.is_draining();
    let mut checks = vec![
        engine,
        Check::new(
            "not_draining",
            !draining,
            "draining",
            if draining {
                "shutting down: not accepting new requests".into()
            } else {
                "accepting requests".into()
            },
        ),
    ];
    if let Some(pd) = &state.pd {
        checks.extend(pd.checks());
    }
    checks
}

/// The `/ready` body (format in docs/readiness.md): `ready`, and when not, the first
/// failing check's `reason` and `message`; every check; every KV peer with its state and
/// last refusal and failure.
pub fn ready_body(state: &AppState) -> Value {
    let checks = ready_checks(state);
    let failing = checks.iter().find(|c| !c.ok);
    let peers: Vec<Value> = state
        .pd
        .as_ref()
        .map(|pd| pd.peers().iter().map(|p| p.to_json()).collect())
        .unwrap_or_default();
    json!({
        "format": READY_FORMAT,
        "ready": failing.is_none(),
        "role": state.role,
        "reason": failing.map(|c| c.reason.clone()),
        "message": failing.map(|c| format!("{}: {}", c.name, c.detail)),
        "checks": checks
            .iter()
            .map(|c| json!({"name": c.name, "ok": c.ok, "reason": c.reason, "detail": c.detail}))
            .collect::<Vec<_>>(),
        "peers": peers,
    })
}

fn ready(state: &AppState) -> Response<Body> {
    let body = ready_body(state);
    let status = if body["ready"] == true {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, &body)
}

/// `POST /debug/fault?loop=<name>&fault=panic|stall&ms=<n>`: arm a one-shot fault in a KV
/// loop (fault injection for tests; routed only when `state.fault_injection`).
fn debug_fault(state: &AppState, query: Option<&str>) -> Result<Response<Body>, ApiError> {
    let param = |k: &str| {
        query
            .unwrap_or("")
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(key, _)| *key == k)
            .map(|(_, v)| v.to_owned())
    };
    let name = param("loop").ok_or_else(|| ApiError::invalid(Some("loop"), "missing 'loop'"))?;
    let fault = match param("fault").as_deref() {
        Some("panic") => crate::pd::Fault::Panic,
        Some("stall") => {
            let ms: u64 = param("ms")
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| ApiError::invalid(Some("ms"), "'ms' must be a whole number"))?;
            crate::pd::Fault::Stall(Duration::from_millis(ms))
        }
        _ => {
            return Err(ApiError::invalid(
                Some("fault"),
                "'fault' must be 'panic' or 'stall'",
            ));
        }
    };
    let loops = state.pd.as_ref().map(|pd| pd.loops()).unwrap_or_default();
    let Some(h) = loops.iter().find(|h| h.name == name) else {
        let names: Vec<&str> = loops.iter().map(|h| h.name.as_str()).collect();
        return Err(ApiError::invalid(
            Some("loop"),
            format!("no loop named {name:?}; loops: {names:?}"),
        ));
    };
    tracing::warn!(r#loop = %name, ?fault, "fault injected on request");
    h.inject(fault);
    Ok(json_response(
        StatusCode::OK,
        &json!({"loop": name, "fault": format!("{fault:?}")}),
    ))
}

fn metrics(state: &AppState) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(state.metrics.encode())).boxed_unsync());
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    r
}

fn models(state: &AppState) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": state.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "tandem",
                "max_model_len": state.context_length,
            }],
        }),
    )
}
