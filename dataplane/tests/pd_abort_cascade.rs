//! Abort cascade with real processes: a separate client process opens 60 concurrent
//! streaming chat sessions through the decode and is SIGKILLed mid-generation, three times
//! in a row. Each time the decode stays live and ready, every room ends in a terminal state
//! on both sides, no KV block leaks on either side, and no loop died or restarted.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{MODEL_NAME, Server, free_port, pd_env, start_decode, start_prefill};
use serde_json::json;

const SESSIONS: usize = 60;
/// Long enough that generation is in flight when the kill lands, short enough for CI.
const MAX_TOKENS: usize = 48;
/// The client is killed once this many streams have delivered their first SSE event.
const STARTED_BEFORE_KILL: usize = 4;

/// The client: opens every session at once (raw HTTP/1.1, one socket each), then reads
/// whatever arrives and prints how many streams have started, until it is killed.
const CLIENT: &str = r#"
import json, select, socket, sys
host, port, n, max_tokens, model, rnd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
socks = []
for i in range(n):
    body = json.dumps({"model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Round %s, session %d: tell me a long story about dragons and castles." % (rnd, i)}]}).encode()
    s = socket.create_connection((host, port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    socks.append(s)
print("sent", n, flush=True)
started, open_socks = set(), list(socks)
while open_socks:
    ready, _, _ = select.select(open_socks, [], [], 0.05)
    for s in ready:
        data = s.recv(65536)
        if not data:
            open_socks.remove(s)
        elif b"data: {" in data and s not in started:
            started.add(s)
            print("started", len(started), flush=True)
"#;

fn python() -> String {
    std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| {
        common::repo_root()
            .join(".venv/bin/python")
            .to_string_lossy()
            .into_owned()
    })
}

/// Terminal rooms (done + failed + aborted, every reason) and rooms opened.
fn room_balance(s: &Server) -> (f64, f64) {
    (
        s.metric("tandem_kv_rooms_opened_total "),
        s.metric_sum("tandem_kv_rooms_total"),
    )
}

fn aborted(s: &Server) -> f64 {
    s.metric("tandem_kv_rooms_total{state=\"aborted\",reason=\"client_abort\"} ")
}

/// Run the client until `STARTED_BEFORE_KILL` streams are going, SIGKILL it; the number
/// of streams that had started. The prompts name the round: a round repeating the last
/// one's prompts would find them in the prefix caches, and the prefill would be done with
/// every room before the kill.
fn cascade(decode: &Server, round: usize) -> usize {
    let port = decode.addr.port().to_string();
    let mut child = Command::new(python())
        .args(["-c", CLIENT, "127.0.0.1", &port])
        .args([SESSIONS.to_string(), MAX_TOKENS.to_string()])
        .arg(MODEL_NAME)
        .arg(round.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run python (set TANDEM_PYTHON or run `make pyenv`)");
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut started = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while started < STARTED_BEFORE_KILL {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(n) = line.strip_prefix("started ") {
                    started = n.parse().unwrap();
                }
            }
            Err(e) => {
                let _ = child.kill();
                panic!(
                    "client: {e} after {started} started streams; decode log:\n{}",
                    decode.log_text()
                );
            }
        }
    }
    // SIGKILL (std's kill), mid-generation: the kernel closes all 60 sockets at once.
    child.kill().unwrap();
    child.wait().unwrap();
    drop(rx);
    reader.join().unwrap();
    started
}

#[test]
fn three_sigkilled_clients_in_a_row_leave_no_room_block_or_loop_behind() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = start_decode(&[kv], &env, true);
    let held = format!("tandem_kv_transfer_blocks_held{{peer=\"127.0.0.1:{kv}\"}} ");
    for round in 1..=3 {
        let (opened_before, _) = room_balance(&decode);
        let aborted_before = (aborted(&decode), aborted(&prefill));
        let started = cascade(&decode, round);
        let killed_at = Instant::now();
        assert!(started >= STARTED_BEFORE_KILL);

        // Liveness stays fast while the cascade is being cleaned up...
        let t = Instant::now();
        let h = decode.get("/health");
        let health_ms = t.elapsed();
        assert_eq!(h.status, 200);
        assert!(
            health_ms < Duration::from_millis(300),
            "round {round}: /health took {health_ms:?}"
        );
        // ...and so does readiness.
        let r = decode.wait_for("ready after the kill", Duration::from_secs(1), |s| {
            s.is_ready()
        });
        assert!(r <= Duration::from_secs(1), "round {round}: {r:?}");

        // Every room reaches a terminal state on both sides; nothing stays in transfer.
        for s in [&decode, &prefill] {
            s.wait_for(
                "every room terminal, no sequence left",
                Duration::from_secs(90),
                |s| {
                    let (opened, ended) = room_balance(s);
                    opened == ended
                        && s.metric("tandem_kv_blocks_used ") == 0.0
                        && s.metric("tandem_requests_running ") == 0.0
                        && s.metric("tandem_requests_waiting ") == 0.0
                },
            );
        }
        decode.wait_for("no blocks held in transfer", Duration::from_secs(5), |s| {
            s.metric(&held) == 0.0
        });
        let (opened, _) = room_balance(&decode);
        assert!(
            opened - opened_before >= STARTED_BEFORE_KILL as f64,
            "round {round}: the client's sessions opened rooms"
        );
        // The kill really cut rooms short on both sides (not only finished streams).
        assert!(
            aborted(&decode) > aborted_before.0,
            "round {round}: {}",
            decode.get("/metrics").body
        );
        assert!(
            aborted(&prefill) > aborted_before.1,
            "round {round}: {}",
            prefill.get("/metrics").body
        );
        for s in [&decode, &prefill] {
            let body = s.get("/metrics").body;
            // Zero leaked KV blocks: all 256 are free again.
            assert_eq!(s.metric("tandem_kv_blocks_used "), 0.0, "{body}");
            assert_eq!(s.metric("tandem_kv_blocks_free "), 256.0, "{body}");
            // No loop died or restarted; the processes are the same.
            assert_eq!(s.metric_sum("tandem_kv_loop_restarts_total"), 0.0, "{body}");
        }
        assert!(decode.is_ready() && prefill.is_ready());

        // A new request completes.
        let r = decode.post(
            "/v1/chat/completions",
            &json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hi."}],
                    "max_tokens": 4, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "round {round}: {}", r.body);
        eprintln!(
            "round {round}: {started} streams started before the kill; /health {health_ms:?}; \
             clean in {:?}",
            killed_at.elapsed()
        );
    }
    for s in [&decode, &prefill] {
        let log = s.log_text();
        assert!(!log.contains("panicked"), "{log}");
    }
}
