//! The request path of `/v1/*`: check the API key, read the body (bounded: it is sent
//! again on a retry), ask a decode for the prompt's block keys, rank the decodes with the
//! policy, send, and when the chosen decode fails before the first byte of its answer
//! reached the client — refused, closed, a 5xx, a body that broke off before its first
//! byte — send the same request once to the next decode (another group when there is
//! one). Never after a byte was sent: the client sees exactly one answer.
//!
//! The answer's head is held until its body's first frame has come (or the body is
//! empty), so a decode that dies between its head and its first token is retried too;
//! after that, frames pass through as they come (SSE streams stay streams).
//!
//! A decode that is alive but whose engine stopped stepping (its report's
//! `engineStalledMs` past [`RouterConfig::stall_limit`]) gets no new request while another
//! can take it, and a request waiting there for its first byte is taken back — its
//! connection dropped, which ends it in the decode — and sent to the other group, when
//! there is one that is not stalled itself. Without such a group it stays and waits: the
//! stall may pass, and the operator acts on the member's `no_progress`. A decode that went
//! silent — it answered report calls and, for the same limit, answers none: a stopped
//! process, a partition — is treated alike (`decode_unresponsive`): its requests would
//! wait until the kubelet's probes and the operator's co-restart end the process. With
//! nowhere to move, a request on a silent decode is answered 503 `decode_unresponsive`
//! once the limit passes (unlike a stall, a silence rarely passes by itself). So is a
//! decode whose group has left Ready for the limit (`group_not_ready`), where the request
//! can move: its process may answer and report while the request waits for KV that does
//! not come (a stalled KV loop, a cut channel).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, SizeHint};
use prometheus_client::registry::Registry;
use serde_json::json;
use tandem_contract::api_keys::{self, ApiKeys};
use tokio::sync::watch;

mod give_up;

use crate::client::{self, ExchangeError, Upstream};
use crate::fleet::{Fleet, Hung, InFlight, Poller, Target, TargetState, Targets};
use crate::metrics::RouterMetrics;
use crate::policy::{self, Mode, PolicyConfig, Why};
use crate::report;
use crate::session::Sessions;
use give_up::{Failure, hung_past, out_of_ready_past};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

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
/// The header a client names its session with.
pub const SESSION_HEADER: &str = "x-session-id";
/// Most bytes of a decode's error answer kept to pass on when it is the last answer.
const MAX_ERROR_BODY: usize = 64 << 10;
/// Longest wait for a decode's error answer's body.
const ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(5);
/// Prompt-keys failures are logged at most this often (each one is counted).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A key this router presents; `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<redacted: {} bytes>", self.0.len())
    }
}

impl Secret {
    /// `Authorization: Bearer <key>`, when the key fits in a header.
    fn bearer(&self) -> Option<HeaderValue> {
        HeaderValue::from_str(&format!("Bearer {}", self.0)).ok()
    }
}

#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub policy: PolicyConfig,
    /// Sends after a failure before the first byte: 1 (the default) or 0.
    pub retries: u8,
    /// Largest request body; larger is refused with 413.
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    /// Longest wait for a prompt's block keys (then the request is routed by load).
    pub prompt_keys_timeout: Duration,
    /// A decode whose engine has had work and made no step this long is sent nothing
    /// new while another can take it, and what waits there for a first byte moves (see
    /// the module header). Zero: off.
    pub stall_limit: Duration,
    /// Keys clients must present (`Authorization: Bearer`); none: open.
    pub api_keys: ApiKeys,
    /// The key this router presents to decodes that have API keys. Unset: requests keep
    /// the client's `Authorization`, and the router's own calls go without one.
    pub upstream_key: Option<Secret>,
    pub session_header: HeaderName,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: PolicyConfig::default(),
            retries: 1,
            // The dataplane's own default limit (`--http-max-body-bytes`).
            max_body_bytes: 8 << 20,
            connect_timeout: Duration::from_secs(2),
            prompt_keys_timeout: Duration::from_secs(2),
            // Far above any step of a serving engine (a decode step is milliseconds on a
            // GPU, tens of them on a CPU), far below a client's patience.
            stall_limit: Duration::from_secs(5),
            api_keys: ApiKeys::none(),
            upstream_key: None,
            session_header: HeaderName::from_static(SESSION_HEADER),
        }
    }
}

