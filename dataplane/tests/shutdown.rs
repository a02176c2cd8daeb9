//! SIGTERM, as Kubernetes sends it, to every role with real processes: idle, with and
//! without peers, and mid-stream. Every role exits 0 within its drain deadline + 1 s;
//! in-flight work finishes within the deadline or ends with a reason; a terminating
//! prefill's rooms fail at once with `peer_shutdown` on the decode (not after a KV timeout).

mod common;

use std::io::BufReader;
use std::time::{Duration, Instant};

use common::http_client::{read_chunk, read_head, send};
use common::{MODEL_NAME, Server, free_port, pd_env, ready_reasons, start_decode, start_prefill};
use serde_json::json;

fn stream_body(prompt: &str, max_tokens: u32) -> String {
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
           "temperature": 0, "stream": true})
    .to_string()
}

/// Idle processes do not wait for their drain deadline (10 s here): they exit 0 at once.
#[test]
fn every_role_exits_zero_at_once_when_idle_with_and_without_peers() {
    let drain = ["--drain-seconds", "10"];
    let env = pd_env(&[]);
    let kv = free_port();
    let kv_arg = kv.to_string();
    // A prefill and a decode that know each other, a prefill alone, a decode whose prefill
    // does not exist, and a colocated server.
    let mut pair_prefill =
        Server::spawn(&["--role", "prefill", "--kv-port", &kv_arg], &drain, &env);
    let lone_kv = free_port().to_string();
    let mut lone_prefill =
        Server::spawn(&["--role", "prefill", "--kv-port", &lone_kv], &drain, &env);
    let nowhere = format!("127.0.0.1:{}", free_port());
    let mut lone_decode = Server::spawn(&["--role", "decode", "--prefill", &nowhere], &drain, &env);
    let mut both = Server::spawn(&["--role", "both"], &drain, &[]);
    pair_prefill.wait_ready();
    let peer = format!("127.0.0.1:{kv}");
    let mut pair_decode = Server::spawn(&["--role", "decode", "--prefill", &peer], &drain, &env);
    for s in [&mut lone_prefill, &mut both, &mut pair_decode] {
        s.wait_ready();
    }
    lone_decode.wait_for("decode up", Duration::from_secs(120), |s| {
        std::net::TcpStream::connect(s.addr).is_ok() && s.get("/health").status == 200
    });
    let body = lone_decode.ready_body();
    assert_eq!(body["ready"], false);
    assert_eq!(body["reason"], "peer_unreachable", "{body}");

    // The paired prefill first: its decode hears GOODBYE and says why it is not ready.
    let (took, st) = pair_prefill.sigterm_and_wait(Duration::from_secs(11));
    assert!(st.success(), "prefill: {st}\n{}", pair_prefill.log_text());
    assert!(took < Duration::from_secs(2), "prefill took {took:?}");
    pair_decode.wait_for("decode sees the goodbye", Duration::from_secs(2), |s| {
        s.ready_body()["reason"] == "peer_shutdown"
    });
    assert_eq!(pair_decode.metric("tandem_kv_peer_goodbyes_total "), 1.0);
    for (name, s) in [
        ("paired decode", &mut pair_decode),
        ("lone prefill", &mut lone_prefill),
        ("lone decode", &mut lone_decode),
        ("both", &mut both),
    ] {
        let (took, st) = s.sigterm_and_wait(Duration::from_secs(11));
        assert!(st.success(), "{name}: {st}\n{}", s.log_text());
        assert!(took < Duration::from_secs(2), "{name} took {took:?}");
        let log = s.log_text();
        assert!(log.contains("shutdown complete"), "{name}: {log}");
        assert!(!log.contains("abandoned"), "{name}: {log}");
    }
}

