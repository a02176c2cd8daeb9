//! The in-place reset (`POST /admin/reset`, docs/in-place-reset.md) with real processes and
//! the real model: a prefill and a decode reset to the next group incarnation, prefill
//! first, as the operator does it, without exiting and without loading the weights again;
//! a request in flight ends with the reason `reset`; nothing leaks.

mod common;

use std::io::BufReader;
use std::time::{Duration, Instant};

use common::http_client::{read_chunk, read_head, request_with, send};
use common::{MODEL_NAME, Server, free_port, pd_env, start_decode, start_prefill};
use serde_json::json;
use tandem_contract::MemberRole;
use tandem_dataplane::kv::auth::GroupKey;
use tandem_dataplane::pd::reset::proof;

/// `pd_env`'s group incarnation.
const GROUP: u64 = 7;

fn reset(s: &Server, role: MemberRole, n: u64, timeout_ms: u64) -> common::HttpResponse {
    let p = proof(&GroupKey::new(common::GROUP_KEY.as_bytes()), role, n);
    let body = json!({"group_incarnation": n, "timeout_ms": timeout_ms}).to_string();
    request_with(
        s.addr,
        "POST",
        "/admin/reset",
        &[("Authorization", &format!("Tandem-Reset {p}"))],
        Some(&body),
    )
}

fn completion(prompt: &str, max_tokens: u32) -> serde_json::Value {
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

fn text_of(r: &common::HttpResponse) -> String {
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
}

fn ok(r: &common::HttpResponse) -> serde_json::Value {
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// The engine's free KV blocks once it has no request left: the blocks of one that was
/// just answered are freed a moment later, and a baseline read before that would never be
/// reached again (it was a flaky failure on a loaded CI machine).
fn settled_free(s: &Server) -> f64 {
    s.wait_for("the engine idle", Duration::from_secs(5), |s| {
        s.metric("tandem_requests_running ") == 0.0 && s.metric("tandem_requests_waiting ") == 0.0
    });
    // The gauges of one engine round are written one after another.
    std::thread::sleep(Duration::from_millis(100));
    s.metric("tandem_kv_blocks_free ")
}

/// Wait until the engine's free KV blocks are back at `want` (a request's blocks are freed
/// by the engine thread a moment after its answer).
fn blocks_back(s: &Server, want: f64) {
    s.wait_for("KV blocks freed", Duration::from_secs(5), |s| {
        s.metric("tandem_kv_blocks_free ") == want
    });
}

#[test]
fn prefill_then_decode_reset_in_place_keep_the_processes_and_the_weights() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = start_decode(&[kv], &env, true);
    let (prefill_pid, decode_pid) = (prefill.child.id(), decode.child.id());
    let prompt = "The capital of France is";
    let baseline = text_of(&decode.post("/v1/completions", &completion(prompt, 6)));
    let (prefill_free, decode_free) = (settled_free(&prefill), settled_free(&decode));
    let (p_inc, d_inc) = (prefill.incarnation(), decode.incarnation());
    assert_eq!(decode.ready_body()["group_incarnation"], GROUP);

    // 1. A reset pair, prefill first. Between the two, the decode (still at 7) is refused
    //    by the prefill at 8 and says so in /ready.
    let pair_start = Instant::now();
    let v = ok(&reset(&prefill, MemberRole::Prefill, GROUP + 1, 5000));
    let prefill_took = pair_start.elapsed();
    let prefill_took_ms = v["took_ms"].clone();
    assert_eq!(
        (v["reset"].clone(), v["ready"].clone()),
        (json!(true), json!(true)),
        "{v}"
    );
    assert_eq!(v["group_incarnation"], GROUP + 1, "{v}");
    assert_ne!(
        v["incarnation"],
        json!(p_inc),
        "a new process incarnation: {v}"
    );
    assert_eq!(prefill.ready_body()["group_incarnation"], GROUP + 1);
    let mismatch = decode.wait_for(
        "the decode refused at the old incarnation",
        Duration::from_secs(5),
        |s| s.ready_body()["reason"] == "incarnation_mismatch",
    );
    let body = decode.ready_body();
    assert_eq!(body["ready"], false, "{body}");
    let r = decode.post("/v1/completions", &completion(prompt, 6));
    assert_eq!(r.status, 503, "{}", r.body);
    let decode_start = Instant::now();
    let v = ok(&reset(&decode, MemberRole::Decode, GROUP + 1, 10_000));
    let decode_took = decode_start.elapsed();
    assert_eq!(
        (v["reset"].clone(), v["ready"].clone()),
        (json!(true), json!(true)),
        "{v}"
    );
    assert_ne!(v["incarnation"], json!(d_inc), "{v}");
    println!(
        "in-place reset of a SmolLM2 pair: prefill {:.0} ms (its took_ms {}), the decode \
         refused at the old incarnation after {:.0} ms, decode {:.0} ms (took_ms {}); the \
         two calls back to back {:.0} ms",
        prefill_took.as_secs_f64() * 1e3,
        prefill_took_ms,
        mismatch.as_secs_f64() * 1e3,
        decode_took.as_secs_f64() * 1e3,
        v["took_ms"],
        (prefill_took + decode_took).as_secs_f64() * 1e3,
    );
    let body = decode.ready_body();
    assert_eq!(body["ready"], true, "{body}");
    assert_eq!(body["group_incarnation"], GROUP + 1, "{body}");
    assert_eq!(
        text_of(&decode.post("/v1/completions", &completion(prompt, 6))),
        baseline,
        "the same answer at the new incarnation"
    );
    // The same processes, the weights loaded once.
    assert_eq!(
        (prefill.child.id(), decode.child.id()),
        (prefill_pid, decode_pid)
    );
    for s in [&prefill, &decode] {
        assert!(s.child.id() > 0);
        assert_eq!(s.log_lines(&["model loaded"]).len(), 1, "{}", s.log_text());
        let lines = s.log_lines(&["\"in-place reset\""]);
        assert_eq!(lines.len(), 1, "{}", s.log_text());
        for field in [
            "\"old_group_incarnation\":7",
            "\"group_incarnation\":8",
            "\"old_incarnation\"",
            "\"rooms_ended\"",
            "\"took_ms\"",
        ] {
            assert!(lines[0].contains(field), "{field}: {}", lines[0]);
        }
        assert_eq!(s.metric("tandem_resets_total{outcome=\"done\"} "), 1.0);
    }

    // 2. Repeats are answered without doing anything; an older incarnation is refused.
    let v = ok(&reset(&decode, MemberRole::Decode, GROUP + 1, 5000));
    assert_eq!(
        (v["reset"].clone(), v["ready"].clone()),
        (json!(false), json!(true)),
        "{v}"
    );
    let r = reset(&decode, MemberRole::Decode, GROUP, 5000);
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "stale_incarnation", "{}", r.body);
    // Without the proof: 401, counted, and the proof never logged.
    let r = decode.post("/admin/reset", &json!({"group_incarnation": 99}));
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(
        decode.metric("tandem_resets_total{outcome=\"unauthorized\"} "),
        1.0
    );

    // 3. A stream in flight (its room done, generating on the decode) when the pair resets
    //    to 9: the prefill's reset leaves it going; the decode's ends it with `reset`, at
    //    once.
    let body = json!({"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2000,
                      "temperature": 0, "ignore_eos": true, "stream": true})
    .to_string();
    let mut stream = BufReader::new(send(decode.addr, "POST", "/v1/completions", Some(&body)));
    let (status, _) = read_head(&mut stream);
    assert_eq!(status, 200);
    let first = read_chunk(&mut stream).expect("a first token");
    assert!(String::from_utf8_lossy(&first).contains("data: "));
    ok(&reset(&prefill, MemberRole::Prefill, GROUP + 2, 5000));
    let reset_at = Instant::now();
    let v = ok(&reset(&decode, MemberRole::Decode, GROUP + 2, 10_000));
    assert_eq!(v["ready"], true, "{v}");
    let mut rest = Vec::new();
    while let Some(c) = read_chunk(&mut stream) {
        rest.extend_from_slice(&c);
    }
    let ended_after = reset_at.elapsed();
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.contains("\"code\":\"reset\""), "{rest}");
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    assert!(
        ended_after < Duration::from_secs(5),
        "the stream ended {ended_after:?} after the decode's reset began"
    );
    assert_eq!(
        decode.metric("tandem_request_failures_total{reason=\"reset\"} "),
        1.0
    );
    assert_eq!(
        decode
            .log_lines(&["request ended by an in-place reset"])
            .len(),
        1
    );

    // 4. Served again at 9; nothing leaked on either side.
    assert_eq!(
        text_of(&decode.post("/v1/completions", &completion(prompt, 6))),
        baseline
    );
    blocks_back(&prefill, prefill_free);
    blocks_back(&decode, decode_free);
    for s in [&prefill, &decode] {
        let log = s.log_text();
        for n in [GROUP + 1, GROUP + 2, 99] {
            for role in [MemberRole::Prefill, MemberRole::Decode] {
                let p = proof(&GroupKey::new(common::GROUP_KEY.as_bytes()), role, n);
                assert!(!log.contains(&p), "a proof in the log");
            }
        }
    }
}

