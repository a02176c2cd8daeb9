//! OpenAI-compatible HTTP server (hyper 1, HTTP/1.1) with health, readiness and metrics.

mod api_error;
mod completions;
mod output;
mod params;
#[cfg(test)]
mod tests;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

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
    /// Set on SIGTERM: readiness fails so no new traffic is routed here while draining.
    pub draining: AtomicBool,
    /// PD roles: the KV channel (readiness checks; the decode's room client).
    pub pd: Option<crate::pd::PdRole>,
}

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

/// Serve until `shutdown` resolves, then stop accepting, let open connections finish their
/// in-flight requests (streams included) for up to `drain`, and return.
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
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Typically EMFILE: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        state.metrics.fail("accept_error");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                conns.spawn(connection(stream, peer, state.clone(), stop_rx.clone()));
            }
        }
    }
    drop(listener);
    state.draining.store(true, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    tracing::info!(open_connections = conns.len(), deadline = ?drain, "draining connections");
    let all_done = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(drain, all_done).await.is_err() {
        tracing::warn!(
            open_connections = conns.len(),
            "drain deadline passed; closing the rest"
        );
        state.metrics.fail("drain_deadline");
        conns.abort_all();
    }
}

async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    state: Arc<AppState>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let state_metrics = state.metrics.clone();
    let header_timeout = state.header_read_timeout;
    let svc = service_fn(move |req| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(route(state, req).await) }
    });
    // A client that never finishes its request head must not hold a connection (and its
    // task) forever: hyper closes it after `header_timeout` with a timeout error.
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let res = tokio::select! {
        r = conn.as_mut() => r,
        // The guard `wait_for` returns is not Send: drop it inside the future.
        _ = async { drop(stop.wait_for(|s| *s).await) } => {
            // Finish the request in flight (a stream runs to its end), then close.
            conn.as_mut().graceful_shutdown();
            conn.await
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

fn ready(state: &AppState) -> Response<Body> {
    let health = state.engine.health();
    let age = health.heartbeat_age();
    let engine_ok = !health.stopped() && age <= state.max_heartbeat_age;
    let draining = state.draining.load(Ordering::Relaxed);
    let checks = json!([
        {
            "name": "engine_heartbeat",
            "ok": engine_ok,
            "detail": if health.stopped() {
                "engine thread stopped".to_owned()
            } else {
                format!("engine loop last went round {} ms ago (limit {} ms)", age.as_millis(), state.max_heartbeat_age.as_millis())
            },
        },
        {
            "name": "not_draining",
            "ok": !draining,
            "detail": if draining { "shutting down: not accepting new requests" } else { "accepting requests" },
        },
    ]);
    let mut checks = checks;
    let mut pd_ok = true;
    if let Some(pd) = &state.pd {
        for c in pd.checks() {
            pd_ok &= c.ok;
            if let Value::Array(a) = &mut checks {
                a.push(json!({"name": c.name, "ok": c.ok, "detail": c.detail}));
            }
        }
    }
    let ok = engine_ok && !draining && pd_ok;
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        status,
        &json!({"ready": ok, "role": state.role, "checks": checks}),
    )
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
