//! A steady client load and a readiness monitor for fault tests, recording everything with
//! timestamps: which requests ended (and how), which never did, when `/ready` flipped.
//! Nothing here panics on a failed request: failures are the data.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How one request ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub started: Instant,
    pub ended: Instant,
    /// HTTP status, or 0 when there was no HTTP answer (connection refused or cut).
    pub status: u16,
    /// The error code of a failed request (`error.code`, or the transport error).
    pub code: String,
    /// Never ended within the client's limit.
    pub hung: bool,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.status == 200 && !self.hung
    }
}

/// Longest a request may take before it counts as never ended.
pub const HANG_LIMIT: Duration = Duration::from_secs(60);

/// One request with every step bounded; never panics.
pub fn try_request(addr: SocketAddr, path: &str, body: &str) -> Outcome {
    let started = Instant::now();
    let fail = |code: &str, hung: bool| Outcome {
        started,
        ended: Instant::now(),
        status: 0,
        code: code.to_owned(),
        hung,
    };
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) => return fail(&format!("connect: {}", e.kind()), false),
    };
    let _ = s.set_read_timeout(Some(HANG_LIMIT));
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    if let Err(e) = s.write_all(head.as_bytes()) {
        return fail(&format!("write: {}", e.kind()), false);
    }
    let mut r = BufReader::new(s);
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) => return fail("closed before answering", false),
        Ok(_) => {}
        Err(e) if is_timeout(&e) => return fail("no answer", true),
        Err(e) => return fail(&format!("read: {}", e.kind()), false),
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut rest = String::new();
    let body = match r.read_to_string(&mut rest) {
        Ok(_) => rest,
        Err(e) if is_timeout(&e) => return fail("body never ended", true),
        Err(_) => rest,
    };
    let code = if status == 200 {
        String::new()
    } else {
        body.find("\"code\":\"")
            .map(|i| {
                let tail = &body[i + 8..];
                tail[..tail.find('"').unwrap_or(0)].to_owned()
            })
            .unwrap_or_else(|| format!("http {status}"))
    };
    Outcome {
        started,
        ended: Instant::now(),
        status,
        code,
        hung: false,
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// How long a probe waits for the answer: the kubelet's default `timeoutSeconds`, which a
/// probe of the same process on a cluster would allow.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// `GET /ready` as a kubelet probes it: `Some(reason)` when not ready — `"unreachable"`
/// when the connection fails, `"no_answer"` when the process takes the connection and
/// answers nothing within [`PROBE_TIMEOUT`] (a stopped process: its kernel still accepts)
/// — `None` when ready.
pub fn probe(addr: SocketAddr) -> Option<String> {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return Some("unreachable".into());
    };
    let _ = s.set_read_timeout(Some(PROBE_TIMEOUT));
    let head = format!("GET /ready HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(head.as_bytes()).is_err() {
        return Some("unreachable".into());
    }
    let mut all = String::new();
    let read = s.read_to_string(&mut all);
    if all.starts_with("HTTP/1.1 200") {
        return None;
    }
    if all.is_empty() && read.as_ref().is_err_and(is_timeout) {
        return Some("no_answer".into());
    }
    let body = all.split("\r\n\r\n").nth(1).unwrap_or("");
    let reason = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["reason"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "unreachable".into());
    Some(reason)
}

/// Clients sending requests one after another (with a short pause) to a target that can
/// be switched (a restarted server comes back on the same port, so it rarely is).
pub struct Load {
    stop: Arc<AtomicBool>,
    pub outcomes: Arc<Mutex<Vec<Outcome>>>,
    in_flight: Arc<Mutex<Vec<Instant>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    pub fn start(addr: SocketAddr, clients: usize, body: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let in_flight = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..clients)
            .map(|_| {
                let (stop, outcomes, in_flight, body) = (
                    stop.clone(),
                    outcomes.clone(),
                    in_flight.clone(),
                    body.clone(),
                );
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        in_flight.lock().unwrap().push(t);
                        let o = try_request(addr, "/v1/completions", &body);
                        in_flight.lock().unwrap().retain(|s| *s != t);
                        let failed = !o.ok();
                        outcomes.lock().unwrap().push(o);
                        // A failing target answers at once: pace the retries.
                        let pause = if failed { 200 } else { 50 };
                        std::thread::sleep(Duration::from_millis(pause));
                    }
                })
            })
            .collect();
        Self {
            stop,
            outcomes,
            in_flight,
            threads,
        }
    }

    /// Outcomes of requests that ended at or after `since`.
    pub fn since(&self, since: Instant) -> Vec<Outcome> {
        self.outcomes
            .lock()
            .unwrap()
            .iter()
            .filter(|o| o.ended >= since)
            .cloned()
            .collect()
    }

    /// Stop sending; wait for the requests in flight (each bounded by `HANG_LIMIT`).
    pub fn stop(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        assert!(self.in_flight.lock().unwrap().is_empty());
        Arc::try_unwrap(self.outcomes)
            .map(|m| m.into_inner().unwrap())
            .unwrap_or_else(|a| a.lock().unwrap().clone())
    }
}

/// Readiness changes: (when, `None` = ready / `Some(reason)`).
type Changes = Arc<Mutex<Vec<(Instant, Option<String>)>>>;

/// Polls `/ready` every 50 ms and keeps every change.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    pub changes: Changes,
    thread: Option<JoinHandle<()>>,
}

impl Monitor {
    pub fn start(addr: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let changes = Arc::new(Mutex::new(Vec::new()));
        let (s, c) = (stop.clone(), changes.clone());
        let thread = std::thread::spawn(move || {
            let mut last: Option<Option<String>> = None;
            while !s.load(Ordering::Relaxed) {
                let now = probe(addr);
                if last.as_ref() != Some(&now) {
                    c.lock().unwrap().push((Instant::now(), now.clone()));
                    last = Some(now);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Self {
            stop,
            changes,
            thread: Some(thread),
        }
    }

    /// First time at or after `since` that readiness was lost, with the reason.
    pub fn first_not_ready(&self, since: Instant) -> Option<(Instant, String)> {
        let c = self.changes.lock().unwrap();
        // The state at `since` counts too (a change just before it).
        let at_since = c
            .iter()
            .rev()
            .find(|(t, _)| *t <= since)
            .and_then(|(_, r)| r.clone())
            .map(|r| (since, r));
        at_since.or_else(|| {
            c.iter()
                .find(|(t, r)| *t >= since && r.is_some())
                .map(|(t, r)| (*t, r.clone().unwrap()))
        })
    }

    /// Start of the first period at or after `since` in which the target was ready for at
    /// least `stable` without a break (a blip of readiness before the fault shows does not
    /// count as healed). `None` while there is none yet.
    pub fn stable_ready_since(&self, since: Instant, stable: Duration) -> Option<Instant> {
        let c = self.changes.lock().unwrap();
        // (start, ready) intervals from `since` on.
        let mut points: Vec<(Instant, bool)> = Vec::new();
        if let Some((_, r)) = c.iter().rev().find(|(t, _)| *t <= since) {
            points.push((since, r.is_none()));
        }
        points.extend(
            c.iter()
                .filter(|(t, _)| *t > since)
                .map(|(t, r)| (*t, r.is_none())),
        );
        let now = Instant::now();
        for (i, &(t, ready)) in points.iter().enumerate() {
            if !ready {
                continue;
            }
            let until = points.get(i + 1).map_or(now, |p| p.0);
            if until.duration_since(t) >= stable {
                return Some(t);
            }
        }
        None
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
