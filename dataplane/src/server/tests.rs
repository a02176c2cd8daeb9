//! In-process server tests over real TCP with the toy runner (the real model is exercised
//! by `dataplane/tests/`).

use super::test_server::*;
use super::*;
use crate::scheduler::SchedulerConfig;
use crate::test_support::http_client::{HttpResponse, read_chunk, read_head, request, send};
use std::io::BufReader;

#[test]
fn chat_completion_json_has_openai_shape() {
    let s = start(1000);
    let r = post(
        &s,
        "/v1/chat/completions",
        &chat_body(r#","max_tokens":5,"temperature":0"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "toy");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(
        c["message"]["content"].as_str().unwrap().len(),
        5,
        "5 one-letter tokens"
    );
    assert_eq!(c["finish_reason"], "length");
    // "<|im_start|>" "user\nHi there" "<|im_end|>" "\n" "<|im_start|>" "assistant\n", byte tokens.
    let prompt_tokens = 1 + "user\nHi there".len() + 1 + 1 + 1 + "assistant\n".len();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 5);
    assert!(s.runner.lock().unwrap().seqs.is_empty());
}

#[test]
fn chat_stream_matches_json_and_ends_with_done() {
    let s = start(1000);
    let whole = post(
        &s,
        "/v1/chat/completions",
        &chat_body(r#","max_tokens":6,"temperature":0"#),
    )
    .json();
    let r = post(
        &s,
        "/v1/chat/completions",
        &chat_body(
            r#","max_tokens":6,"temperature":0,"stream":true,"stream_options":{"include_usage":true}"#,
        ),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let data = r.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].clone();
    assert!(
        chunks
            .iter()
            .all(|c| c["id"] == id && c["object"] == "chat.completion.chunk")
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        content,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    assert_eq!(fin["usage"]["completion_tokens"], 6);
    let usage_only = chunks.last().unwrap();
    assert_eq!(usage_only["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage_only["usage"], whole["usage"]);
}

#[test]
fn completions_with_token_prompt_stop_and_logprobs() {
    let s = start(1000);
    let base = r#"{"model":"toy","prompt":[5,6,7,8],"max_tokens":8,"temperature":0,"logprobs":2"#;
    let v = post(&s, "/v1/completions", &format!("{base}}}")).json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    assert_eq!(text.len(), 8);
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().concat_strings(), text);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 8);
    assert!(
        lp["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x.as_f64().unwrap() <= 0.0)
    );
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(lp["text_offset"][3], 3);
    // A stop string made of the 3rd and 4th generated letters cuts the text before it.
    let stop = &text[2..4];
    let v = post(
        &s,
        "/v1/completions",
        &format!(r#"{base},"stop":["{stop}"]}}"#),
    )
    .json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["text"], text[..text.find(stop).unwrap()]);
}

trait ConcatStrings {
    fn concat_strings(&self) -> String;
}
impl ConcatStrings for Vec<serde_json::Value> {
    fn concat_strings(&self) -> String {
        self.iter().map(|v| v.as_str().unwrap()).collect()
    }
}

fn assert_400(r: &HttpResponse, param: Option<&str>, needle: &str) {
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["type"], "invalid_request_error");
    assert!(e["message"].as_str().unwrap().contains(needle), "{e}");
    assert_eq!(e["param"].as_str(), param, "{e}");
    assert!(e.as_object().unwrap().contains_key("code"));
}

#[test]
fn bad_requests_get_openai_errors() {
    let s = start(1000);
    let chat = "/v1/chat/completions";
    assert_400(&post(&s, chat, "{not json"), None, "malformed JSON");
    assert_400(&post(&s, chat, "[1]"), None, "JSON object");
    assert_400(
        &post(&s, chat, r#"{"model":"toy"}"#),
        Some("messages"),
        "required",
    );
    assert_400(
        &post(&s, chat, r#"{"model":"toy","messages":[]}"#),
        Some("messages"),
        "at least one",
    );
    assert_400(
        &post(&s, chat, r#"{"model":"toy","messages":"hi"}"#),
        Some("messages"),
        "must be an array",
    );
    assert_400(
        &post(&s, chat, r#"{"model":"toy","messages":[{"content":"x"}]}"#),
        Some("messages[0].role"),
        "required",
    );
    assert_400(
        &post(&s, chat, &chat_body(r#","temperature":"hot""#)),
        Some("temperature"),
        "must be a number",
    );
    assert_400(
        &post(&s, chat, &chat_body(r#","max_tokens":0"#)),
        Some("max_tokens"),
        "at least 1",
    );
    assert_400(
        &post(&s, chat, &chat_body(r#","max_tokens":-3"#)),
        Some("max_tokens"),
        "at least 1",
    );
    assert_400(
        &post(&s, chat, &chat_body(r#","max_tokens":1.5"#)),
        Some("max_tokens"),
        "integer",
    );
    assert_400(&post(&s, chat, &chat_body(r#","n":2"#)), Some("n"), "n=1");
    assert_400(
        &post(&s, chat, &chat_body(r#","stream":"yes""#)),
        Some("stream"),
        "boolean",
    );
    let r = post(
        &s,
        chat,
        r#"{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}"#,
    );
    assert_400(&r, Some("model"), "does not exist");
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let long = "x".repeat(1100);
    let r = post(
        &s,
        chat,
        &format!(r#"{{"model":"toy","messages":[{{"role":"user","content":"{long}"}}]}}"#),
    );
    assert_400(&r, Some("messages"), "context length");
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert_400(
        &post(&s, chat, &chat_body(r#","max_tokens":1020"#)),
        Some("max_tokens"),
        "exceeds the context",
    );
    let comp = "/v1/completions";
    assert_400(
        &post(&s, comp, r#"{"model":"toy"}"#),
        Some("prompt"),
        "required",
    );
    assert_400(
        &post(&s, comp, r#"{"model":"toy","prompt":""}"#),
        Some("prompt"),
        "empty",
    );
    assert_400(
        &post(&s, comp, r#"{"model":"toy","prompt":[1,99999]}"#),
        Some("prompt"),
        "out of range",
    );
    assert_400(
        &post(&s, comp, r#"{"model":"toy","prompt":["a","b"]}"#),
        Some("prompt"),
        "batched",
    );
    assert_400(
        &post(&s, comp, r#"{"model":"toy","prompt":{"x":1}}"#),
        Some("prompt"),
        "must be",
    );
    // Nothing leaked into the engine.
    assert!(s.runner.lock().unwrap().seqs.is_empty() && s.runner.lock().unwrap().log.is_empty());
}

#[test]
fn probes_models_metrics_and_unknown_paths() {
    let s = start(1000);
    let r = request(s.addr, "GET", "/health", None);
    assert_eq!((r.status, r.json()["status"].as_str()), (200, Some("ok")));
    let r = request(s.addr, "GET", "/ready", None);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["ready"], true);
    assert_eq!(v["role"], "both");
    assert_eq!(v["checks"][0]["name"], "engine_heartbeat");
    assert_eq!(v["checks"][0]["ok"], true);
    let m = request(s.addr, "GET", "/v1/models", None).json();
    assert_eq!(m["data"][0]["id"], "toy");
    assert_eq!(m["object"], "list");
    let r = request(s.addr, "GET", "/nope", None);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "not_found");
    assert_eq!(
        request(s.addr, "GET", "/v1/chat/completions", None).status,
        405
    );
    assert_eq!(
        post(&s, "/v1/chat/completions", &chat_body(r#","max_tokens":3"#)).status,
        200
    );
    let r = request(s.addr, "GET", "/metrics", None);
    assert_eq!(r.status, 200);
    for needle in [
        r#"tandem_http_requests_total{endpoint="/v1/chat/completions",status="200"} 1"#,
        r#"tandem_http_requests_total{endpoint="other",status="404"} 1"#,
        "tandem_generation_tokens_total 3",
        "tandem_time_to_first_token_seconds_count 1",
        "tandem_inter_token_latency_seconds_count 2",
        "tandem_requests_running 0",
        "tandem_kv_blocks_used 0",
        "tandem_kv_blocks_free 1000",
    ] {
        assert!(r.body.contains(needle), "missing {needle:?} in\n{}", r.body);
    }
}

#[test]
fn never_fitting_request_is_a_400() {
    // Waiting for and timing out on KV memory is covered at the scheduler level; here the
    // HTTP mapping: a request that can never fit the cache is a 400 with a clear message.
    let s = start(3);
    let r = post(
        &s,
        "/v1/completions",
        r#"{"model":"toy","prompt":"hello","max_tokens":20}"#,
    );
    assert_400(&r, None, "KV blocks");
}

#[test]
fn request_waiting_for_kv_memory_times_out_with_503() {
    let cfg = SchedulerConfig {
        queue_timeout: Duration::from_millis(200),
        ..Default::default()
    };
    // 10 blocks of 4 tokens; each request below needs 7, so the second must wait.
    let s = start_with(10, cfg);
    s.runner.lock().unwrap().step_delay = Duration::from_millis(20);
    let body = r#"{"model":"toy","prompt":[2,3,4],"max_tokens":25,"temperature":0}"#;
    let addr = s.addr;
    let first = std::thread::spawn(move || request(addr, "POST", "/v1/completions", Some(body)));
    std::thread::sleep(Duration::from_millis(100));
    let r = post(&s, "/v1/completions", body);
    assert_eq!(r.status, 503, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["code"], "queue_timeout");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("waiting for KV cache memory"),
        "{e}"
    );
    assert_eq!(first.join().unwrap().status, 200);
    let m = request(s.addr, "GET", "/metrics", None).body;
    assert!(
        m.contains(r#"tandem_request_failures_total{reason="queue_timeout"} 1"#),
        "{m}"
    );
}

#[test]
fn unfinished_request_head_is_cut_after_the_timeout_and_counted() {
    use std::io::{Read, Write};
    let s = start(1000);
    let mut c = std::net::TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // The request line and a header, never the blank line that ends the head.
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let t = std::time::Instant::now();
    let mut got = Vec::new();
    match c.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) => assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset,
            "the server must close the connection, not leave it open: {e}"
        ),
    }
    let waited = t.elapsed();
    assert!(
        waited >= HEADER_TIMEOUT - Duration::from_millis(100) && waited < Duration::from_secs(15),
        "closed after {waited:?} (timeout {HEADER_TIMEOUT:?})"
    );
    let text = String::from_utf8_lossy(&got);
    assert!(
        !text.contains("200 OK"),
        "an unfinished request was served: {text}"
    );
    // The server still serves complete requests, and counted the cut connection.
    let r = request(s.addr, "GET", "/metrics", None);
    assert_eq!(r.status, 200);
    assert!(
        r.body
            .contains(r#"tandem_http_connection_errors_total{kind="timeout"} 1"#),
        "{}",
        r.body
    );
}

#[test]
fn ready_fails_with_the_reason_while_the_engine_is_stalled() {
    let (s, _) = start_custom(
        1000,
        SchedulerConfig::default(),
        Duration::from_millis(300),
        Duration::from_secs(5),
    );
    assert_eq!(request(s.addr, "GET", "/ready", None).status, 200);
    // Every engine step now takes 1.5 s: a stuck engine, as far as /ready can tell.
    s.runner.lock().unwrap().step_delay = Duration::from_millis(1500);
    let client = chat_in_background(s.addr);
    let t = Instant::now();
    let stalled = loop {
        let r = request(s.addr, "GET", "/ready", None);
        if r.status == 503 {
            break r.json();
        }
        assert!(t.elapsed() < Duration::from_secs(3), "/ready never failed");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(stalled["ready"], false);
    assert_eq!(stalled["reason"], "engine_stalled", "{stalled}");
    assert_eq!(stalled["checks"][0]["reason"], "engine_stalled");
    assert!(
        stalled["message"]
            .as_str()
            .unwrap()
            .contains("limit 300 ms"),
        "{stalled}"
    );
    assert_eq!(client.join().unwrap().status, 200);
    s.runner.lock().unwrap().step_delay = Duration::ZERO;
    let t = Instant::now();
    while request(s.addr, "GET", "/ready", None).status != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "/ready never recovered"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The spell was counted once, with its reason, however many probes saw it.
    let m = request(s.addr, "GET", "/metrics", None).body;
    assert!(
        m.contains(r#"tandem_not_ready_total{reason="engine_stalled"} 1"#),
        "{m}"
    );
}

/// The drain: /ready fails with `draining` at once (probes are still answered), new work
/// is refused with `draining`, a stream in flight runs on until the deadline and then ends
/// with a `shutdown` error event, and `serve` returns just after the deadline.
#[test]
fn draining_fails_ready_refuses_new_work_and_ends_streams_at_the_deadline() {
    let drain = Duration::from_secs(1);
    let (mut s, serving) = start_custom(
        1000,
        SchedulerConfig::default(),
        Duration::from_secs(5),
        drain,
    );
    s.runner.lock().unwrap().step_delay = Duration::from_millis(50);
    let body = chat_body(r#","max_tokens":500,"stream":true"#);
    let mut r = BufReader::new(send(s.addr, "POST", "/v1/chat/completions", Some(&body)));
    assert_eq!(read_head(&mut r).0, 200);
    assert!(read_chunk(&mut r).is_some());
    let _ = s.stop.take().unwrap().send(());
    let t = Instant::now();
    let ready = loop {
        let v = request(s.addr, "GET", "/ready", None);
        if v.status == 503 {
            break v.json();
        }
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "still ready while draining"
        );
    };
    assert_eq!(ready["reason"], "draining", "{ready}");
    assert_eq!(ready["checks"][1]["name"], "not_draining");
    let refused = post(
        &s,
        "/v1/completions",
        r#"{"model":"toy","prompt":"Hi","max_tokens":2}"#,
    );
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["error"]["code"], "draining");
    let mut rest = Vec::new();
    while let Some(c) = read_chunk(&mut r) {
        rest.extend(c);
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.contains("\"code\":\"shutdown\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    serving.join().unwrap();
    let took = t.elapsed();
    assert!(
        took >= drain && took < drain + Duration::from_millis(500),
        "serve returned {took:?} after the signal (drain {drain:?})"
    );
}

/// A probe whose connection was accepted just before the drain began, but whose request
/// was not read yet, is answered (`/ready` 503 `draining`), not closed unanswered (hyper's
/// graceful shutdown closes a connection that has not started a request).
#[test]
fn a_connection_accepted_before_the_drain_still_gets_its_answer() {
    use std::io::Write;
    let (mut s, serving) = start_custom(
        1000,
        SchedulerConfig::default(),
        Duration::from_secs(5),
        Duration::from_secs(1),
    );
    // Keep the server busy so it drains for a while instead of returning at once.
    s.runner.lock().unwrap().step_delay = Duration::from_millis(50);
    let body = chat_body(r#","max_tokens":500,"stream":true"#);
    let mut stream = BufReader::new(send(s.addr, "POST", "/v1/chat/completions", Some(&body)));
    assert_eq!(read_head(&mut stream).0, 200);
    // Connected and accepted while serving; nothing sent yet.
    let mut probe = std::net::TcpStream::connect(s.addr).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let _ = s.stop.take().unwrap().send(());
    std::thread::sleep(Duration::from_millis(50));
    probe
        .write_all(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut r = BufReader::new(probe);
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 503, "the probe is answered while draining");
    while read_chunk(&mut stream).is_some() {}
    serving.join().unwrap();
}

/// Every field of the refused table with a value that asks for something gets a 400
/// naming it, on both endpoints; every ignored field is accepted; the new parameters'
/// bad values name their field. Nothing reaches the engine.
#[test]
fn unsupported_fields_are_refused_by_name_and_ignored_ones_accepted() {
    let s = start(1000);
    let comp = |extra: &str| format!(r#"{{"model":"toy","prompt":"Hi","max_tokens":3{extra}}}"#);
    for (field, _) in fields::REFUSED {
        for (path, body) in [
            (
                "/v1/chat/completions",
                chat_body(&format!(r#","{field}":"x""#)),
            ),
            ("/v1/completions", comp(&format!(r#","{field}":"x""#))),
        ] {
            assert_400(&post(&s, path, &body), Some(field), "not supported");
        }
    }
    for (param, extra, needle) in [
        ("max_tokenz", r#","max_tokenz":3"#, "unrecognized"),
        ("prompt", r#","prompt":"x""#, "unrecognized"),
        (
            "stream_options.include_usagee",
            r#","stream_options":{"include_usagee":true}"#,
            "unrecognized",
        ),
        ("ignore_eos", r#","ignore_eos":1"#, "boolean"),
        ("min_tokens", r#","min_tokens":-2"#, "at least 0"),
        (
            "min_tokens",
            r#","min_tokens":4"#,
            "more than 'max_tokens' (3)",
        ),
        (
            "stop_token_ids",
            r#","stop_token_ids":[1,258]"#,
            "out of range",
        ),
        ("stop_token_ids", r#","stop_token_ids":[1.5]"#, "token ids"),
        ("stop_token_ids", r#","stop_token_ids":"A""#, "array"),
        (
            "repetition_penalty",
            r#","repetition_penalty":0"#,
            "greater than 0",
        ),
        (
            "repetition_penalty",
            r#","repetition_penalty":-1"#,
            "greater than 0",
        ),
        (
            "frequency_penalty",
            r#","frequency_penalty":2.5"#,
            "between -2 and 2",
        ),
        (
            "presence_penalty",
            r#","presence_penalty":-2.01"#,
            "between -2 and 2",
        ),
    ] {
        let body = chat_body(&format!(r#","max_tokens":3{extra}"#));
        assert_400(
            &post(&s, "/v1/chat/completions", &body),
            Some(param),
            needle,
        );
    }
    // Without max_tokens, min_tokens raises the default (16) but must fit the context.
    assert_400(
        &post(
            &s,
            "/v1/chat/completions",
            &chat_body(r#","min_tokens":1020"#),
        ),
        Some("min_tokens"),
        "does not fit",
    );
    let many: Vec<String> = (0..=params::MAX_STOP_TOKEN_IDS)
        .map(|i| (i % 40).to_string())
        .collect();
    assert_400(
        &post(
            &s,
            "/v1/completions",
            &comp(&format!(r#","stop_token_ids":[{}]"#, many.join(","))),
        ),
        Some("stop_token_ids"),
        "at most 1024",
    );
    assert!(s.runner.lock().unwrap().log.is_empty(), "nothing ran");
    let ignored: String = fields::IGNORED
        .iter()
        .map(|f| format!(r#","{f}":"x""#))
        .collect();
    for (path, body) in [
        (
            "/v1/chat/completions",
            chat_body(&format!(r#","max_tokens":3{ignored}"#)),
        ),
        ("/v1/completions", comp(&ignored)),
    ] {
        let r = post(&s, path, &body);
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// stop_token_ids on the toy runner, whose ids 0..40 are the letters 'A'..: the generated
/// text stops right before the first letter whose id is listed, and min_tokens lets it
/// pass until enough tokens were generated.
#[test]
fn stop_token_ids_and_min_tokens_reach_the_engine() {
    let s = start(1000);
    let body = |extra: &str| {
        format!(r#"{{"model":"toy","prompt":[5,6,7],"max_tokens":10,"temperature":0{extra}}}"#)
    };
    let text = |extra: &str| {
        let v = post(&s, "/v1/completions", &body(extra)).json();
        let c = &v["choices"][0];
        (
            c["text"].as_str().unwrap().to_owned(),
            c["finish_reason"].as_str().unwrap().to_owned(),
        )
    };
    let (all, fin) = text("");
    assert_eq!((all.len(), fin.as_str()), (10, "length"), "{all}");
    let id = |c: char| c as u32 - 'A' as u32;
    let k = (1..all.len())
        .find(|&k| !all[..k].contains(&all[k..k + 1]))
        .unwrap();
    let stop_at = all.as_bytes()[k] as char;
    assert_eq!(
        text(&format!(r#","stop_token_ids":[{}]"#, id(stop_at))),
        (all[..k].to_owned(), "stop".to_owned())
    );
    // The id is masked until min_tokens: the k-th token becomes another one.
    let (masked, _) = text(&format!(
        r#","stop_token_ids":[{}],"min_tokens":{}"#,
        id(stop_at),
        k + 1
    ));
    assert_eq!(&masked[..k], &all[..k]);
    assert_ne!(masked.as_bytes()[k] as char, stop_at, "{masked}");
    // Default-valued extras change nothing.
    assert_eq!(
        text(
            r#","ignore_eos":false,"min_tokens":0,"stop_token_ids":[],"repetition_penalty":1,"frequency_penalty":0,"presence_penalty":0"#
        ),
        (all, fin)
    );
}
