//! PD serving under KV memory pressure on the decode: it reserves a request's blocks
//! (prompt + max_tokens) before it opens a room, so a request that must wait for memory
//! waits before anything is sent to a prefill, and one that can never fit is refused
//! before a room exists. Real processes, the real model.

mod common;

use std::io::BufReader;
use std::time::Duration;

use common::http_client::{read_chunk, read_head, read_response, send};
use common::{MODEL_NAME, Server, free_port, pd_env, start_prefill};
use serde_json::json;

const ROOMS: &str = "tandem_kv_rooms_opened_total ";

/// A decode with `blocks` KV blocks of 16 tokens (and `extra` flags), ready.
fn small_decode(kv: u16, blocks: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let peer = format!("127.0.0.1:{kv}");
    let mut args = vec!["--kv-blocks", blocks];
    args.extend_from_slice(extra);
    let mut s = Server::spawn(&["--role", "decode", "--prefill", &peer], &args, env);
    s.wait_ready();
    s
}

/// ~8 prompt tokens + 100 = 7 blocks of 16: one fits in 8 blocks, two do not.
fn body(i: usize, max_tokens: u32, stream: bool) -> String {
    json!({"model": MODEL_NAME, "prompt": format!("{i}: 1, 2, 3, 4, 5,"),
           "max_tokens": max_tokens, "temperature": 0, "stream": stream})
    .to_string()
}

fn freed(s: &Server) -> bool {
    s.metric("tandem_kv_blocks_used ") == 0.0 && s.metric("tandem_requests_running ") == 0.0
}

#[test]
fn decode_reserves_kv_before_it_opens_a_room() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = small_decode(kv, "8", &[], &env);

    // A request that can never fit: a clear 400 and no room anywhere.
    let r = decode.post(
        "/v1/completions",
        &serde_json::from_str(&body(0, 200, false)).unwrap(),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("KV blocks"), "{msg}");
    assert_eq!(prefill.metric(ROOMS), 0.0);
    assert_eq!(decode.metric(ROOMS), 0.0);

    // A holds 7 of the 8 blocks while it streams; B fits alone but not beside A.
    let a = send(
        decode.addr,
        "POST",
        "/v1/completions",
        Some(&body(1, 100, true)),
    );
    let mut a = BufReader::new(a);
    let (status, _) = read_head(&mut a);
    assert_eq!(status, 200);
    assert!(read_chunk(&mut a).is_some(), "A streams");
    let b = send(
        decode.addr,
        "POST",
        "/v1/completions",
        Some(&body(2, 100, false)),
    );
    // B queues for KV memory on the decode; no room is opened for it meanwhile.
    decode.wait_for("B waits for KV", Duration::from_secs(30), |s| {
        s.metric("tandem_requests_waiting ") == 1.0
    });
    assert_eq!(prefill.metric(ROOMS), 1.0, "only A's room while B waits");
    // Then A finishes, B gets its blocks, its room, and completes.
    while read_chunk(&mut a).is_some() {}
    let rb = read_response(BufReader::new(b));
    assert_eq!(rb.status, 200, "{}", rb.body);
    assert!(rb.json()["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    assert_eq!(prefill.metric(ROOMS), 2.0);
    decode.wait_for("decode blocks freed", Duration::from_secs(30), freed);
    prefill.wait_for("prefill blocks freed", Duration::from_secs(30), freed);
}

#[test]
fn waiting_for_decode_kv_times_out_without_a_room() {
    let env = pd_env(&[]);
    let kv = free_port();
    let prefill = start_prefill(kv, &env);
    let decode = small_decode(kv, "8", &["--queue-timeout-seconds", "0.3"], &env);
    let a = send(
        decode.addr,
        "POST",
        "/v1/completions",
        Some(&body(1, 100, true)),
    );
    let mut a = BufReader::new(a);
    let (status, _) = read_head(&mut a);
    assert_eq!(status, 200);
    assert!(read_chunk(&mut a).is_some(), "A streams");
    let r = decode.post(
        "/v1/completions",
        &serde_json::from_str(&body(2, 100, false)).unwrap(),
    );
    // A decodes up to 100 greedy tokens (deterministic) at ~100 tok/s at best: it holds its
    // blocks far longer than B's 0.3 s queue timeout.
    assert_eq!(
        r.status, 503,
        "B should time out waiting for KV: {}",
        r.body
    );
    {
        assert_eq!(r.json()["error"]["code"], "queue_timeout", "{}", r.body);
        assert_eq!(
            decode.metric("tandem_request_failures_total{reason=\"queue_timeout\"} "),
            1.0
        );
        assert_eq!(
            decode
                .log_lines(&["generation failed", "queue_timeout"])
                .len(),
            1
        );
        assert_eq!(
            prefill.metric(ROOMS),
            1.0,
            "no room for the timed-out request"
        );
    }
    while read_chunk(&mut a).is_some() {}
    decode.wait_for("decode blocks freed", Duration::from_secs(30), freed);
    prefill.wait_for("prefill blocks freed", Duration::from_secs(30), freed);
}
