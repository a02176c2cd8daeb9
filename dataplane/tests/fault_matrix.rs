//! The fault matrix: every fault against real processes (the real binary and model) under
//! a steady client load, measured. Per fault: time until it is visible (`/ready` false on
//! the process clients talk to, a client error, or the named counter moving, whichever is
//! first), time until healed after the fault ends (`/ready` true again, then a request
//! succeeds), requests that ended in error, requests that never ended, KV blocks left
//! used on either side once the load stops, and the log line and counter that named it.
//!
//! `cargo test --test fault_matrix` runs each fault once and asserts what must always hold
//! (nothing left hanging, no KV block leaked, the fault named by its log line and counter,
//! healed); the timing targets (visible within 2 probe periods, healed within 10 s) are
//! printed next to the figures, not asserted. `make faults` runs it in release with
//! `TANDEM_FAULTS_REPS=3` and prints the table for BENCHMARKS.md.

mod common;

use std::time::{Duration, Instant};

use common::load::{Load, Monitor, Outcome, try_request};
use common::{MODEL_NAME, NetPair, OtherModel, Server, find_sample, free_port};
use serde_json::json;

/// Probe period and failure threshold of every pair here: not-ready within 1 s.
const PROBE: Duration = Duration::from_millis(500);
const VISIBLE_TARGET: Duration = Duration::from_secs(1);
const HEALED_TARGET: Duration = Duration::from_secs(10);
/// Readiness that lasts this long after a fault counts as healed.
const STABLE: Duration = Duration::from_secs(2);

fn env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("TANDEM_GROUP_KEY", common::GROUP_KEY),
        ("TANDEM_GROUP_INCARNATION", "7"),
        ("TANDEM_PROBE_PERIOD_SECONDS", "0.5"),
        ("TANDEM_FAILURE_THRESHOLD", "2"),
        ("TANDEM_BOOTSTRAP_TIMEOUT_SECONDS", "2"),
        ("TANDEM_KV_TIMEOUT_SECONDS", "3"),
        ("TANDEM_DRAIN_SECONDS", "2"),
        ("TANDEM_ALLOW_FAULT_INJECTION", "yes"),
    ]
}

fn with(over: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut e = env();
    for (k, v) in over {
        e.retain(|(ek, _)| ek != k);
        e.push((k, v));
    }
    e
}

fn load_body() -> String {
    json!({"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4,
           "temperature": 0})
    .to_string()
}

/// One row of the table.
#[derive(Debug, Default, Clone)]
struct Row {
    fault: String,
    visible: Option<Duration>,
    /// How it became visible first: `ready:<reason>`, `client:<code>`, `counter`.
    seen_as: String,
    healed: Option<Duration>,
    errors: usize,
    hung: usize,
    leaked: f64,
    log: String,
    counter: String,
    note: String,
}

/// A prefill and its decode, restartable in place (same KV port, same HTTP port).
struct Pd {
    prefill: Server,
    decode: Server,
    kv: u16,
}

fn spawn_prefill(kv: u16, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let kv = kv.to_string();
    let mut args = vec!["--fault-injection"];
    args.extend_from_slice(extra);
    Server::spawn(&["--role", "prefill", "--kv-port", &kv], &args, env)
}