/// A room waiting for its KV when the prefill resets fails with `reset` on both sides, at
/// once, and the decode's request says so.
#[test]
fn a_room_in_flight_when_the_prefill_resets_ends_with_reset_at_once() {
    let env = pd_env(&[]);
    let kv = free_port();
    let mut prefill = Server::spawn(
        &["--role", "prefill", "--kv-port", &kv.to_string()],
        &["--fault-injection"],
        &[env.as_slice(), &[("TANDEM_ALLOW_FAULT_INJECTION", "yes")]].concat(),
    );
    prefill.wait_ready();
    let decode = start_decode(&[kv], &env, true);
    // Hold the prefill's engine, so the room waits for its KV (PROGRESS keeps it alive).
    let r = prefill.post("/debug/fault?loop=engine&fault=hold&ms=5000", &json!({}));
    assert_eq!(r.status, 200, "{}", r.body);
    let addr = decode.addr;
    let waiting = std::thread::spawn(move || {
        let body = completion("Tell me a story", 4).to_string();
        let r = common::request(addr, "POST", "/v1/completions", Some(&body));
        (Instant::now(), r)
    });
    prefill.wait_for("a room open", Duration::from_secs(5), |s| {
        s.ready_body()["peers"][0]["rooms"] == 1
    });
    let reset_at = Instant::now();
    let v = ok(&reset(&prefill, MemberRole::Prefill, GROUP + 1, 5000));
    assert_eq!(v["rooms_ended"], 1, "{v}");
    let (answered, r) = waiting.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "reset", "{}", r.body);
    let waited = answered.duration_since(reset_at);
    println!(
        "a room in flight ended {:.0} ms after the prefill's reset began",
        waited.as_secs_f64() * 1e3
    );
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    for s in [&prefill, &decode] {
        assert_eq!(
            s.metric("tandem_kv_rooms_total{state=\"failed\",reason=\"reset\"} "),
            1.0
        );
        let lines = s.log_lines(&["room", "\"reason\":\"reset\""]);
        assert!(!lines.is_empty(), "{}", s.log_text());
    }
}