pub struct Router {
    cfg: RouterConfig,
    fleet: Arc<Fleet>,
    targets: watch::Receiver<Arc<Targets>>,
    pub metrics: RouterMetrics,
    sessions: Mutex<Sessions>,
    counter: AtomicU64,
    last_warn: Mutex<Option<Instant>>,
}

/// A full body.
pub fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An OpenAI-style error answer; a 503 says when to try again.
pub fn error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    let type_ = match status {
        StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
        s if s.is_client_error() => "invalid_request_error",
        _ => "upstream_error",
    };
    let mut r = Response::new(full(
        json!({"error": {"message": message, "type": type_, "param": null, "code": code}})
            .to_string(),
    ));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// The 401 of a refused key (the same body a decode gives).
pub fn unauthorized(r: api_keys::Refusal) -> Response<Body> {
    let mut resp = Response::new(full(r.body()));
    *resp.status_mut() = StatusCode::UNAUTHORIZED;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(api_keys::WWW_AUTHENTICATE),
    );
    resp
}

fn strip_hop_by_hop(h: &mut HeaderMap) {
    for name in HOP_BY_HOP {
        h.remove(name);
    }
}

/// The OpenAI API whose prompt the decode can tokenize for a request.
fn api_of(method: &Method, path: &str) -> Option<&'static str> {
    match (method, path) {
        (&Method::POST, "/v1/chat/completions") => Some("chat"),
        (&Method::POST, "/v1/completions") => Some("completions"),
        _ => None,
    }
}

impl Router {
    pub fn new(
        cfg: RouterConfig,
        targets: watch::Receiver<Arc<Targets>>,
        registry: &mut Registry,
    ) -> Self {
        Self {
            cfg,
            fleet: Arc::new(Fleet::default()),
            targets,
            metrics: RouterMetrics::register(registry),
            sessions: Mutex::new(Sessions::default()),
            counter: AtomicU64::new(0),
            last_warn: Mutex::new(None),
        }
    }

    /// The task that keeps the decodes' reports fresh; the host spawns it (`run`).
    pub fn poller(&self) -> Poller {
        Poller {
            fleet: self.fleet.clone(),
            targets: self.targets.clone(),
            metrics: self.metrics.clone(),
            authorization: self.cfg.upstream_key.as_ref().and_then(Secret::bearer),
        }
    }

    pub fn targets(&self) -> Arc<Targets> {
        self.targets.borrow().clone()
    }

    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Check a request's API key; the 401 to answer when it is refused (counted in
    /// `auth_refusals`; hosts gate their own paths with it too).
    #[allow(clippy::result_large_err)]
    pub fn authorize(&self, headers: &HeaderMap) -> Result<(), Response<Body>> {
        let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        self.cfg.api_keys.check(auth).map_err(|r| {
            self.metrics.auth_refused(r.code());
            unauthorized(r)
        })
    }

