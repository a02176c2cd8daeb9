//! A steady client, as a user's traffic is during a fault: one request every
//! `period`, each on its own task with its own timeout, every outcome kept with when it
//! was sent and answered. [`recovery`] turns the outcomes after a fault into the
//! recovery table's per-request columns (BENCHMARKS.md), with the definitions
//! `scripts/bench_recovery.py` uses on the local runtime, over the requests the fault could
//! touch — sent after it, or in flight when it came (a request sent just before a decode
//! stops is the fault's too):
//! - refused after: from the fault to the first answer that refuses a request (a non-200
//!   status with a reason);
//! - longest wait: the longest any of them waited for its answer (a request that timed out
//!   counts its timeout);
//! - served again: from the fault to the first answer of the requests sent after the last
//!   failed one (zero when none failed);
//! - failed: those not answered 200.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::task::JoinHandle;

use crate::http;

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// A non-200 answer: its status and the error's `code` (or `type`) when the body says.
    Refused(u16, String),
    /// No answer within the request's timeout.
    Timeout,
    /// The connection failed (refused, reset).
    Error,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ok => write!(f, "ok"),
            Self::Refused(status, code) => write!(f, "refused {status} {code}"),
            Self::Timeout => write!(f, "timeout"),
            Self::Error => write!(f, "connection error"),
        }
    }
}

/// One request: when it was sent and answered (offsets from the load's start).
#[derive(Debug, Clone)]
pub struct Sample {
    pub sent: Duration,
    pub ended: Duration,
    pub outcome: Outcome,
}

/// The per-request columns of a fault (see the module header); times in seconds from it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    pub refused_after: Option<f64>,
    pub longest_wait: f64,
    pub served_again: Option<f64>,
    pub failed: usize,
    pub requests: usize,
    /// The failed requests by outcome: how many, and when the first and the last of them
    /// were sent (seconds from the fault).
    pub outcomes: BTreeMap<String, Failed>,
}

/// The failed requests of one outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Failed {
    pub count: usize,
    pub first_sent: f64,
    pub last_sent: f64,
}

impl fmt::Display for Recovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |x: Option<f64>| x.map(|x| format!("{x:.2} s")).unwrap_or_else(|| "–".into());
        write!(
            f,
            "refused after {}, longest wait {:.2} s, served again {}, failed {} of {}",
            s(self.refused_after),
            self.longest_wait,
            s(self.served_again),
            self.failed,
            self.requests
        )?;
        if !self.outcomes.is_empty() {
            let o: Vec<String> = self
                .outcomes
                .iter()
                .map(|(o, n)| {
                    format!(
                        "{o} ×{} sent {:.1}–{:.1} s",
                        n.count, n.first_sent, n.last_sent
                    )
                })
                .collect();
            write!(f, ": {}", o.join(", "))?;
        }
        Ok(())
    }
}

/// The columns of the requests the fault at `fault` (an offset from the load's start) could
/// touch — sent at or after it, or in flight then — each request's wait capped at
/// `timeout`.
pub fn recovery(samples: &[Sample], fault: Duration, timeout: Duration) -> Recovery {
    let post: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.sent >= fault || s.ended > fault)
        .collect();
    let after = |d: Duration| d.saturating_sub(fault).as_secs_f64();
    let bad: Vec<&&Sample> = post.iter().filter(|s| s.outcome != Outcome::Ok).collect();
    let last_bad = bad.iter().map(|s| s.sent).max();
    let served_again = match last_bad {
        None => Some(0.0),
        Some(last) => post
            .iter()
            .filter(|s| s.outcome == Outcome::Ok && s.sent > last)
            .map(|s| s.ended)
            .min()
            .map(after),
    };
    Recovery {
        refused_after: post
            .iter()
            .filter(|s| matches!(s.outcome, Outcome::Refused(..)))
            .map(|s| s.ended)
            .min()
            .map(after),
        longest_wait: post
            .iter()
            .map(|s| s.ended.saturating_sub(s.sent).min(timeout).as_secs_f64())
            .fold(0.0, f64::max),
        served_again,
        failed: bad.len(),
        requests: post.len(),
        outcomes: bad.iter().fold(BTreeMap::new(), |mut m, s| {
            let at = after(s.sent);
            m.entry(s.outcome.to_string())
                .and_modify(|n: &mut Failed| {
                    n.count += 1;
                    n.first_sent = n.first_sent.min(at);
                    n.last_sent = n.last_sent.max(at);
                })
                .or_insert(Failed {
                    count: 1,
                    first_sent: at,
                    last_sent: at,
                });
            m
        }),
    }
}

/// A steady client POSTing `body(n)` as its `n`th request to `http://<addr><path>` (a
/// Service's ClusterIP and port), running until [`Load::stop`].
pub struct Load {
    start: Instant,
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<AtomicBool>,
    task: Option<JoinHandle<()>>,
}

/// A load dropped unstopped (its scenario failed) stops sending: no request of it reaches
/// a later scenario's cluster beyond those in flight.
impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Load {
    pub fn start(
        addr: &str,
        path: &str,
        body: impl Fn(u64) -> Value + Send + Sync + 'static,
        period: Duration,
        timeout: Duration,
    ) -> Self {
        let start = Instant::now();
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (addr, path) = (addr.to_owned(), path.to_owned());
        let task = {
            let (samples, stop) = (samples.clone(), stop.clone());
            tokio::spawn(async move {
                let mut requests = Vec::new();
                let mut tick = tokio::time::interval(period);
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    let (addr, path, body, samples) =
                        (addr.clone(), path.clone(), body(n), samples.clone());
                    n += 1;
                    requests.push(tokio::spawn(async move {
                        let sent = start.elapsed();
                        let outcome = one(&addr, &path, &body, timeout).await;
                        let ended = start.elapsed();
                        samples
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(Sample {
                                sent,
                                ended,
                                outcome,
                            });
                    }));
                }
                // Every request sent is answered or times out: none is left out.
                for r in requests {
                    let _ = r.await;
                }
            })
        };
        Self {
            start,
            samples,
            stop,
            task: Some(task),
        }
    }

    /// Now, as an offset from the load's start (the time of a fault).
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// Stop sending, wait for every request sent to end; every sample, in sending order.
    pub async fn stop(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        let mut samples =
            std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()));
        samples.sort_by_key(|s| s.sent);
        samples
    }
}

/// One request; an error answer's reason is its OpenAI-style `error.code` (or `type`).
async fn one(addr: &str, path: &str, body: &Value, timeout: Duration) -> Outcome {
    match http::post_json(addr, path, body, timeout).await {
        Ok(r) if r.status == 200 => Outcome::Ok,
        Ok(r) => {
            let v: Value = serde_json::from_str(&r.body).unwrap_or_default();
            let e = &v["error"];
            let code = e["code"]
                .as_str()
                .or_else(|| e["type"].as_str())
                .unwrap_or("no reason in the body");
            Outcome::Refused(r.status, code.to_owned())
        }
        Err(e) if format!("{e:#}").contains("no answer within") => Outcome::Timeout,
        Err(_) => Outcome::Error,
    }
}

#[cfg(test)]
mod tests;
