//! A prefill killed (SIGKILL) under a steady stream of requests, with real processes: the
//! requests that picked it just before the decode learned of the closed connection (their
//! rooms reach the decode's KV loop after the disconnect: held here by stalling that loop
//! for a moment across the kill, as a loaded machine does) must not wait for the bootstrap
//! timeout. Every request is answered 503 with a reason within about the channel deadline
//! (1 s) of the kill or of its sending, and a decode told to drain at once (the operator's
//! co-restart sends SIGTERM right after the kill) exits within about 2 s.

mod common;

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{HttpResponse, MODEL_NAME, Server, free_port, pd_env, start_prefill};
use serde_json::json;

/// The bootstrap timeout of the example: what a request waited before the fix.
const ENV: &[(&str, &str)] = &[
    ("TANDEM_BOOTSTRAP_TIMEOUT_SECONDS", "10"),
    ("TANDEM_ALLOW_FAULT_INJECTION", "yes"),
];
/// How long the decode's KV loop is held across the kill.
const STALL_MS: u64 = 300;

type Answer = (Instant, Instant, HttpResponse);

fn send(addr: SocketAddr) -> JoinHandle<Answer> {
    let body = json!({"model": MODEL_NAME, "prompt": "The capital of France is",
                      "max_tokens": 4, "temperature": 0})
    .to_string();
    let sent = Instant::now();
    std::thread::spawn(move || {
        let r = common::request(addr, "POST", "/v1/completions", Some(&body));
        (sent, Instant::now(), r)
    })
}

fn code(r: &HttpResponse) -> String {
    r.json()["error"]["code"].as_str().unwrap_or("").to_owned()
}

/// A prefill and a decode (fault injection on), serving; then the decode's KV loop is
/// stalled, the prefill killed inside the stall and requests sent every 20 ms from the
/// kill on for `stream`. Returns the decode, the kill's time and the clients.
fn kill_under_stream(stream: Duration) -> (Server, Instant, Vec<JoinHandle<Answer>>) {
    let env = pd_env(ENV);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let peer = format!("127.0.0.1:{kv}");
    let mut decode = Server::spawn(
        &["--role", "decode", "--prefill", &peer],
        &["--fault-injection"],
        &env,
    );
    decode.wait_ready();
    let warm = send(decode.addr).join().unwrap().2;
    assert_eq!(warm.status, 200, "{}", warm.body);
    let r = decode.post(
        &format!("/debug/fault?loop=kv_peer_0&fault=stall&ms={STALL_MS}"),
        &json!({}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    decode.wait_for("the KV loop stalled", Duration::from_secs(2), |s| {
        s.log_text().contains("injected fault: stalling the loop")
    });
    let killed_at = Instant::now();
    drop(prefill); // SIGKILL + wait
    let mut clients = vec![send(decode.addr)];
    while killed_at.elapsed() < stream {
        std::thread::sleep(Duration::from_millis(20));
        clients.push(send(decode.addr));
    }
    (decode, killed_at, clients)
}

/// The longest wait (from the kill or the sending, whichever is later), how many failed
/// `peer_lost` in a room, and every answer's status and code.
fn summary(killed_at: Instant, answers: &[Answer]) -> (Duration, usize, Vec<String>) {
    let wait = |(sent, done, _): &Answer| done.duration_since((*sent).max(killed_at));
    let longest = answers.iter().map(wait).max().unwrap_or_default();
    let in_rooms = answers
        .iter()
        .filter(|(_, _, r)| code(r) == "peer_lost")
        .count();
    let codes = answers
        .iter()
        .map(|a| {
            format!(
                "{} {} {:.0}ms",
                a.2.status,
                code(&a.2),
                wait(a).as_secs_f64() * 1e3
            )
        })
        .collect();
    (longest, in_rooms, codes)
}

/// Every answer: 503 with a reason of the dead prefill (or one of `also`), within 1.5 s
/// of the kill or of its sending.
fn check(killed_at: Instant, answers: &[Answer], also: &[&str]) {
    for (sent, done, r) in answers {
        let wait = done.duration_since((*sent).max(killed_at));
        assert_eq!(r.status, 503, "{}", r.body);
        let c = code(r);
        assert!(
            ["peer_lost", "peer_unresponsive", "no_peer"].contains(&c.as_str())
                || also.contains(&c.as_str()),
            "a reason of the dead prefill, not a timeout: {}",
            r.body
        );
        assert!(
            wait < Duration::from_millis(1500),
            "a request waited {wait:?} ({c}): {}",
            r.body
        );
    }
}

#[test]
fn requests_racing_a_killed_prefill_fail_peer_lost_within_the_channel_deadline() {
    let (decode, killed_at, clients) = kill_under_stream(Duration::from_millis(2000));
    let answers: Vec<Answer> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let (longest, in_rooms, codes) = summary(killed_at, &answers);
    println!(
        "prefill SIGKILL under a stream: {} requests, {in_rooms} failed peer_lost in a room; \
         longest wait {:.0} ms; {codes:?}",
        answers.len(),
        longest.as_secs_f64() * 1e3
    );
    check(killed_at, &answers, &[]);
    assert!(
        in_rooms >= 1,
        "no request raced the disconnect (the stall holds some)"
    );
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"bootstrap_timeout\"} "),
        0.0
    );
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"peer_lost\"} "),
        in_rooms as f64
    );
    // Each room's failure logged once with its reason.
    let lines = decode.log_lines(&["room failed", "peer_lost"]);
    assert_eq!(lines.len(), in_rooms, "{}", decode.log_text());
    assert!(
        lines[0].contains("no session with the prefill"),
        "{}",
        lines[0]
    );
}

#[test]
fn a_decode_draining_right_after_the_kill_ends_its_racing_rooms_and_exits_in_two_seconds() {
    // Requests only inside the stall (the listener closes on SIGTERM); SIGTERM 40 ms after
    // the kill, as the operator's co-restart did.
    let (mut decode, killed_at, clients) = kill_under_stream(Duration::from_millis(40));
    let (exit_took, status) = decode.sigterm_and_wait(Duration::from_secs(15));
    let answers: Vec<Answer> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let (longest, in_rooms, codes) = summary(killed_at, &answers);
    println!(
        "prefill SIGKILL, decode SIGTERM 40 ms later: {} requests ({in_rooms} peer_lost), \
         longest wait {:.0} ms; the decode exited {:.0} ms after SIGTERM ({status}); {codes:?}",
        answers.len(),
        longest.as_secs_f64() * 1e3,
        exit_took.as_secs_f64() * 1e3
    );
    // A request the client sent before the SIGTERM may reach the decode after it (on a
    // loaded machine the sending thread starts late): refused `draining` at once, which is
    // the right answer for it.
    check(killed_at, &answers, &["draining"]);
    assert!(in_rooms >= 1, "no request raced the disconnect");
    assert!(
        exit_took < Duration::from_millis(2000),
        "the drain waited {exit_took:?} for rooms on a dead prefill"
    );
}
