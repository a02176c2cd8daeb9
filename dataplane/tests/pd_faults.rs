//! PD fault handling with real processes: a frozen prefill (SIGSTOP: found by the decode's
//! channel deadline, requests answered with the reason), a prefill killed with a room in
//! flight and restarted on the same address, and a decode handshaking with a fake prefill
//! that does not know the key.

mod common;

use std::time::{Duration, Instant};

use common::{MODEL_NAME, Server, free_port, pd_env, start_decode, start_prefill};
use serde_json::json;
use tandem_dataplane::kv::{self, Envelope, Message, RejectReason};

fn completion_body(prompt: &str) -> String {
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}).to_string()
}

fn text_of(r: &common::HttpResponse) -> String {
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[test]
fn frozen_then_restarted_prefill_is_detected_and_recovered_without_restarting_the_decode() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = start_decode(&[kv], &env, true);
    let decode_pid = decode.child.id();
    let prompt = "The capital of France is";
    let baseline = text_of(&decode.post(
        "/v1/completions",
        &serde_json::from_str(&completion_body(prompt)).unwrap(),
    ));

    // 1. SIGSTOP with a request in flight, under a client sending one every 100 ms: the
    //    decode's channel deadline (1 s by default; PINGs every 250 ms) finds the silent
    //    prefill by itself, independent of the probe period: the request in flight is
    //    answered 503 `peer_unresponsive` and every request after it 503 `no_peer` at
    //    once, naming the reason. No request waits longer than about the deadline.
    prefill.signal("STOP");
    let stopped_at = Instant::now();
    let addr = decode.addr;
    let send = move |at: Instant| {
        std::thread::spawn(move || {
            let r = common::request(
                addr,
                "POST",
                "/v1/completions",
                Some(&completion_body(prompt)),
            );
            (at, Instant::now(), r)
        })
    };
    let in_flight = send(Instant::now());
    let mut clients = Vec::new();
    while stopped_at.elapsed() < Duration::from_millis(2500) {
        std::thread::sleep(Duration::from_millis(100));
        clients.push(send(Instant::now()));
    }
    let (_, answered_at, r) = in_flight.join().unwrap();
    let in_flight_wait = answered_at.duration_since(stopped_at);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "peer_unresponsive", "{}", r.body);
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let longest = answers
        .iter()
        .map(|(sent, done, _)| done.duration_since(*sent))
        .max()
        .unwrap()
        .max(in_flight_wait);
    // Once the deadline has passed, refusals are immediate and say why.
    let refused: Vec<_> = answers
        .iter()
        .filter(|(sent, _, _)| *sent > answered_at)
        .collect();
    assert!(
        refused.len() >= 5,
        "{} requests after the deadline",
        refused.len()
    );
    let slowest_refusal = refused
        .iter()
        .map(|(sent, done, _)| done.duration_since(*sent))
        .max()
        .unwrap();
    for (_, _, r) in &refused {
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "no_peer", "{}", r.body);
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains("peer_unresponsive"), "{message}");
    }
    // Those sent before it were taken into rooms on the silent prefill, and failed with
    // the reason at the deadline.
    let mut in_rooms: u32 = 1;
    for (sent, _, r) in &answers {
        assert_eq!(r.status, 503, "{}", r.body);
        if r.json()["error"]["code"] == "peer_unresponsive" {
            assert!(*sent < answered_at, "{}", r.body);
            in_rooms += 1;
        }
    }
    println!(
        "prefill SIGSTOP: the request in flight answered {:.0} ms after the stop; longest wait \
         of any of {} requests {:.0} ms ({} failed peer_unresponsive, the rest refused \
         no_peer); refusals after the deadline took at most {:.0} ms",
        in_flight_wait.as_secs_f64() * 1e3,
        answers.len() + 1,
        longest.as_secs_f64() * 1e3,
        in_rooms,
        slowest_refusal.as_secs_f64() * 1e3,
    );
    assert!(
        in_flight_wait < Duration::from_millis(1500),
        "the room in flight failed {in_flight_wait:?} after the stop (deadline 1 s)"
    );
    assert!(
        longest < Duration::from_millis(1500),
        "a request waited {longest:?}"
    );
    assert!(
        slowest_refusal < Duration::from_millis(500),
        "a refusal took {slowest_refusal:?}"
    );
    // `/ready` says the same: not ready, the reason first, the peer unresponsive.
    let body = decode.ready_body();
    assert_eq!(body["ready"], false, "{body}");
    assert_eq!(body["reason"], "peer_unresponsive", "{body}");
    assert_eq!(body["peers"][0]["state"], "unresponsive", "{body}");
    assert_eq!(decode.metric("tandem_kv_peer_unresponsive_total "), 1.0);
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"peer_unresponsive\"} "),
        f64::from(in_rooms)
    );
    // Logged once for the channel (peer, incarnation) and once for each room.
    let lines = decode.log_lines(&["prefill unresponsive", "peer_unresponsive"]);
    assert_eq!(lines.len(), 1, "{}", decode.log_text());
    assert!(lines[0].contains(&prefill.incarnation()), "{}", lines[0]);
    let lines = decode.log_lines(&["room failed", "peer_unresponsive"]);
    assert_eq!(lines.len(), in_rooms as usize, "{}", decode.log_text());
    for field in ["\"room\"", "\"peer\"", "\"peer_incarnation\"", "\"reason\""] {
        assert!(lines[0].contains(field), "{}", lines[0]);
    }

    // SIGCONT: the prefill reads the FAILED the decode pushed (it drops the room instead
    // of computing it for no one) and answers the decode's new HELLO; the channel is back
    // by itself, same processes.
    prefill.signal("CONT");
    let recovered = decode.wait_for(
        "ready after SIGCONT",
        Duration::from_secs(4),
        Server::is_ready,
    );
    println!(
        "prefill SIGCONT: the decode ready again {:.0} ms later",
        recovered.as_secs_f64() * 1e3
    );
    assert_eq!(
        text_of(&decode.post(
            "/v1/completions",
            &serde_json::from_str(&completion_body(prompt)).unwrap(),
        )),
        baseline,
        "served again after SIGCONT"
    );
    // Not always every one: on a loaded CI machine the prefill once failed 10 of the
    // decode's 11 (a room the decode failed may not have been one the prefill had taken;
    // a FAILED for a room it does not hold changes nothing, and a room it holds without
    // one expires on its own timeout). So: some read, none more than were failed.
    let pushed = "tandem_kv_rooms_total{state=\"failed\",reason=\"peer_unresponsive\"} ";
    prefill.wait_for("the pushed FAILED read", Duration::from_secs(4), |s| {
        s.metric(pushed) >= 1.0
    });
    std::thread::sleep(Duration::from_millis(300));
    let read = prefill.metric(pushed);
    assert!(
        read <= f64::from(in_rooms),
        "the prefill failed {read} rooms, the decode {in_rooms}"
    );
    println!("prefill SIGCONT: the prefill read {read} of the {in_rooms} FAILEDs pushed");

    // 2. Kill the prefill while a room is in flight (frozen, so the room cannot finish
    //    first): the decode sees the TCP connection close and fails the room at once with
    //    peer_lost, long before the KV timeout (30 s here). Then a new prefill starts on
    //    the same address; the decode re-handshakes by itself and serves again, same
    //    process.
    prefill.signal("STOP");
    let in_flight = std::thread::spawn(move || {
        common::request(
            addr,
            "POST",
            "/v1/completions",
            Some(&completion_body(prompt)),
        )
    });
    // Killed well inside the channel deadline, so it is the closed connection that
    // fails the room.
    std::thread::sleep(Duration::from_millis(100));
    let killed_at = Instant::now();
    drop(prefill); // SIGKILL + wait
    let r = in_flight.join().unwrap();
    let failed_after = killed_at.elapsed();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "peer_lost", "{}", r.body);
    assert!(
        failed_after < Duration::from_secs(10),
        "the room failed {failed_after:?} after the kill: that is the KV timeout, not the closed connection"
    );
    // The channel is gone: not ready (no new rooms) until a prefill is handshaken again.
    assert!(!decode.is_ready(), "{}", decode.get("/ready").body);
    let prefill2 = start_prefill(kv, &env);
    decode.wait_for(
        "ready with the new prefill",
        Duration::from_secs(10),
        Server::is_ready,
    );
    assert_eq!(
        text_of(&decode.post(
            "/v1/completions",
            &serde_json::from_str(&completion_body(prompt)).unwrap()
        )),
        baseline
    );
    assert_eq!(decode.child.id(), decode_pid);
    assert_eq!(
        decode.metric("tandem_kv_peer_incarnation_changes_total "),
        1.0
    );
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"peer_lost\"} "),
        1.0
    );
    assert!(decode.metric("tandem_kv_peer_disconnects_total ") >= 1.0);
    assert_eq!(
        decode.metric("tandem_kv_handshakes_total{result=\"ok\"} "),
        3.0,
        "the first prefill, again after SIGCONT, the second"
    );
    assert_eq!(
        prefill2.metric("tandem_kv_handshakes_total{result=\"ok\"} "),
        1.0
    );
    // The failure was logged once with room, peer, incarnation and reason.
    let log = decode.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("room failed") && l.contains("peer_lost"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    for field in ["\"room\"", "\"peer\"", "\"peer_incarnation\"", "\"reason\""] {
        assert!(lines[0].contains(field), "{}", lines[0]);
    }
    assert!(
        log.contains("connection to the prefill closed"),
        "the disconnect itself is logged: {log}"
    );
}

