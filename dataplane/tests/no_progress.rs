//! Readiness from forward progress with the real binary and real HTTP: an engine that
//! goes round but steps nothing while a request waits, and one whose steps fail, turn
//! `/ready` 503 `no_progress` within `--no-progress-seconds` + a margin while the engine
//! heartbeat stays fresh, and ready again once progress resumes. The stall and the
//! failures are injected (`POST /debug/fault?loop=engine`, behind `--fault-injection` and
//! `TANDEM_ALLOW_FAULT_INJECTION=yes`): they stand for a wedged or erroring backend, not
//! for any particular one.

mod common;

use std::time::{Duration, Instant};

use common::{MODEL_NAME, Server, request};
use serde_json::json;

/// The limit these tests run with (the default is 30 s).
const LIMIT: Duration = Duration::from_secs(2);
/// `/ready` is polled every 50 ms; the rest is the machine's load (2 shared cores).
const MARGIN: Duration = Duration::from_millis(1500);

fn start() -> Server {
    let mut s = Server::spawn(
        &["--role", "both"],
        &["--fault-injection", "--no-progress-seconds", "2"],
        &[("TANDEM_ALLOW_FAULT_INJECTION", "yes")],
    );
    s.wait_ready();
    s
}

fn completion(s: &Server) -> common::HttpResponse {
    let body = json!({"model": MODEL_NAME, "prompt": "The capital of France is",
                      "max_tokens": 4, "temperature": 0});
    request(s.addr, "POST", "/v1/completions", Some(&body.to_string()))
}

fn inject(s: &Server, fault: &str, ms: u64) {
    let r = s.post(
        &format!("/debug/fault?loop=engine&fault={fault}&ms={ms}"),
        &json!({}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Poll `/ready` until it is not ready; the time and the body.
fn wait_not_ready(s: &Server, timeout: Duration) -> (Duration, serde_json::Value) {
    let start = Instant::now();
    loop {
        let b = s.ready_body();
        if b["ready"] == false {
            return (start.elapsed(), b);
        }
        assert!(
            start.elapsed() < timeout,
            "still ready after {timeout:?}: {b}\n{}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn check<'a>(body: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    body["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name}: {body}"))
}

#[test]
fn an_engine_holding_queued_work_turns_no_progress_and_recovers() {
    let s = start();
    // Idle for longer than the limit: ready.
    std::thread::sleep(LIMIT + Duration::from_millis(500));
    let idle = s.ready_body();
    assert_eq!(idle["ready"], true, "{idle}");
    assert_eq!(check(&idle, "engine_progress")["ok"], true);

    inject(&s, "hold", 6000);
    let held_at = Instant::now();
    let addr = s.addr;
    let client = std::thread::spawn(move || {
        let body = json!({"model": MODEL_NAME, "prompt": "The capital of France is",
                          "max_tokens": 4, "temperature": 0});
        request(addr, "POST", "/v1/completions", Some(&body.to_string()))
    });
    let (after, body) = wait_not_ready(&s, LIMIT + MARGIN + Duration::from_secs(2));
    let at = held_at.elapsed();
    println!(
        "no_progress {} ms after the request was queued (limit {LIMIT:?})",
        at.as_millis()
    );
    assert!(
        after + Duration::from_millis(100) >= LIMIT,
        "too early: {at:?}: {body}"
    );
    assert!(
        at <= LIMIT + MARGIN,
        "not within limit + margin: {at:?}: {body}"
    );
    assert_eq!(body["reason"], "no_progress", "{body}");
    let msg = body["message"].as_str().unwrap();
    assert!(
        msg.starts_with(
            "engine_progress: engine: work queued or running and no step succeeded for"
        ),
        "{msg}"
    );
    // What stalled, for programs (the operator chooses new pods for a stalled engine).
    assert_eq!(body["stalled"], "engine", "{body}");
    assert_eq!(
        check(&body, "engine_progress")["stalled"],
        "engine",
        "{body}"
    );
    // The loop still goes round: this is what the heartbeat alone would not see.
    assert_eq!(check(&body, "engine_heartbeat")["ok"], true, "{body}");
    assert_eq!(s.get("/ready").status, 503);

    // The hold ends: the request is served and the member is ready again.
    let r = client.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let back = s.wait_for("ready again", Duration::from_secs(5), |s| s.is_ready());
    println!(
        "ready {} ms after the request was answered",
        back.as_millis()
    );
    assert_eq!(
        s.metric("tandem_progress_stalls_total{reason=\"no_progress\"}"),
        1.0
    );
    let log = s.log_text();
    assert!(
        log.contains("not ready: work is making no progress"),
        "{log}"
    );
    assert!(
        log.contains("ready again: work is making progress"),
        "{log}"
    );
}

#[test]
fn failing_steps_count_as_no_progress_and_a_step_that_succeeds_heals() {
    let s = start();
    assert_eq!(completion(&s).status, 200);
    inject(&s, "fail_steps", 60_000);
    // A sparse stream: every request fails at once, the engine idle between them.
    let start = Instant::now();
    let body = loop {
        let r = completion(&s);
        assert_ne!(r.status, 200, "a step should have failed: {}", r.body);
        let b = s.ready_body();
        if b["ready"] == false {
            break b;
        }
        assert!(start.elapsed() < LIMIT + MARGIN, "still ready: {b}");
        std::thread::sleep(Duration::from_millis(200));
    };
    println!(
        "no_progress {} ms after the first failed step",
        start.elapsed().as_millis()
    );
    assert!(start.elapsed() + Duration::from_millis(100) >= LIMIT);
    assert_eq!(body["reason"], "no_progress", "{body}");
    let detail = check(&body, "engine_progress")["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(detail.contains("steps failed"), "{detail}");
    assert_eq!(body["stalled"], "engine", "{body}");
    assert_eq!(check(&body, "engine_heartbeat")["ok"], true, "{body}");

    // Disarm (a fault of 0 ms), and one request that succeeds heals it at once.
    inject(&s, "fail_steps", 0);
    let r = completion(&s);
    assert_eq!(
        r.status, 200,
        "the first request after the disarm: {}",
        r.body
    );
    let b = s.ready_body();
    assert_eq!(b["ready"], true, "{b}");
}
