//! The decodes the host lists, and what the router knows of each: its last report (load,
//! prefix-cache keys), its requests in flight from this router, whether it failed lately.
//! A poller asks every listed decode for its report every [`POLL_PERIOD`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, header};
use http_body_util::Full;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::client;
use crate::metrics::RouterMetrics;
use crate::policy::{Backend, Load};
use crate::prefix::Holdings;
use crate::report::{self, Report};

/// How often each decode is asked for its report.
pub const POLL_PERIOD: Duration = Duration::from_millis(250);
/// Longest a report may take.
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a decode that failed a request is tried after the others.
pub const COOLING: Duration = Duration::from_secs(1);
/// A report older than this is not trusted for load (the decode stopped answering):
/// only this router's own in-flight count is.
pub const STALE_REPORT: Duration = Duration::from_secs(3);

/// One decode as the host lists it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub pod: String,
    pub group: i32,
    /// The incarnation the decode serves at.
    pub incarnation: i64,
    pub addr: SocketAddr,
    /// The group's phase is Ready, at this current incarnation.
    pub group_ready: bool,
    pub group_incarnation: i64,
}

impl Target {
    pub fn eligible(&self) -> bool {
        self.group_ready && self.incarnation == self.group_incarnation
    }
}

/// What the host publishes whenever its view changes.
#[derive(Debug, Clone, Default)]
pub struct Targets {
    pub targets: Vec<Target>,
    /// Why nothing can be served, for the 503 body when no target is eligible.
    pub unavailable: String,
}

impl Targets {
    pub fn eligible(&self) -> usize {
        self.targets.iter().filter(|t| t.eligible()).count()
    }
}

/// A decode is the same one while its pod, incarnation and address are.
type Key = (String, i64, SocketAddr);

fn key(t: &Target) -> Key {
    (t.pod.clone(), t.incarnation, t.addr)
}

#[derive(Debug, Default)]
struct Known {
    report: Option<(Report, Instant)>,
    holdings: Holdings,
    /// The last report failed (logged once per spell).
    failing: bool,
    /// When the decode last answered a report call at all (a report, or an error status).
    last_answer: Option<Instant>,
    /// The last report call got no answer (timed out, refused, reset): it may be hung.
    unreachable: bool,
}

/// Why a decode is not to be waited on ([`TargetState::hung`]), with for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hung {
    /// Its reports say its engine has had work and made no step.
    EngineStalled(Duration),
    /// It answered report calls and now answers none: a process that stopped (SIGSTOP, a
    /// wedged runtime) or a network that drops its packets.
    Silent(Duration),
}

/// What the router knows of one decode.
#[derive(Debug, Default)]
pub struct TargetState {
    in_flight: AtomicU32,
    /// When (the fleet's clock, ms) its cooling ends; 0: not cooling.
    cooling_until: AtomicU64,
    known: Mutex<Known>,
}

/// Counts a request in flight until dropped.
pub struct InFlight(Arc<TargetState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl TargetState {
    pub fn start_request(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The prompt with `keys` was sent here.
    pub fn note_sent(&self, keys: &[u64], now_ms: u64) {
        self.known().holdings.note_sent(keys, now_ms);
    }

    /// How long its engine has had work without a step, as of now: its fresh report's
    /// figure plus the report's age (`None`: no fresh report, or not stalled then).
    pub fn engine_stalled_for(&self) -> Option<Duration> {
        let k = self.known();
        let (r, at) = k.report.as_ref()?;
        let age = at.elapsed();
        (age < STALE_REPORT && r.engine_stalled_ms > 0)
            .then(|| Duration::from_millis(r.engine_stalled_ms) + age)
    }

    /// How long this decode has answered no report call, when its last call went
    /// unanswered and an earlier one was answered (`None` otherwise: it answers, or it was
    /// never reached — a decode still starting is not silent). A decode that answers with
    /// an error status is not silent: it is alive, whatever its report says.
    pub fn silent_for(&self) -> Option<Duration> {
        let k = self.known();
        if !k.unreachable {
            return None;
        }
        k.last_answer.map(|at| at.elapsed())
    }

    /// Whether this decode is not to be waited on: its engine stalled, or it went silent,
    /// for `limit` or more (zero: never).
    pub fn hung(&self, limit: Duration) -> Option<Hung> {
        if limit.is_zero() {
            return None;
        }
        if let Some(d) = self.engine_stalled_for().filter(|d| *d >= limit) {
            return Some(Hung::EngineStalled(d));
        }
        self.silent_for().filter(|d| *d >= limit).map(Hung::Silent)
    }

    /// The policy's view of this decode for a prompt with `keys`; `stall_limit` is the
    /// router's (zero: stalls and silences ignored).
    pub fn backend(&self, t: &Target, keys: &[u64], now_ms: u64, stall_limit: Duration) -> Backend {
        let stalled = self.hung(stall_limit).is_some();
        let k = self.known();
        let fresh = k
            .report
            .as_ref()
            .filter(|(_, at)| at.elapsed() < STALE_REPORT)
            .map(|(r, _)| r);
        Backend {
            group: t.group,
            incarnation: t.incarnation,
            group_ready: t.group_ready,
            group_incarnation: t.group_incarnation,
            cached_blocks: k.holdings.matched(keys, now_ms),
            load: Load {
                queued: fresh.map_or(0, |r| r.waiting),
                running: fresh.map_or(0, |r| r.running),
                kv_usage: fresh.map_or(0.0, |r| r.kv_cache_usage),
                in_flight: self.in_flight(),
            },
            cooling: self.cooling_until.load(Ordering::Relaxed) > now_ms,
            stalled,
        }
    }
}

/// Every listed decode's state.
pub struct Fleet {
    start: Instant,
    states: Mutex<HashMap<Key, Arc<TargetState>>>,
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            states: Mutex::new(HashMap::new()),
        }
    }
}