/// A stream longer than the drain deadline: /ready fails with `draining` at once, new
/// connections are refused, the stream ends at the deadline with a `shutdown` error event
/// and [DONE], and the process exits 0 between the deadline and the deadline + 1 s. Run
/// for the colocated server and for a decode with its prefill.
#[test]
fn a_stream_past_the_drain_deadline_ends_with_a_shutdown_error_and_the_process_exits_on_time() {
    let env = pd_env(&[]);
    let kv = free_port();
    let _prefill = start_prefill(kv, &env);
    let peer = format!("127.0.0.1:{kv}");
    let drain = Duration::from_secs(2);
    let mut both = Server::spawn(&["--role", "both"], &["--drain-seconds", "2"], &[]);
    let mut decode = Server::spawn(
        &["--role", "decode", "--prefill", &peer],
        &["--drain-seconds", "2"],
        &env,
    );
    both.wait_ready();
    decode.wait_ready();
    for (name, s) in [("both", &mut both), ("decode", &mut decode)] {
        let body = stream_body("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", 2000);
        let mut r = BufReader::new(send(s.addr, "POST", "/v1/completions", Some(&body)));
        let (status, _) = read_head(&mut r);
        assert_eq!(status, 200, "{name}");
        assert!(read_chunk(&mut r).is_some(), "{name}: the stream started");
        let t = Instant::now();
        s.sigterm();
        s.wait_for("draining", Duration::from_secs(1), |s| {
            let b = s.ready_body();
            b["ready"] == false && b["reason"] == "draining"
        });
        let ready = s.get("/ready");
        assert_eq!(ready.status, 503);
        assert!(
            ready_reasons(&ready.json()).contains(&"draining".to_owned()),
            "{}",
            ready.body
        );
        // New work is refused with the reason; probes and scrapes are still answered.
        let refused = s.post(
            "/v1/completions",
            &json!({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}),
        );
        assert_eq!(refused.status, 503, "{}", refused.body);
        assert_eq!(
            refused.json()["error"]["code"],
            "draining",
            "{}",
            refused.body
        );
        assert_eq!(s.get("/health").status, 200);
        let mut rest = Vec::new();
        while let Some(c) = read_chunk(&mut r) {
            rest.extend(c);
        }
        let ended = t.elapsed();
        let rest = String::from_utf8(rest).unwrap();
        assert!(rest.ends_with("data: [DONE]\n\n"), "{name}: {rest}");
        assert!(rest.contains("\"code\":\"shutdown\""), "{name}: {rest}");
        assert!(
            ended >= drain - Duration::from_millis(100),
            "{name}: ended before the deadline: {ended:?}"
        );
        let st = s.wait_exit(Duration::from_secs(5));
        let took = t.elapsed();
        assert!(st.success(), "{name}: {st}\n{}", s.log_text());
        assert!(
            took <= drain + Duration::from_secs(1),
            "{name}: exited {took:?} after SIGTERM (drain {drain:?})"
        );
        assert!(std::net::TcpStream::connect(s.addr).is_err());
        let log = s.log_text();
        assert!(log.contains("drain deadline passed"), "{name}: {log}");
        assert!(
            log.contains("request ended by the drain deadline"),
            "{name}: {log}"
        );
    }
}

/// A prefill terminated while it works on a room: the decode stops routing to it at once
/// (GOODBYE), and when the prefill's drain deadline passes, the room fails with FAILED
/// `shutdown`, which the decode logs and counts as `peer_shutdown` — long before the 30 s
/// KV timeout. The prefill exits 0 within its deadline + 1 s.
#[test]
fn rooms_on_a_terminating_prefill_fail_at_once_with_peer_shutdown() {
    let env = pd_env(&[]);
    let kv = free_port();
    let kv_arg = kv.to_string();
    // Small prompt chunks keep each engine step short, so a step never outlives the drain.
    let mut prefill = Server::spawn(
        &["--role", "prefill", "--kv-port", &kv_arg],
        &["--drain-seconds", "1", "--chunk-size", "16"],
        &env,
    );
    prefill.wait_ready();
    let decode = start_decode(&[kv], &env, true);
    let long = "one two three four five six seven eight ".repeat(60);
    let addr = decode.addr;
    let body = json!({"model": MODEL_NAME, "prompt": long, "max_tokens": 4}).to_string();
    let client = std::thread::spawn(move || {
        let t = Instant::now();
        let r = common::request(addr, "POST", "/v1/completions", Some(&body));
        (r, t.elapsed())
    });
    prefill.wait_for("the room is in the prefill", Duration::from_secs(30), |s| {
        s.metric("tandem_kv_rooms_opened_total ") == 1.0
    });
    let (took, st) = prefill.sigterm_and_wait(Duration::from_secs(10));
    assert!(st.success(), "{st}\n{}", prefill.log_text());
    assert!(
        took <= Duration::from_secs(2),
        "prefill exited after {took:?}"
    );
    let (r, waited) = client.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "peer_shutdown", "{}", r.body);
    assert!(waited < Duration::from_secs(20), "{waited:?}");
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"peer_shutdown\"} "),
        1.0
    );
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"kv_timeout\"} "),
        0.0
    );
    let lines = decode.log_lines(&["room failed", "peer_shutdown"]);
    assert_eq!(lines.len(), 1, "{}", decode.log_text());
    let plog = prefill.log_text();
    assert!(plog.contains("said goodbye to every decode"), "{plog}");
    let body = decode.ready_body();
    assert_eq!(body["ready"], false);
    let peer = &body["peers"][0];
    assert_eq!(peer["last_failure"]["reason"], "peer_shutdown", "{body}");
}
