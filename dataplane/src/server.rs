//! OpenAI-compatible HTTP server (hyper 1, HTTP/1.1) with health, readiness and metrics.

mod api_error;
mod api_keys;
mod completions;
mod conn;
mod fields;
#[cfg(test)]
mod limits_tests;
mod messages;
mod output;
mod params;
mod progress_check;
mod ready;
mod request_body;
mod reset;
mod router_calls;
#[cfg(test)]
mod router_calls_tests;
mod routes;
#[cfg(test)]
mod test_server;
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
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

pub use api_error::ApiError;
pub use ready::{READY_FORMAT, ready_body, ready_checks};

use crate::chat::ChatTemplate;
use crate::metrics::Metrics;
use crate::scheduler::EngineHandle;
use crate::tokenizer::Tokenizer;

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// What a client may send and how long it may take (`--http-*` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// From a request's first byte to the end of its head; then 408.
    pub header_timeout: Duration,
    /// A connection without a request in flight or started; then it is closed.
    pub idle_timeout: Duration,
    /// Request body; larger gets 413.
    pub max_body_bytes: usize,
    /// Request line and headers; larger gets 431.
    pub max_header_bytes: usize,
    /// Headers per request; more get 431.
    pub max_headers: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_body_bytes: 8 << 20,
            max_header_bytes: 64 << 10,
            max_headers: 100,
        }
    }
}

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
    /// What a client may send and how long it may take.
    pub limits: HttpLimits,
    pub role: &'static str,
    /// Where the process is in shutting down (readiness fails while draining; requests
    /// still in flight at the drain deadline end with a `shutdown` error).
    pub shutdown: Shutdown,
    /// PD roles: the KV channel (readiness checks; the decode's room client), replaced by
    /// an in-place reset (`POST /admin/reset`).
    pub pd: Option<crate::pd::PdSlot>,
    /// `POST /debug/fault` exists (only with `--fault-injection` and
    /// `TANDEM_ALLOW_FAULT_INJECTION=yes`; see `pd::supervise`).
    pub fault_injection: bool,
    /// `/ready` fails `no_progress` when work makes no progress this long (zero: off).
    pub no_progress: Duration,
    /// The `engine_progress` check's state between `/ready` calls.
    pub progress: progress_check::ProgressWatch,
    /// Keys `/v1/*` and `/tandem/*` require (`--api-key`, `--api-key-file`); none: open.
    pub api_keys: tandem_contract::api_keys::ApiKeys,
    /// Tokens per KV block (the prompt keys a router matches are of whole blocks).
    pub kv_block_tokens: usize,
    /// What `/ready` answered last (each turn logged and counted once).
    pub readiness: ready::ReadinessWatch,
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
    let mut r = json_response(e.status, &e.body());
    if let Some(allow) = e
        .allow
        .as_deref()
        .and_then(|a| http::HeaderValue::from_str(a).ok())
    {
        r.headers_mut().insert(http::header::ALLOW, allow);
    }
    r
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
                    conns.spawn(conn::connection(stream, peer, state.clone(), stop_rx.clone(), true));
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
                    late.spawn(conn::connection(stream, peer, state.clone(), stop_rx.clone(), false));
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