/// A fake prefill (a ROUTER in this test) that answers HELLO with a WELCOME signed by the
/// wrong key: the decode refuses it (AuthFailed), stays not-ready, and tells the peer why.
#[test]
fn decode_refuses_a_prefill_that_cannot_prove_the_key() {
    let env = pd_env(&[]);
    let kv = free_port();
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_rcvtimeo(10_000).unwrap();
    router.bind(&format!("tcp://127.0.0.1:{kv}")).unwrap();
    let decode = start_decode(&[kv], &env, false);
    let frames = router.recv_multipart(0).expect("decode sends HELLO");
    let hello = kv::decode(&[&frames[1], &frames[2]]).unwrap();
    let Message::Hello {
        fingerprint,
        layout,
        nonce,
    } = &hello.msg
    else {
        panic!("expected HELLO, got {hello:?}");
    };
    assert_eq!(hello.group_incarnation, 7);
    let wrong = kv::auth::GroupKey::new(*b"not the group key");
    let me = kv::auth::LocalIdentity {
        incarnation: 42,
        group_incarnation: 7,
        fingerprint: fingerprint.clone(),
        layout: *layout,
    };
    let (welcome, _) = kv::auth::respond_hello(
        &me,
        &wrong,
        kv::PROTOCOL_VERSION,
        hello.incarnation,
        7,
        &hello.msg,
        [9; 32],
    )
    .unwrap();
    let _ = nonce;
    let [h, p] = kv::encode(&Envelope {
        incarnation: 42,
        group_incarnation: 7,
        room: 0,
        msg: welcome,
    });
    router
        .send_multipart([frames[0].as_slice(), &h, &p], 0)
        .unwrap();
    let reply = router.recv_multipart(0).expect("decode answers");
    let reject = kv::decode(&[&reply[1], &reply[2]]).unwrap();
    assert!(
        matches!(
            reject.msg,
            Message::Reject {
                reason: RejectReason::AuthFailed,
                ..
            }
        ),
        "{reject:?}"
    );
    decode.wait_for("decode is up", Duration::from_secs(60), |s| {
        std::net::TcpStream::connect(s.addr).is_ok() && s.get("/health").status == 200
    });
    decode.wait_for("auth failure counted", Duration::from_secs(5), |s| {
        s.metric("tandem_kv_handshakes_total{result=\"auth_failed\"} ") >= 1.0
    });
    assert!(!decode.is_ready());
    assert_eq!(decode.get("/health").status, 200, "liveness is unaffected");
}