    fn warn_sometimes(&self, f: impl FnOnce()) {
        let mut last = self.last_warn.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            *last = Some(Instant::now());
            f();
        }
    }

    /// Route one `/v1/*` request.
    pub async fn forward<B>(&self, req: Request<B>) -> Response<Body>
    where
        B: hyper::body::Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        if let Err(r) = self.authorize(req.headers()) {
            self.metrics.outcome("unauthorized");
            return r;
        }
        let targets = self.targets();
        if targets.eligible() == 0 {
            self.metrics.outcome("no_ready_group");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_ready_group",
                &targets.unavailable,
            );
        }
        let (parts, body) = req.into_parts();
        let body = match self.read_body(&parts.headers, body).await {
            Ok(b) => b,
            Err(r) => return r,
        };
        let states = self.fleet.states(&targets.targets);
        let tiebreak = self.counter.fetch_add(1, Ordering::Relaxed);
        let keys = match api_of(&parts.method, parts.uri.path()) {
            Some(api) if self.cfg.policy.mode == Mode::PrefixLoad && targets.eligible() > 1 => {
                self.prompt_keys(api, &body, &targets.targets, &states, tiebreak)
                    .await
            }
            _ => Vec::new(),
        };
        let now = self.fleet.now_ms();
        let backends: Vec<policy::Backend> = targets
            .targets
            .iter()
            .zip(&states)
            .map(|(t, s)| s.backend(t, &keys, now, self.cfg.stall_limit))
            .collect();
        let session = parts
            .headers
            .get(&self.cfg.session_header)
            .map(|v| self.lock_sessions().id(v.as_bytes()));
        let pinned = session.and_then(|id| {
            let s = self.lock_sessions();
            let (pod, inc) = s.get(id)?;
            targets
                .targets
                .iter()
                .position(|t| &t.pod == pod && t.incarnation == *inc)
        });
        let ranking = policy::rank(
            &policy::Request {
                prompt_blocks: keys.len(),
                session: pinned,
                tiebreak,
            },
            &backends,
            &self.cfg.policy,
        );
        let Some(&first) = ranking.order.first() else {
            self.metrics.outcome("no_ready_group");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_ready_group",
                &targets.unavailable,
            );
        };
        self.metrics.choice(ranking.why.label());
        let why = ranking.why;
        let retry_to = (self.cfg.retries > 0)
            .then(|| policy::retry_target(&ranking.order, &backends, first))
            .flatten();
        // The first decode's stall moves the request only where it would not stall too.
        let movable = retry_to.is_some_and(|i| !backends[i].stalled);
        let send = async |i: usize, movable: bool| {
            states[i].note_sent(&keys, self.fleet.now_ms());
            self.attempt(&targets.targets[i], &states[i], &parts, &body, why, movable)
                .await
        };
        let result = match send(first, movable).await {
            Ok(r) => Ok((first, r, "forwarded")),
            Err(f) => {
                let next = retry_to;
                self.note_failure(&targets.targets[first], &states[first], &f, next.is_none());
                let unreachable = matches!(f, Failure::Connect(_));
                match next {
                    None => Err((f, unreachable)),
                    Some(next) => {
                        self.metrics.retries.inc();
                        match send(next, false).await {
                            Ok(r) => Ok((next, r, "retried")),
                            Err(f2) => {
                                self.note_failure(&targets.targets[next], &states[next], &f2, true);
                                let both = unreachable && matches!(f2, Failure::Connect(_));
                                Err((f2, both))
                            }
                        }
                    }
                }
            }
        };
        match result {
            Ok((i, resp, outcome)) => {
                self.metrics.outcome(outcome);
                self.metrics.prompt_blocks.inc_by(keys.len() as u64);
                self.metrics
                    .matched_blocks
                    .inc_by(backends[i].cached_blocks.min(keys.len()) as u64);
                if let Some(id) = session {
                    let t = &targets.targets[i];
                    self.lock_sessions().pin(id, (t.pod.clone(), t.incarnation));
                }
                resp
            }
            Err((last, all_unreachable)) => {
                self.metrics.outcome("failed");
                last.into_response(all_unreachable)
            }
        }
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn note_failure(&self, t: &Target, state: &TargetState, f: &Failure, last: bool) {
        self.metrics.attempt_failed(f.reason());
        self.fleet.cool(state);
        let then = if last {
            "no retry left"
        } else if self.cfg.retries > 0 {
            "retrying on another decode"
        } else {
            "retries are off"
        };
        tracing::warn!(pod = %t.pod, group = t.group, reason = f.reason(), "decode failed before the first byte of its answer ({then}): {}", f.describe());
    }

    /// The request body, whole (bounded by `max_body_bytes`).
    async fn read_body<B>(&self, headers: &HeaderMap, body: B) -> Result<Bytes, Response<Body>>
    where
        B: hyper::body::Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let max = self.cfg.max_body_bytes;
        let too_large = || {
            self.metrics.outcome("body_too_large");
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                &format!(
                    "the request body exceeds {max} bytes, the most this router holds to retry a request"
                ),
            )
        };
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max as u64) {
            return Err(too_large());
        }
        match Limited::new(body, max).collect().await {
            Ok(c) => Ok(c.to_bytes()),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
            Err(e) => {
                self.metrics.outcome("bad_request");
                Err(error(
                    StatusCode::BAD_REQUEST,
                    "body_read_error",
                    &format!("could not read the request body: {e}"),
                ))
            }
        }
    }

    /// The block keys of the request's prompt, from the least loaded eligible decode;
    /// empty when that fails (the request is then routed by load, and the failure counted).
    async fn prompt_keys(
        &self,
        api: &str,
        body: &Bytes,
        targets: &[Target],
        states: &[Arc<TargetState>],
        tiebreak: u64,
    ) -> Vec<u64> {
        let now = self.fleet.now_ms();
        let backends: Vec<policy::Backend> = targets
            .iter()
            .zip(states)
            .map(|(t, s)| s.backend(t, &[], now, self.cfg.stall_limit))
            .collect();
        let by_load = policy::rank(
            &policy::Request {
                prompt_blocks: 0,
                session: None,
                tiebreak,
            },
            &backends,
            &PolicyConfig {
                mode: Mode::PrefixLoad,
                ..self.cfg.policy
            },
        );
        let Some(&i) = by_load.order.first() else {
            return Vec::new();
        };
        let t = &targets[i];
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!(
                "{}?api={api}",
                tandem_contract::routing::PROMPT_KEYS_PATH
            ))
            .header(header::HOST, t.addr.to_string())
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(v) = self.cfg.upstream_key.as_ref().and_then(Secret::bearer) {
            req = req.header(header::AUTHORIZATION, v);
        }
        let Ok(req) = req.body(Full::new(body.clone())) else {
            return Vec::new();
        };
        let started = Instant::now();
        let got = client::fetch(t.addr, req, self.cfg.prompt_keys_timeout).await;
        self.metrics
            .prompt_keys_seconds
            .observe(started.elapsed().as_secs_f64());
        let failed = |reason: &'static str, why: String| {
            self.metrics.prompt_keys_failed(reason);
            self.warn_sometimes(|| {
                tracing::warn!(pod = %t.pod, group = t.group, reason, "no block keys for a prompt (routed by load; logged at most every 10 s, every one counted in tandem_router_prompt_keys_failures_total): {why}");
            });
            Vec::new()
        };
        match got {
            Ok((s, b)) if s.is_success() => {
                match report::parse_prompt_keys(&b).and_then(|k| report::parse_keys(&k.keys)) {
                    Ok(keys) => keys,
                    Err(e) => failed("invalid", e.to_string()),
                }
            }
            // The request itself is invalid: the decode will say so to the client.
            Ok((s, _)) if s.is_client_error() => {
                self.metrics.prompt_keys_failed("invalid_request");
                Vec::new()
            }
            Ok((s, b)) => failed(
                "status",
                format!(
                    "{}: {}",
                    s.as_u16(),
                    String::from_utf8_lossy(&b[..b.len().min(200)])
                ),
            ),
            Err(e) => failed("unreachable", e),
        }
    }

    /// Send the request to one decode; its answer once the first frame of its body is
    /// there, or how it failed before that.
    async fn attempt(
        &self,
        t: &Target,
        state: &Arc<TargetState>,
        parts: &http::request::Parts,
        body: &Bytes,
        why: Why,
        movable: bool,
    ) -> Result<Response<Body>, Failure> {
        let in_flight = state.start_request();
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = parts.uri.clone();
        let h = req.headers_mut();
        *h = parts.headers.clone();
        strip_hop_by_hop(h);
        h.remove(header::CONTENT_LENGTH);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        if let Ok(v) = HeaderValue::from_str(&t.addr.to_string()) {
            h.insert(header::HOST, v);
        }
        if let Some(v) = self.cfg.upstream_key.as_ref().and_then(Secret::bearer) {
            h.insert(header::AUTHORIZATION, v);
        }
        let answer = self.first_byte(t, req);
        let (mut rparts, first, rbody) = if self.cfg.stall_limit.is_zero() {
            answer.await?
        } else {
            let limit = self.cfg.stall_limit;
            // Out of Ready matters only where the request can go elsewhere.
            let left = async {
                if movable {
                    out_of_ready_past(&self.targets, t, limit).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                a = answer => a?,
                out = left => {
                    return Err(Failure::GroupNotReady(format!(
                        "decode {} (group {}): its group has not been Ready for {:.1} s \
                         (limit {:.1} s) while the request waited for its first byte",
                        t.pod,
                        t.group,
                        out.as_secs_f64(),
                        limit.as_secs_f64()
                    )));
                }
                hung = hung_past(state, self.cfg.stall_limit, movable) => {
                    let limit = self.cfg.stall_limit.as_secs_f64();
                    return Err(match hung {
                        Hung::EngineStalled(d) => Failure::EngineStalled(format!(
                            "decode {} (group {}): its engine has had work and made no step for \
                             {:.1} s (limit {limit:.1} s) while the request waited for its first byte",
                            t.pod,
                            t.group,
                            d.as_secs_f64(),
                        )),
                        Hung::Silent(d) => Failure::Unresponsive(format!(
                            "decode {} (group {}): it has answered no report call for {:.1} s \
                             (limit {limit:.1} s) while the request waited for its first byte",
                            t.pod,
                            t.group,
                            d.as_secs_f64(),
                        )),
                    });
                }
            }
        };
        strip_hop_by_hop(&mut rparts.headers);
        let hs = &mut rparts.headers;
        if let Ok(v) = HeaderValue::from_str(&t.pod) {
            hs.insert("x-tandem-pod", v);
        }
        hs.insert("x-tandem-group", HeaderValue::from(t.group));
        hs.insert("x-tandem-route", HeaderValue::from_static(why.label()));
        let body = Forwarded {
            first,
            rest: rbody,
            _in_flight: in_flight,
            metrics: self.metrics.clone(),
            pod: t.pod.clone(),
            group: t.group,
        };
        Ok(Response::from_parts(rparts, body.boxed_unsync()))
    }
}