fn spawn_decode(port: Option<u16>, kv: u16, extra: &[&str], env: &[(&str, &str)]) -> Server {
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
    fn start(decode_extra: &[&str]) -> Self {
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
    fn replace_prefill(&mut self, extra: &[&str], env: &[(&str, &str)]) {
        let _ = self.prefill.child.kill();
        let _ = self.prefill.child.wait();
        self.prefill = spawn_prefill(self.kv, extra, env);
    }
}

/// The load and the monitor on the process clients talk to, warmed up.
struct Trial {
    load: Load,
    monitor: Monitor,
}

impl Trial {
    fn begin(target: &Server) -> Self {
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
    fn end(
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
fn sample(s: &Server, prefix: &str) -> Option<f64> {
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
fn wait_counter(s: &Server, prefix: &str, before: f64, limit: Duration) -> Option<Instant> {
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
fn leaked(servers: &[&Server]) -> f64 {
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
fn named(row: &mut Row, s: &Server, log_needles: &[&str], counter: &str, before: f64) {
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

fn inject(s: &Server, query: &str) {
    let r = common::request(s.addr, "POST", &format!("/debug/fault?{query}"), Some(""));
    assert_eq!(r.status, 200, "{}", r.body);
}

// ---- the faults ----------------------------------------------------------------------

fn loop_panic(pd: &mut Pd, side: &str) -> Row {
    let (server, loop_name) = match side {
        "decode" => (&pd.decode, "kv_peer_0"),
        _ => (&pd.prefill, "kv_router"),
    };
    let mut row = Row {
        fault: format!("{side} KV loop panic"),
        ..Row::default()
    };
    let counter = format!("tandem_kv_loop_restarts_total{{loop=\"{loop_name}\"}} ");
    let before = sample(server, &counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    inject(server, &format!("loop={loop_name}&fault=panic"));
    let moved = wait_counter(server, &counter, before, Duration::from_secs(5));
    trial.end(&mut row, at, Instant::now(), moved);
    named(&mut row, server, &["KV loop panicked"], &counter, before);
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn garbage(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "garbage on the KV socket".into(),
        ..Row::default()
    };
    let counter = "tandem_kv_malformed_messages_total{kind=\"bad_magic\"} ";
    let before = sample(&pd.prefill, counter).unwrap_or(0.0);
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    // ZeroMQ frames of junk, then raw bytes that are not even ZMTP.
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.connect(&format!("tcp://127.0.0.1:{}", pd.kv)).unwrap();
    for i in 0..200u32 {
        let junk: Vec<u8> = (0..64).map(|j| (i * 31 + j) as u8).collect();
        s.send_multipart(
            [b"XXXXjunkjunkjunkjunkjunkjunkjunkjunk".as_slice(), &junk],
            0,
        )
        .unwrap();
    }
    if let Ok(mut raw) = std::net::TcpStream::connect(("127.0.0.1", pd.kv)) {
        use std::io::Write;
        let _ = raw.write_all(&[0xAB; 4096]);
    }
    let moved = wait_counter(&pd.prefill, counter, before, Duration::from_secs(5));
    trial.end(&mut row, at, Instant::now(), moved);
    named(
        &mut row,
        &pd.prefill,
        &["malformed KV message dropped"],
        counter,
        before,
    );
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn prefill_restart(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "prefill restart (SIGKILL, new process)".into(),
        ..Row::default()
    };
    let counter = "tandem_kv_peer_incarnation_changes_total ";
    let before = sample(&pd.decode, counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    pd.replace_prefill(&[], &env());
    let end = Instant::now();
    let moved = wait_counter(&pd.decode, counter, before, Duration::from_secs(60));
    trial.end(&mut row, at, end, moved);
    named(
        &mut row,
        &pd.decode,
        &["prefill restarted"],
        counter,
        before,
    );
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn decode_restart(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "decode restart (SIGKILL, new process)".into(),
        ..Row::default()
    };
    let counter = "tandem_kv_sessions_dropped_total{reason=\"expired\"} ";
    let before = sample(&pd.prefill, counter).unwrap();
    let port = pd.decode.addr.port();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    let _ = pd.decode.child.kill();
    let _ = pd.decode.child.wait();
    std::thread::sleep(Duration::from_millis(200));
    pd.decode = spawn_decode(Some(port), pd.kv, &[], &env());
    let end = Instant::now();
    let moved = wait_counter(&pd.prefill, counter, before, Duration::from_secs(30));
    trial.end(&mut row, at, end, moved);
    named(
        &mut row,
        &pd.prefill,
        &["decode session dropped", "expired"],
        counter,
        before,
    );
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn prefill_hang(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "prefill hang (SIGSTOP 4 s, SIGCONT)".into(),
        ..Row::default()
    };
    let counter = "tandem_kv_rooms_total{state=\"failed\",reason=\"kv_timeout\"} ";
    let before = sample(&pd.decode, counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    pd.prefill.signal("STOP");
    std::thread::sleep(Duration::from_secs(4));
    pd.prefill.signal("CONT");
    let end = Instant::now();
    trial.end(&mut row, at, end, None);
    // The decode says why it was not ready (probe_timeout) and fails rooms that waited
    // past the KV timeout; a hang shorter than that fails none.
    named(
        &mut row,
        &pd.decode,
        &["room failed", "kv_timeout"],
        counter,
        before,
    );
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

/// Replace the prefill with one that the decode must refuse (or that refuses it), then
/// with a good one again.
fn mismatch(
    pd: &mut Pd,
    name: &str,
    reason: &str,
    log: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Row {
    let mut row = Row {
        fault: name.into(),
        ..Row::default()
    };
    let counter = format!("tandem_kv_handshakes_total{{result=\"{reason}\"}} ");
    let before = sample(&pd.decode, &counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    pd.replace_prefill(extra, env);
    let moved = wait_counter(&pd.decode, &counter, before, Duration::from_secs(60));
    // Held for a moment with the reason in /ready, then the group is made whole again.
    let reason_seen = pd
        .decode
        .ready_body()
        .get("reason")
        .and_then(|r| r.as_str().map(str::to_owned));
    if reason_seen.as_deref() != Some(reason) {
        row.note.push_str(&format!(
            "/ready reason {reason_seen:?}, expected {reason}; "
        ));
    }
    pd.replace_prefill(&[], &self::env());
    let end = Instant::now();
    trial.end(&mut row, at, end, moved);
    named(&mut row, &pd.decode, &[log, reason], &counter, before);
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn sigterm_prefill(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "SIGTERM prefill (drain 2 s)".into(),
        ..Row::default()
    };
    let counter = "tandem_kv_peer_goodbyes_total ";
    let before = sample(&pd.decode, counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    let (took, st) = pd.prefill.sigterm_and_wait(Duration::from_secs(10));
    if !st.success() || took > Duration::from_secs(3) {
        row.note
            .push_str(&format!("bad exit: prefill {st} after {took:?}; "));
    }
    pd.prefill = spawn_prefill(pd.kv, &[], &env());
    let end = Instant::now();
    trial.end(&mut row, at, end, None);
    named(
        &mut row,
        &pd.decode,
        &["prefill is leaving"],
        counter,
        before,
    );
    row.note
        .push_str(&format!("exit 0 in {:.2} s; ", took.as_secs_f64()));
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn sigterm_decode(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "SIGTERM decode (drain 2 s)".into(),
        ..Row::default()
    };
    let counter = "tandem_kv_sessions_dropped_total{reason=\"peer_shutdown\"} ";
    let before = sample(&pd.prefill, counter).unwrap();
    let port = pd.decode.addr.port();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    let (took, st) = pd.decode.sigterm_and_wait(Duration::from_secs(10));
    if !st.success() || took > Duration::from_secs(3) {
        row.note
            .push_str(&format!("bad exit: decode {st} after {took:?}; "));
    }
    pd.decode = spawn_decode(Some(port), pd.kv, &[], &env());
    let end = Instant::now();
    trial.end(&mut row, at, end, None);
    named(
        &mut row,
        &pd.prefill,
        &["decode said goodbye"],
        counter,
        before,
    );
    row.note
        .push_str(&format!("exit 0 in {:.2} s; ", took.as_secs_f64()));
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn slow_loris(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "slow-loris HTTP clients (50, header timeout 2 s)".into(),
        ..Row::default()
    };
    let counter = "tandem_http_connection_errors_total{kind=\"timeout\"} ";
    let before = sample(&pd.decode, counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    // Each sends a request head one byte at a time, a byte per 500 ms, and never ends it.
    let addr = pd.decode.addr;
    let loris: Vec<_> = (0..50)
        .map(|_| {
            std::thread::spawn(move || {
                use std::io::Write;
                let Ok(mut s) = std::net::TcpStream::connect(addr) else {
                    return;
                };
                for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaa"
                {
                    if s.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        })
        .collect();
    let moved = wait_counter(&pd.decode, counter, before + 49.0, Duration::from_secs(20));
    for l in loris {
        let _ = l.join();
    }
    trial.end(&mut row, at, Instant::now(), moved);
    named(
        &mut row,
        &pd.decode,
        &["connection ended with a protocol error", "timeout"],
        counter,
        before,
    );
    row.note
        .push_str("seen when the header timeout (2 s) cuts them; ");
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn disconnect_storm(pd: &mut Pd) -> Row {
    let mut row = Row {
        fault: "disconnect storm (200 streams dropped)".into(),
        ..Row::default()
    };
    let counter = "tandem_request_failures_total{reason=\"client_disconnected\"} ";
    let before = sample(&pd.decode, counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let addr = pd.decode.addr;
    let streams: Vec<std::net::TcpStream> = (0..200)
        .filter_map(|i| {
            use std::io::Write;
            let body = json!({"model": MODEL_NAME, "stream": true, "max_tokens": 64,
                              "prompt": format!("Stream {i}: once upon a time")})
            .to_string();
            let mut s = std::net::TcpStream::connect(addr).ok()?;
            write!(
                s,
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .ok()?;
            Some(s)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    // The fault is the disconnect: measured from here.
    let at = Instant::now();
    drop(streams);
    let end = Instant::now();
    let moved = wait_counter(&pd.decode, counter, before, Duration::from_secs(20));
    trial.end(&mut row, at, end, moved);
    named(&mut row, &pd.decode, &["request aborted"], counter, before);
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn kv_memory_exhausted() -> Row {
    let mut row = Row {
        fault: "KV memory exhausted (decode, 24 blocks)".into(),
        ..Row::default()
    };
    let pd = Pd::start(&["--kv-blocks", "24", "--queue-timeout-seconds", "1"]);
    let counter = "tandem_request_failures_total{reason=\"queue_timeout\"} ";
    let before = sample(&pd.decode, counter).unwrap();
    let trial = Trial::begin(&pd.decode);
    let at = Instant::now();
    // Requests holding 7 of the 24 blocks each, 8 at once, for 3 s.
    let addr = pd.decode.addr;
    let hogs: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let body = json!({"model": MODEL_NAME, "max_tokens": 100, "temperature": 0,
                                  "prompt": format!("{i}: 1, 2, 3, 4, 5,")})
                .to_string();
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(3) {
                    let _ = try_request(addr, "/v1/completions", &body);
                }
            })
        })
        .collect();
    for h in hogs {
        let _ = h.join();
    }
    let end = Instant::now();
    let moved = wait_counter(&pd.decode, counter, before, Duration::from_secs(10));
    trial.end(&mut row, at, end, moved);
    named(
        &mut row,
        &pd.decode,
        &["generation failed", "queue_timeout"],
        counter,
        before,
    );
    row.note.push_str(
        "seen when the queue timeout (1 s) ends the first wait; tandem_requests_waiting shows the queue at once; ",
    );
    row.leaked = leaked(&[&pd.decode, &pd.prefill]);
    row
}

fn sigterm_both() -> Row {
    let mut row = Row {
        fault: "SIGTERM both (drain 2 s)".into(),
        ..Row::default()
    };
    let mut both = Server::spawn(&["--role", "both"], &["--drain-seconds", "2"], &[]);
    both.wait_ready();
    let port = both.addr.port();
    let trial = Trial::begin(&both);
    let at = Instant::now();
    let (took, st) = both.sigterm_and_wait(Duration::from_secs(10));
    if !st.success() || took > Duration::from_secs(3) {
        row.note
            .push_str(&format!("bad exit: {st} after {took:?}; "));
    }
    let has_line = both.log_text().contains("SIGTERM: draining");
    both = Server::spawn_on(port, &["--role", "both"], &["--drain-seconds", "2"], &[]);
    let end = Instant::now();
    trial.end(&mut row, at, end, None);
    row.log = "SIGTERM: draining".into();
    row.counter = "(process exits; /ready reason draining)".into();
    if !has_line {
        row.note.push_str("no SIGTERM log line; ");
    }
    row.note
        .push_str(&format!("exit 0 in {:.2} s; ", took.as_secs_f64()));
    row.leaked = leaked(&[&both]);
    row
}

fn partition() -> Row {
    let mut row = Row {
        fault: "network partition (veth down 4 s)".into(),
        ..Row::default()
    };
    let pair = match NetPair::create(2) {
        Ok(p) => p,
        Err(e) => {
            let why = format!("the kernel refused a network namespace ({e})");
            common::skipped("fault_matrix row 'network partition'", &why);
            row.note = format!("skipped: {why}");
            return row;
        }
    };
    let kv = free_port().to_string();
    let mut prefill = Server::spawn_in(
        Some((&pair.prefill, pair.prefill_http)),
        &["--role", "prefill", "--kv-port", &kv],
        &[],
        &env(),
    );
    prefill.wait_ready();
    let peer = format!("{}:{kv}", pair.prefill_kv);
    let mut decode = Server::spawn_in(
        Some((&pair.decode, pair.decode_http)),
        &["--role", "decode", "--prefill", &peer],
        &[],
        &env(),
    );
    decode.wait_ready();
    let counter = "tandem_kv_sessions_dropped_total{reason=\"expired\"} ";
    let before = sample(&prefill, counter).unwrap();
    let trial = Trial::begin(&decode);
    let at = Instant::now();
    pair.cut();
    std::thread::sleep(Duration::from_secs(4));
    pair.heal();
    let end = Instant::now();
    trial.end(&mut row, at, end, None);
    named(
        &mut row,
        &prefill,
        &["decode session dropped", "expired"],
        counter,
        before,
    );
    row.leaked = leaked(&[&decode, &prefill]);
    drop((decode, prefill));
    row
}

// ---- the run -------------------------------------------------------------------------

fn run_once() -> Vec<Row> {
    let mut rows = Vec::new();
    let mut pd = Pd::start(&["--http-header-timeout-seconds", "2"]);
    rows.push(loop_panic(&mut pd, "decode"));
    rows.push(loop_panic(&mut pd, "prefill"));
    rows.push(garbage(&mut pd));
    rows.push(prefill_hang(&mut pd));
    rows.push(prefill_restart(&mut pd));
    rows.push(mismatch(
        &mut pd,
        "group key mismatch",
        "auth_failed",
        "refusing the prefill",
        &[],
        &with(&[("TANDEM_GROUP_KEY", "another-key")]),
    ));
    rows.push(mismatch(
        &mut pd,
        "KV layout mismatch (q8_0 vs f16)",
        "layout_mismatch",
        "prefill refused us",
        &["--kv-dtype", "q8_0"],
        &env(),
    ));
    let other = OtherModel::new();
    rows.push(mismatch(
        &mut pd,
        "model mismatch",
        "model_mismatch",
        "prefill refused us",
        &["--model", other.path()],
        &env(),
    ));
    drop(other);
    rows.push(mismatch(
        &mut pd,
        "stale group incarnation (8 vs 7)",
        "incarnation_mismatch",
        "prefill refused us",
        &[],
        &with(&[("TANDEM_GROUP_INCARNATION", "8")]),
    ));
    rows.push(sigterm_prefill(&mut pd));
    rows.push(decode_restart(&mut pd));
    rows.push(sigterm_decode(&mut pd));
    // The decode was restarted without the short header timeout; give it back.
    pd.decode = spawn_decode(None, pd.kv, &["--http-header-timeout-seconds", "2"], &env());
    pd.decode.wait_ready();
    rows.push(slow_loris(&mut pd));
    rows.push(disconnect_storm(&mut pd));
    drop(pd);
    rows.push(kv_memory_exhausted());
    rows.push(sigterm_both());
    rows.push(partition());
    rows
}

fn secs(d: Option<Duration>) -> String {
    d.map(|d| format!("{:.2}", d.as_secs_f64()))
        .unwrap_or_else(|| "—".into())
}

fn print_table(runs: &[Vec<Row>]) {
    println!(
        "\n| fault | visible (s) | seen as | healed after the fault ended (s) | requests in error | never ended | KV blocks leaked | log line | counter | notes |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for i in 0..runs[0].len() {
        let rows: Vec<&Row> = runs.iter().map(|r| &r[i]).collect();
        let r0 = rows[0];
        let join =
            |f: &dyn Fn(&Row) -> String| rows.iter().map(|r| f(r)).collect::<Vec<_>>().join(" / ");
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | `{}` | `{}` | {} |",
            r0.fault,
            join(&|r| secs(r.visible)),
            r0.seen_as,
            join(&|r| secs(r.healed)),
            join(&|r| r.errors.to_string()),
            join(&|r| r.hung.to_string()),
            join(&|r| format!("{}", r.leaked)),
            r0.log,
            r0.counter,
            join(&|r| r.note.trim_end_matches("; ").to_owned()),
        );
    }
    println!(
        "\nTargets: visible ≤ {:.1} s (2 probe periods of {:.1} s), healed ≤ {} s, 0 never ended, 0 leaked.",
        VISIBLE_TARGET.as_secs_f64(),
        PROBE.as_secs_f64(),
        HEALED_TARGET.as_secs()
    );
}

#[test]
fn fault_matrix() {
    let reps: usize = std::env::var("TANDEM_FAULTS_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let t = Instant::now();
    let runs: Vec<Vec<Row>> = (0..reps).map(|_| run_once()).collect();
    print_table(&runs);
    println!(
        "fault matrix: {reps} run(s) in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    // What must always hold, whatever the timing.
    for run in &runs {
        for r in run {
            if r.note.starts_with("skipped") {
                println!("{}: {}", r.fault, r.note);
                continue;
            }
            assert_eq!(r.hung, 0, "{}: requests never ended: {r:?}", r.fault);
            assert_eq!(r.leaked, 0.0, "{}: KV blocks leaked: {r:?}", r.fault);
            assert!(r.visible.is_some(), "{}: never visible: {r:?}", r.fault);
            assert!(r.healed.is_some(), "{}: never healed: {r:?}", r.fault);
            let unnamed = r.note.contains("no log line") || r.note.contains("did not move");
            // A hang shorter than the KV timeout may fail no room: then the /ready reason
            // is what named it.
            let hang_ok = r.fault.starts_with("prefill hang") && r.seen_as == "ready:probe_timeout";
            assert!(!unnamed || hang_ok, "{}: not named: {r:?}", r.fault);
            assert!(!r.note.contains("bad exit"), "{}: {r:?}", r.fault);
        }
    }
}
