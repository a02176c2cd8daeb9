//! The route table: every path the server answers, its method, what handles it and the
//! label its requests are counted under. `route` is the only dispatch: a path not in the
//! table is 404, a path in it with another method is 405 with an `Allow` header, and the
//! `endpoint` label of `tandem_requests_total` is the table's path (or `other`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::json;

use super::request_body::body;
use super::{ApiError, AppState, Body, completions, error_response, json_response, ready};

/// What serves a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Handler {
    Health,
    Ready,
    Metrics,
    Models,
    ChatCompletions,
    Completions,
    /// Only with `--fault-injection` (and `TANDEM_ALLOW_FAULT_INJECTION=yes`).
    DebugFault,
    /// Only for the roles prefill and decode (docs/in-place-reset.md).
    Reset,
    /// A router's calls (`router_calls`).
    RouterReport,
    RouterPromptKeys,
}

/// One path and method the server answers.
#[derive(Debug)]
pub(super) struct Route {
    pub(super) path: &'static str,
    pub(super) method: Method,
    pub(super) handler: Handler,
}

/// Every route. The metric label of a request is its route's path.
pub(super) const ROUTES: &[Route] = &[
    Route {
        path: "/health",
        method: Method::GET,
        handler: Handler::Health,
    },
    Route {
        path: "/ready",
        method: Method::GET,
        handler: Handler::Ready,
    },
    Route {
        path: "/metrics",
        method: Method::GET,
        handler: Handler::Metrics,
    },
    Route {
        path: "/v1/models",
        method: Method::GET,
        handler: Handler::Models,
    },
    Route {
        path: "/v1/chat/completions",
        method: Method::POST,
        handler: Handler::ChatCompletions,
    },
    Route {
        path: "/v1/completions",
        method: Method::POST,
        handler: Handler::Completions,
    },
    Route {
        path: "/debug/fault",
        method: Method::POST,
        handler: Handler::DebugFault,
    },
    Route {
        path: tandem_contract::reset::PATH,
        method: Method::POST,
        handler: Handler::Reset,
    },
    Route {
        path: tandem_contract::routing::REPORT_PATH,
        method: Method::GET,
        handler: Handler::RouterReport,
    },
    Route {
        path: tandem_contract::routing::PROMPT_KEYS_PATH,
        method: Method::POST,
        handler: Handler::RouterPromptKeys,
    },
];

/// The routes of `path` that exist in this process (`/debug/fault` only with fault
/// injection on, `/admin/reset` only for the PD roles).
fn routes_of<'a>(state: &'a AppState, path: &'a str) -> impl Iterator<Item = &'static Route> + 'a {
    ROUTES
        .iter()
        .filter(move |r| r.path == path)
        .filter(|r| r.handler != Handler::DebugFault || state.fault_injection)
        .filter(|r| r.handler != Handler::Reset || state.pd.is_some())
}

pub(super) async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let here: Vec<&Route> = routes_of(&state, &path).collect();
    let endpoint = here.first().map_or("other", |r| r.path);
    if let Some(refused) = super::api_keys::refuse(&state, &path, req.headers()) {
        state.metrics.request(endpoint, refused.status().as_u16());
        return refused;
    }
    let res = match here.iter().find(|r| r.method == method) {
        Some(r) => handle(&state, r.handler, req).await,
        None if here.is_empty() => {
            Err(ApiError::not_found(format!("no route for {method} {path}")))
        }
        None => {
            let allow: Vec<&str> = here.iter().map(|r| r.method.as_str()).collect();
            Err(
                ApiError::method_not_allowed(format!("method {method} is not allowed on {path}"))
                    .with_allow(allow.join(", ")),
            )
        }
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

async fn handle(
    state: &Arc<AppState>,
    handler: Handler,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let draining = || {
        ApiError::server(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "the server is shutting down and takes no new requests",
        )
    };
    let max_body = state.limits.max_body_bytes;
    match handler {
        Handler::Health => Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))),
        Handler::Ready => Ok(ready::ready(state)),
        Handler::Metrics => Ok(metrics(state)),
        Handler::Models => Ok(models(state)),
        Handler::DebugFault => debug_fault(state, req.uri().query()),
        Handler::Reset => super::reset::reset(state.clone(), req).await,
        Handler::ChatCompletions | Handler::Completions if state.shutdown.is_draining() => {
            Err(draining())
        }
        Handler::ChatCompletions => {
            completions::chat(state.clone(), body(req, max_body).await?).await
        }
        Handler::Completions => {
            completions::completions(state.clone(), body(req, max_body).await?).await
        }
        Handler::RouterReport => Ok(super::router_calls::report(state, req.uri().query())),
        Handler::RouterPromptKeys => {
            let query = req.uri().query().map(str::to_owned);
            let b = body(req, max_body).await?;
            super::router_calls::prompt_keys(state, query.as_deref(), &b)
        }
    }
}

/// `POST /debug/fault?loop=<name>&fault=panic|stall&ms=<n>`: arm a one-shot fault in a KV
/// loop; `loop=engine&fault=hold|fail_steps&ms=<n>`: for `n` ms the engine keeps its work
/// without stepping, or fails every step (fault injection for tests; routed only when
/// `state.fault_injection`).
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
    let ms = || {
        param("ms")
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
            .ok_or_else(|| ApiError::invalid(Some("ms"), "'ms' must be a whole number"))
    };
    if name == "engine" {
        use crate::scheduler::EngineFault;
        let fault = match param("fault").as_deref() {
            Some("hold") => EngineFault::Hold(ms()?),
            Some("fail_steps") => EngineFault::FailSteps(ms()?),
            _ => {
                return Err(ApiError::invalid(
                    Some("fault"),
                    "the engine's 'fault' must be 'hold' or 'fail_steps'",
                ));
            }
        };
        tracing::warn!(r#loop = "engine", ?fault, "fault injected on request");
        state.engine.health().inject(fault);
        return Ok(json_response(
            StatusCode::OK,
            &json!({"loop": name, "fault": format!("{fault:?}")}),
        ));
    }
    let fault = match param("fault").as_deref() {
        Some("panic") => crate::pd::Fault::Panic,
        Some("stall") => crate::pd::Fault::Stall(ms()?),
        _ => {
            return Err(ApiError::invalid(
                Some("fault"),
                "'fault' must be 'panic' or 'stall'",
            ));
        }
    };
    let loops = state
        .pd
        .as_ref()
        .map(|pd| pd.current().role.loops())
        .unwrap_or_default();
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
