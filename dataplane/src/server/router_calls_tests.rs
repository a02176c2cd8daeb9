//! The router calls (`/tandem/report`, `/tandem/prompt-keys`), the API keys and the
//! endpoint-picker metrics, over real HTTP against the in-process test server.

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_contract::api_keys::ApiKeys;

use super::test_server::*;
use crate::engine_api::PrefixKeys;
use crate::model::prefix_cache::chain_keys;
use crate::test_support::http_client::{HttpResponse, read_response, request};

/// One request with extra header lines.
fn with_headers(
    s: &TestServer,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &str,
) -> HttpResponse {
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.unwrap_or("");
    write!(
        c,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    read_response(BufReader::new(c))
}

fn keys_of(v: &Value) -> Vec<String> {
    v["keys"]
        .as_array()
        .unwrap_or_else(|| panic!("no keys in {v}"))
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn the_report_carries_load_and_the_prefix_caches_keys_once_a_router_asks() {
    let s = start(1000);
    let r = request(s.addr, "GET", "/tandem/report", None);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    for field in [
        "blockTokens",
        "waiting",
        "running",
        "kvBlocksUsed",
        "kvBlocksTotal",
        "kvCacheUsage",
        "prefixVersion",
        "engineStalledMs",
    ] {
        assert!(v.get(field).is_some(), "{field} in {v}");
    }
    assert_eq!(v["blockTokens"], 4);
    assert_eq!(keys_of(&v), Vec::<String>::new());
    // The runner's cache changes: the engine copies its keys within a period or two.
    s.runner.lock().unwrap().prefix = Some(PrefixKeys {
        version: 5,
        keys: vec![0xff, 0x1234_5678_9abc_def0],
    });
    let start = Instant::now();
    let v = loop {
        let v = request(s.addr, "GET", "/tandem/report", None).json();
        if v["prefixVersion"] == 5 {
            break v;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{v}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(keys_of(&v), ["00000000000000ff", "123456789abcdef0"]);
    // Unchanged since the version the router holds: no keys sent again.
    let v = request(s.addr, "GET", "/tandem/report?since=5", None).json();
    assert_eq!(
        (v["prefixVersion"].as_u64(), v.get("keys")),
        (Some(5), None)
    );
    let v = request(s.addr, "GET", "/tandem/report?since=4", None).json();
    assert_eq!(keys_of(&v).len(), 2);
}

/// `engineStalledMs`: zero while idle; growing while a request waits on an engine that
/// does not step; zero again once it has.
#[test]
fn the_report_says_how_long_the_engine_has_had_work_without_a_step() {
    let s = start(1000);
    let stalled = || {
        request(s.addr, "GET", "/tandem/report", None).json()["engineStalledMs"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(stalled(), 0, "idle");
    s.runner.lock().unwrap().step_delay = Duration::from_millis(1500);
    let client = chat_in_background(s.addr);
    let t = Instant::now();
    while stalled() < 500 {
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "never reported stalled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s.runner.lock().unwrap().step_delay = Duration::ZERO;
    assert_eq!(client.join().unwrap().status, 200);
    // The engine marks itself idle when it next goes round, just after the answer.
    let t = Instant::now();
    while stalled() != 0 {
        assert!(t.elapsed() < Duration::from_secs(1), "never idle again");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn prompt_keys_are_the_engines_chained_block_keys_of_the_prompt_the_request_would_run() {
    let s = start(1000);
    // Token ids: exactly the prefix cache's keys of their whole blocks.
    let r = post(
        &s,
        "/tandem/prompt-keys?api=completions",
        r#"{"prompt":[1,2,3,4,5,6,7,8,9]}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let want: Vec<String> = chain_keys(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
        .iter()
        .map(|k| format!("{k:016x}"))
        .collect();
    assert_eq!((keys_of(&v), v["promptTokens"].as_u64()), (want, Some(9)));
    // A chat request: as many tokens as the request itself reports running.
    let body = chat_body("");
    let keys = post(&s, "/tandem/prompt-keys?api=chat", &body).json();
    let ran = post(&s, "/v1/chat/completions", &body).json();
    assert_eq!(
        keys["promptTokens"], ran["usage"]["prompt_tokens"],
        "{keys} {ran}"
    );
    let n = keys["promptTokens"].as_u64().unwrap() as usize;
    assert_eq!(keys_of(&keys).len(), n / 4, "whole blocks only");
    // Two users behind one system prompt share its leading blocks.
    let chat = |user: &str| {
        format!(
            r#"{{"messages":[{{"role":"system","content":"You are a careful assistant for the team."}},{{"role":"user","content":"{user}"}}]}}"#
        )
    };
    let a = keys_of(&post(&s, "/tandem/prompt-keys?api=chat", &chat("first question")).json());
    let b = keys_of(&post(&s, "/tandem/prompt-keys?api=chat", &chat("another one")).json());
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(
        shared >= 10 && shared < a.len().min(b.len()),
        "{shared} of {a:?} / {b:?}"
    );
    // Nothing generated for these calls; an unnamed API or a bad body is a 400.
    assert_eq!(post(&s, "/tandem/prompt-keys", &body).status, 400);
    assert_eq!(post(&s, "/tandem/prompt-keys?api=chat", "{").status, 400);
}

#[test]
fn with_api_keys_the_api_needs_a_bearer_key_and_probes_stay_open() {
    let s = start_with_keys(ApiKeys::from_parts(Some("sk-test-1"), None).unwrap());
    let body = chat_body("");
    for (path, method) in [
        ("/v1/chat/completions", "POST"),
        ("/v1/models", "GET"),
        ("/tandem/report", "GET"),
        ("/tandem/prompt-keys?api=chat", "POST"),
    ] {
        let r = with_headers(&s, method, path, Some(&body), "");
        assert_eq!(r.status, 401, "{path}: {}", r.body);
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["code"], "missing_api_key", "{v}");
    }
    let r = with_headers(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        "Authorization: Bearer sk-test-2\r\n",
    );
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    assert!(!r.body.contains("sk-test"), "{}", r.body);
    let r = with_headers(
        &s,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        "Authorization: Bearer sk-test-1\r\n",
    );
    assert_eq!(r.status, 200, "{}", r.body);
    for path in ["/health", "/ready", "/metrics"] {
        assert_eq!(request(s.addr, "GET", path, None).status, 200, "{path}");
    }
    let m = request(s.addr, "GET", "/metrics", None).body;
    assert!(
        m.contains(r#"tandem_http_rejected_requests_total{reason="missing_api_key"} 4"#)
            && m.contains(r#"tandem_http_rejected_requests_total{reason="invalid_api_key"} 1"#),
        "{m}"
    );
}

#[test]
fn the_endpoint_picker_metrics_are_exported() {
    let s = start(1000);
    assert_eq!(post(&s, "/v1/chat/completions", &chat_body("")).status, 200);
    let m = request(s.addr, "GET", "/metrics", None).body;
    for series in [
        "tandem_requests_waiting ",
        "tandem_requests_running ",
        "tandem_kv_cache_usage_perc ",
    ] {
        assert!(m.contains(series), "{series} in {m}");
    }
    let metrics = crate::metrics::Metrics::new();
    metrics.set_cache_config(16, 512);
    assert!(
        metrics
            .encode()
            .contains(r#"tandem_cache_config_info{block_size="16",num_gpu_blocks="512"} 1"#),
        "{}",
        metrics.encode()
    );
}