impl Router {
    /// Send `req` to `t` and wait for the answer's head and its body's first frame (none
    /// for an empty body); a 5xx, with its body, is a failure to retry.
    async fn first_byte(
        &self,
        t: &Target,
        req: Request<Full<Bytes>>,
    ) -> Result<(http::response::Parts, Option<Frame<Bytes>>, Upstream), Failure> {
        let resp = client::exchange(t.addr, req, self.cfg.connect_timeout)
            .await
            .map_err(|e| match e {
                ExchangeError::Connect { .. } => {
                    Failure::Connect(format!("decode {} (group {}): {e}", t.pod, t.group))
                }
                ExchangeError::Closed { .. } => {
                    Failure::Closed(format!("decode {} (group {}): {e}", t.pod, t.group))
                }
            })?;
        let (rparts, mut rbody) = resp.into_parts();
        if rparts.status.is_server_error() {
            let body = tokio::time::timeout(
                ERROR_BODY_TIMEOUT,
                Limited::new(rbody, MAX_ERROR_BODY).collect(),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .map(|c| c.to_bytes())
            .unwrap_or_default();
            return Err(Failure::Status {
                parts: rparts,
                body,
            });
        }
        let first = match rbody.frame().await {
            None => None,
            Some(Ok(f)) => Some(f),
            Some(Err(e)) => {
                return Err(Failure::BodyBeforeFirstByte(format!(
                    "decode {} (group {}): the answer broke off before its first byte: {e}",
                    t.pod, t.group
                )));
            }
        };
        Ok((rparts, first, rbody))
    }
}

/// A decode's answer on its way to the client: the first frame (already read), then the
/// rest as it comes. Holds the decode's connection and its in-flight count until dropped.
struct Forwarded {
    first: Option<Frame<Bytes>>,
    rest: Upstream,
    _in_flight: InFlight,
    metrics: RouterMetrics,
    pod: String,
    group: i32,
}

impl hyper::body::Body for Forwarded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(f) = self.first.take() {
            return Poll::Ready(Some(Ok(f)));
        }
        match Pin::new(&mut self.rest).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => {
                self.metrics.broken_answers.inc();
                tracing::warn!(pod = %self.pod, group = self.group, "the decode's answer broke off after its first byte (not retried: the client has part of it): {e}");
                Poll::Ready(Some(Err(Box::new(e))))
            }
            other => other.map(|o| o.map(|r| r.map_err(|e| Box::new(e) as BoxError))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let n = self
            .first
            .as_ref()
            .and_then(|f| f.data_ref())
            .map_or(0, |d| d.len() as u64);
        let mut h = SizeHint::new();
        if let Some(u) = rest.upper() {
            h.set_upper(u + n);
        }
        h.set_lower(rest.lower() + n);
        h
    }
}