impl Fleet {
    /// The fleet's clock (ms since it was made), for prefix holdings and cooling.
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The state of each of `targets`, in order (made for new ones; the states of decodes
    /// no longer listed are dropped).
    pub fn states(&self, targets: &[Target]) -> Vec<Arc<TargetState>> {
        let mut m = self.states.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() > targets.len() {
            m.retain(|k, _| targets.iter().any(|t| key(t) == *k));
        }
        targets
            .iter()
            .map(|t| m.entry(key(t)).or_default().clone())
            .collect()
    }

    /// `state` failed a request: try it after the others for [`COOLING`].
    pub fn cool(&self, state: &TargetState) {
        state.cooling_until.store(
            self.now_ms() + COOLING.as_millis() as u64,
            Ordering::Relaxed,
        );
    }
}

/// What the poller needs to ask decodes for their reports.
#[derive(Clone)]
pub struct Poller {
    pub fleet: Arc<Fleet>,
    pub targets: watch::Receiver<Arc<Targets>>,
    pub metrics: RouterMetrics,
    /// `Authorization` for the decodes, when they have API keys (`Bearer <key>`).
    pub authorization: Option<HeaderValue>,
}

impl Poller {
    /// Ask every listed decode for its report every [`POLL_PERIOD`], until dropped.
    pub async fn run(self) {
        let mut tick = tokio::time::interval(POLL_PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let targets = self.targets.borrow().clone();
            let states = self.fleet.states(&targets.targets);
            let mut polls = JoinSet::new();
            for (t, s) in targets.targets.iter().zip(states) {
                polls.spawn(self.clone().poll_one(t.clone(), s));
            }
            while polls.join_next().await.is_some() {}
        }
    }

    async fn poll_one(self, t: Target, state: Arc<TargetState>) {
        let since = state.known().holdings.version();
        let path = match since {
            Some(v) => format!("{}?since={v}", tandem_contract::routing::REPORT_PATH),
            None => tandem_contract::routing::REPORT_PATH.to_string(),
        };
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(path)
            .header(header::HOST, t.addr.to_string());
        if let Some(v) = &self.authorization {
            req = req.header(header::AUTHORIZATION, v.clone());
        }
        let Ok(req) = req.body(Full::new(Bytes::new())) else {
            return;
        };
        let got = match client::fetch(t.addr, req, REPORT_TIMEOUT).await {
            Ok((s, body)) if s.is_success() => report::parse_report(&body)
                .map_err(|e| ("invalid", e.to_string()))
                .and_then(|r| {
                    let keys = match &r.keys {
                        Some(k) => {
                            Some(report::parse_keys(k).map_err(|e| ("invalid", e.to_string()))?)
                        }
                        None => None,
                    };
                    Ok((r, keys))
                }),
            Ok((s, body)) => Err((
                "status",
                format!(
                    "{}: {}",
                    s.as_u16(),
                    String::from_utf8_lossy(&body[..body.len().min(200)])
                ),
            )),
            Err(e) => Err(("unreachable", e)),
        };
        let now_ms = self.fleet.now_ms();
        let mut k = state.known();
        k.unreachable = matches!(got, Err(("unreachable", _)));
        if !k.unreachable {
            k.last_answer = Some(Instant::now());
        }
        match got {
            Ok((r, keys)) => {
                if k.failing {
                    tracing::info!(pod = %t.pod, group = t.group, "decode reports again");
                }
                k.failing = false;
                if let Some(keys) = keys {
                    k.holdings.publish(r.prefix_version, keys, now_ms);
                } else if since != Some(r.prefix_version) {
                    // No keys for a version other than the one held: ask for them in full.
                    k.holdings = Holdings::default();
                }
                k.report = Some((r, Instant::now()));
            }
            Err((reason, why)) => {
                self.metrics.report_failed(reason);
                if !k.failing {
                    tracing::warn!(pod = %t.pod, group = t.group, addr = %t.addr, reason, "decode report failed: {why}; routing to it by this router's own counts until it reports again");
                }
                k.failing = true;
            }
        }
    }
}
