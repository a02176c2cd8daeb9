//! The fault matrix's harness: a restartable prefill/decode pair, a trial (a steady load and
//! a readiness monitor on the process clients talk to, measured around one fault), and the
//! samples of counters and logs that name a fault.

use std::time::{Duration, Instant};

use super::common::load::{Load, Monitor, Outcome};
use super::common::{Server, find_sample, free_port};
use super::{STABLE, env, load_body};

/// One row of the table.
#[derive(Debug, Default, Clone)]
pub(crate) struct Row {
    pub(crate) fault: String,
    pub(crate) visible: Option<Duration>,
    /// How it became visible first: `ready:<reason>`, `client:<code>`, `counter`.
    pub(crate) seen_as: String,
    pub(crate) healed: Option<Duration>,
    pub(crate) errors: usize,
    pub(crate) hung: usize,
    pub(crate) leaked: f64,
    pub(crate) log: String,
    pub(crate) counter: String,
    pub(crate) note: String,
}

/// A prefill and its decode, restartable in place (same KV port, same HTTP port).
pub(crate) struct Pd {
    pub(crate) prefill: Server,
    pub(crate) decode: Server,
    pub(crate) kv: u16,
}

pub(crate) fn spawn_prefill(kv: u16, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let kv = kv.to_string();
    let mut args = vec!["--fault-injection"];
    args.extend_from_slice(extra);
    Server::spawn(&["--role", "prefill", "--kv-port", &kv], &args, env)
}

pub(crate) fn spawn_decode(
    port: Option<u16>,
    kv: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Server {
    let peer = format!("127.0.0.1:{kv}");
    let mut args = vec!["--fault-injection"];
    args.extend_from_slice(extra);
    let role = ["--role", "decode", "--prefill", &peer];
    match port {
        Some(p) => Server::spawn_on(p, &role, &args, env),
        None => Server::spawn(&role, &args, env),
    }
}

impl Pd {
    pub(crate) fn start(decode_extra: &[&str]) -> Self {
        let kv = free_port();
        let mut prefill = spawn_prefill(kv, &[], &env());
        prefill.wait_ready();
        let mut decode = spawn_decode(None, kv, decode_extra, &env());
        decode.wait_ready();
        Self {
            prefill,
            decode,
            kv,
        }
    }

    /// SIGKILL the prefill, start another on the same KV port (not waiting).
    pub(crate) fn replace_prefill(&mut self, extra: &[&str], env: &[(&str, &str)]) {
        let _ = self.prefill.child.kill();
        let _ = self.prefill.child.wait();
        self.prefill = spawn_prefill(self.kv, extra, env);
    }
}

/// The load and the monitor on the process clients talk to, warmed up.
pub(crate) struct Trial {
    load: Load,
    monitor: Monitor,
}

impl Trial {
    pub(crate) fn begin(target: &Server) -> Self {
        let monitor = Monitor::start(target.addr);
        let load = Load::start(target.addr, 2, load_body());
        let t = Instant::now();
        while !load.since(t).iter().any(Outcome::ok) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the load never succeeded"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { load, monitor }
    }

    /// Close the trial: `fault_at` when the fault began, `fault_end` when it ended (the
    /// cause removed or the replacement started), `counter_moved` when the named counter
    /// was first seen to move (if measured).
    pub(crate) fn end(
        self,
        row: &mut Row,
        fault_at: Instant,
        fault_end: Instant,
        counter_moved: Option<Instant>,
    ) {
        let not_ready = self.monitor.first_not_ready(fault_at);
        // Healed: the first stretch of readiness after the fault ended that lasts (a stale
        // "ready" before the fault shows is not healing), then a request started after its
        // start succeeded.
        let deadline = Instant::now() + Duration::from_secs(60);
        let ready_at = loop {
            if let Some(t) = self.monitor.stable_ready_since(fault_end, STABLE) {
                break Some(t);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(r) = ready_at {
            let ok_after = loop {
                let hit = self
                    .load
                    .since(r)
                    .into_iter()
                    .find(|o| o.ok() && o.started >= r);
                if hit.is_some() || Instant::now() > deadline {
                    break hit;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            // Healed when both hold: ready for good, and requests succeed again.
            if let Some(ok) = ok_after {
                row.healed = Some(r.max(ok.started).saturating_duration_since(fault_end));
            }
        }
        let outcomes = self.load.stop();
        let window: Vec<&Outcome> = outcomes.iter().filter(|o| o.ended >= fault_at).collect();
        row.errors = window.iter().filter(|o| !o.ok()).count();
        row.hung = outcomes.iter().filter(|o| o.hung).count();
        let first_error = window
            .iter()
            .filter(|o| !o.ok())
            .min_by_key(|o| o.ended)
            .map(|o| (o.ended, format!("client:{}", o.code)));
        let candidates = [
            not_ready.map(|(t, r)| (t, format!("ready:{r}"))),
            first_error,
            counter_moved.map(|t| (t, "counter".to_owned())),
        ];
        if let Some((t, how)) = candidates.into_iter().flatten().min_by_key(|(t, _)| *t) {
            row.visible = Some(t.saturating_duration_since(fault_at));
            row.seen_as = how;
        }
    }
}

/// A series' value, if the server answers and has it.
pub(crate) fn sample(s: &Server, prefix: &str) -> Option<f64> {
    let mut st = std::net::TcpStream::connect_timeout(&s.addr, Duration::from_millis(500)).ok()?;
    drop(st.set_read_timeout(Some(Duration::from_secs(2))));
    use std::io::{Read, Write};
    write!(
        st,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut all = String::new();
    let _ = st.read_to_string(&mut all);
    find_sample(&all, prefix)
}

/// Poll until the series exceeds `before`; when it did.
pub(crate) fn wait_counter(
    s: &Server,
    prefix: &str,
    before: f64,
    limit: Duration,
) -> Option<Instant> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if sample(s, prefix).is_some_and(|v| v > before) {
            return Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// After the load stopped: KV blocks still used on the given servers once they had 10 s
/// to release them (0 expected).
pub(crate) fn leaked(servers: &[&Server]) -> f64 {
    let mut left = 0.0;
    for s in servers {
        let t = Instant::now();
        loop {
            let used = sample(s, "tandem_kv_blocks_used ").unwrap_or(f64::NAN);
            let held: f64 = s
                .get("/metrics")
                .body
                .lines()
                .filter(|l| l.starts_with("tandem_kv_transfer_blocks_held{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            if used == 0.0 && held == 0.0 {
                break;
            }
            if t.elapsed() > Duration::from_secs(10) {
                left += used + held;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    left
}

/// The fault was named: its log line is in `s`'s log and its counter moved.
pub(crate) fn named(row: &mut Row, s: &Server, log_needles: &[&str], counter: &str, before: f64) {
    row.log = log_needles[0].to_owned();
    row.counter = counter.trim().to_owned();
    let has_line = !s.log_lines(log_needles).is_empty();
    let moved = sample(s, counter).is_some_and(|v| v > before);
    if !has_line {
        row.note.push_str(&format!("no log line {log_needles:?}; "));
    }
    if !moved {
        row.note
            .push_str(&format!("counter {counter:?} did not move; "));
    }
}

pub(crate) fn inject(s: &Server, query: &str) {
    let r = super::common::request(s.addr, "POST", &format!("/debug/fault?{query}"), Some(""));
    assert_eq!(r.status, 200, "{}", r.body);
}