/// Failures pushed, logged once and counted, end to end: the prefill fails a room (its KV cache is too
/// small for the prompt, which the decode's accepts). FAILED reaches the decode at once (not
/// by a timeout), the client gets the reason, and each side logs the failure once with room,
/// peer, the peer's incarnation and the reason, and counts it under that reason.
#[test]
fn a_prefill_side_failure_is_pushed_to_the_decode_and_logged_once_on_each_side() {
    let env = pd_env(&[]);
    let kv = free_port();
    let kv_arg = kv.to_string();
    // 4 blocks of 16 tokens on the prefill; 256 on the decode.
    let mut prefill = Server::spawn(
        &["--role", "prefill", "--kv-port", &kv_arg],
        &["--kv-blocks", "4"],
        &env,
    );
    prefill.wait_ready();
    let decode = start_decode(&[kv], &env, true);
    let long = "one two three four five ".repeat(20);
    let t = Instant::now();
    let r = decode.post(
        "/v1/completions",
        &serde_json::from_str(&completion_body(&long)).unwrap(),
    );
    let took = t.elapsed();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "too_large", "{}", r.body);
    assert!(
        took < Duration::from_secs(5),
        "pushed at once, not found by the 30 s KV timeout: {took:?}"
    );
    let failed = "tandem_kv_rooms_total{state=\"failed\",reason=\"too_large\"} ";
    assert_eq!(decode.metric(failed), 1.0);
    assert_eq!(prefill.metric(failed), 1.0);

    let field = |line: &str, k: &str| -> String {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        match &v["fields"][k] {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    };
    let d = decode.log_lines(&["\"room failed\"", "too_large"]);
    assert_eq!(d.len(), 1, "{}", decode.log_text());
    let p = prefill.log_lines(&["\"room ended\"", "too_large"]);
    assert_eq!(p.len(), 1, "{}", prefill.log_text());
    let room = field(&d[0], "room");
    assert_eq!(field(&p[0], "room"), room, "the same room on both sides");
    assert_eq!(field(&d[0], "peer"), format!("127.0.0.1:{kv}"));
    assert!(!field(&p[0], "peer").is_empty());
    // Each side names the other's process incarnation.
    assert_eq!(field(&d[0], "peer_incarnation"), prefill.incarnation());
    assert_eq!(field(&p[0], "peer_incarnation"), decode.incarnation());
    assert_eq!(field(&d[0], "reason"), "too_large");
    assert_eq!(field(&p[0], "reason"), "too_large");
    // Nothing else failed, and the pair keeps serving prompts that fit.
    assert_eq!(decode.metric_sum("tandem_kv_rooms_total"), 1.0);
    let r = decode.post(
        "/v1/completions",
        &serde_json::from_str(&completion_body("Hi")).unwrap(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A prompt whose prefill takes several times the KV timeout (2 s here) still succeeds:
/// the prefill's PROGRESS keeps the room alive while its engine works, so the timeout
/// measures silence; and the busy prefill is never taken for an unresponsive one (its
/// socket loop answers PING under the 1 s channel deadline while the engine computes).
/// Silence still fails: a frozen prefill sends no PROGRESS, and — for a decode whose
/// channel deadline is set past the KV timeout, so that this timeout is the one that
/// fires — the room fails with `kv_timeout` about one timeout later.
#[test]
fn a_prefill_longer_than_the_kv_timeout_succeeds_while_a_silent_one_times_out() {
    let env = pd_env(&[("TANDEM_KV_TIMEOUT_SECONDS", "2")]);
    let kv = free_port();
    let kv_arg = kv.to_string();
    // Tiny chunks (2 tokens) and ~640 tokens: many engine steps per prompt, as on a busy
    // prefill, so the prefill takes several KV timeouts even on a fast machine (about
    // 10 s on the 2-core dev machine; 400 tokens in chunks of 4 once took only 3.7 s).
    let mut prefill = Server::spawn(
        &["--role", "prefill", "--kv-port", &kv_arg],
        &["--chunk-size", "2"],
        &env,
    );
    prefill.wait_ready();
    let decode = start_decode(&[kv], &env, true);
    let long = "one two three four five six seven eight ".repeat(80);
    let body = json!({"model": MODEL_NAME, "prompt": long, "max_tokens": 2, "temperature": 0});
    let t = Instant::now();
    let r = decode.post("/v1/completions", &body);
    let took = t.elapsed();
    eprintln!("long prefill took {took:?}");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        took > Duration::from_secs(4),
        "the prefill should take several KV timeouts, took {took:?}"
    );
    let progress = decode.metric("tandem_kv_progress_messages_total ");
    assert!(progress >= 3.0, "{progress} PROGRESS messages");
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"kv_timeout\"} "),
        0.0
    );
    assert_eq!(decode.metric("tandem_kv_peer_unresponsive_total "), 0.0);
    let rtt_count = decode.metric("tandem_kv_ping_rtt_seconds_count ");
    assert!(
        rtt_count >= took.as_secs_f64() * 2.0,
        "{rtt_count} PONGs in {took:?}: the busy prefill answered every heartbeat"
    );
    drop(decode);
    let env = pd_env(&[
        ("TANDEM_KV_TIMEOUT_SECONDS", "2"),
        ("TANDEM_CHANNEL_DEADLINE_MS", "60000"),
    ]);
    let decode = start_decode(&[kv], &env, true);

    // As long a prompt to a prefill that goes silent mid-prefill (SIGSTOP). Another one:
    // the first is in both prefix caches now and would be answered at once.
    let other = "nine ten eleven twelve thirteen fourteen fifteen sixteen ".repeat(80);
    let body = json!({"model": MODEL_NAME, "prompt": other, "max_tokens": 2, "temperature": 0});
    let addr = decode.addr;
    let b = body.to_string();
    let client =
        std::thread::spawn(move || common::request(addr, "POST", "/v1/completions", Some(&b)));
    prefill.wait_for(
        "the room reached the prefill",
        Duration::from_secs(10),
        |s| s.metric("tandem_kv_rooms_opened_total ") == 2.0,
    );
    prefill.signal("STOP");
    let stopped = Instant::now();
    let r = client.join().unwrap();
    let waited = stopped.elapsed();
    prefill.signal("CONT");
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "kv_timeout", "{}", r.body);
    assert!(
        waited < Duration::from_secs(5),
        "failed {waited:?} after the prefill went silent (KV timeout 2 s)"
    );
    assert_eq!(
        decode.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"kv_timeout\"} "),
        1.0
    );
}
