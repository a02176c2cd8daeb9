//! The route table and the limits of a public endpoint, over real TCP: each limit answered
//! with its 4xx (or a close, for an idle connection) and counted.

use std::io::{Read, Write};
use std::net::TcpStream;

use http::Method;

use super::routes::{Handler, ROUTES};
use super::test_server::*;
use super::*;
use crate::scheduler::SchedulerConfig;
use crate::test_support::http_client::request;

fn start_limited(limits: HttpLimits) -> TestServer {
    let secs = Duration::from_secs(5);
    start_full(1000, SchedulerConfig::default(), secs, secs, limits).0
}

/// Write `raw`, then read until the server closes (or 20 s pass).
fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // The server may answer (and close) before it has read everything: ignore a reset.
    let _ = c.write_all(raw);
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    String::from_utf8_lossy(&got).into_owned()
}

fn status_line(answer: &str) -> &str {
    answer.lines().next().unwrap_or("")
}

fn counted(s: &TestServer, series: &str) -> bool {
    let m = request(s.addr, "GET", "/metrics", None).body;
    let found = m.contains(series);
    if !found {
        eprintln!("{series} not in:\n{m}");
    }
    found
}

#[test]
fn every_route_of_the_table_answers_its_method_and_counts_under_its_path() {
    let s = start(1000);
    for r in ROUTES {
        if matches!(r.handler, Handler::DebugFault | Handler::Reset) {
            // Only with --fault-injection, and only for the PD roles: absent here (role
            // `both`), like any unknown path.
            let got = request(s.addr, r.method.as_str(), r.path, Some("{}"));
            assert_eq!(got.status, 404, "{}", r.path);
            continue;
        }
        let body = (r.method == Method::POST).then(|| chat_body(""));
        let got = request(s.addr, r.method.as_str(), r.path, body.as_deref());
        assert!(
            got.status != 404 && got.status != 405,
            "{} {}: {}",
            r.method,
            r.path,
            got.status
        );
        let series = format!(
            r#"tandem_http_requests_total{{endpoint="{}",status="{}"}}"#,
            r.path, got.status
        );
        assert!(counted(&s, &series), "{series}");
    }
}

#[test]
fn a_wrong_method_is_405_with_allow_and_an_unknown_path_404() {
    let s = start(1000);
    let raw = b"DELETE /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let answer = exchange(s.addr, raw);
    assert!(status_line(&answer).contains("405"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("allow: post\r\n"),
        "the methods the path takes: {answer}"
    );
    let answer = exchange(
        s.addr,
        b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
    assert!(
        answer.to_ascii_lowercase().contains("allow: get\r\n"),
        "{answer}"
    );
    let r = request(s.addr, "GET", "/v2/nothing", None);
    assert_eq!(r.status, 404);
    assert!(counted(
        &s,
        r#"tandem_http_requests_total{endpoint="other",status="404"}"#
    ));
}

#[test]
fn a_head_over_the_size_limit_or_with_too_many_headers_is_431() {
    let s = start_limited(HttpLimits {
        max_header_bytes: 16 << 10,
        max_headers: 20,
        ..HttpLimits::default()
    });
    let big = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(20 << 10)
    );
    let answer = exchange(s.addr, big.as_bytes());
    assert!(status_line(&answer).contains("431"), "{answer}");
    let mut many = String::from("GET /health HTTP/1.1\r\nHost: x\r\n");
    for i in 0..30 {
        many.push_str(&format!("X-H{i}: v\r\n"));
    }
    many.push_str("\r\n");
    let answer = exchange(s.addr, many.as_bytes());
    assert!(status_line(&answer).contains("431"), "{answer}");
    // Within both limits: served.
    let mut fine = String::from("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for i in 0..10 {
        fine.push_str(&format!("X-H{i}: {}\r\n", "v".repeat(100)));
    }
    fine.push_str("\r\n");
    assert!(status_line(&exchange(s.addr, fine.as_bytes())).contains("200"));
    assert!(counted(
        &s,
        r#"tandem_http_connection_errors_total{kind="header_too_large"} 2"#
    ));
}

#[test]
fn a_body_over_the_limit_is_413_declared_or_not() {
    let s = start_limited(HttpLimits {
        max_body_bytes: 1024,
        ..HttpLimits::default()
    });
    let long = chat_body(&format!(r#","user":"{}""#, "u".repeat(2000)));
    let r = post(&s, "/v1/chat/completions", &long);
    assert_eq!(r.status, 413, "{}", r.body);
    assert!(
        r.body.contains("body_too_large") && r.body.contains("1024 bytes"),
        "{}",
        r.body
    );
    // Chunked, without a length: refused once the limit is passed.
    let chunked = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{long}\r\n0\r\n\r\n",
        long.len()
    );
    let answer = exchange(s.addr, chunked.as_bytes());
    assert!(status_line(&answer).contains("413"), "{answer}");
    // Within the limit: served.
    assert_eq!(post(&s, "/v1/chat/completions", &chat_body("")).status, 200);
}

#[test]
fn a_head_not_finished_in_time_gets_408_and_an_idle_connection_is_closed() {
    let s = start_limited(HttpLimits {
        header_timeout: Duration::from_millis(600),
        idle_timeout: Duration::from_millis(1500),
        ..HttpLimits::default()
    });
    // Started and never finished: 408 after the header timeout.
    let t = Instant::now();
    let answer = exchange(s.addr, b"GET /health HTTP/1.1\r\nHost: x\r\n");
    let waited = t.elapsed();
    assert!(status_line(&answer).contains("408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    // Nothing sent at all: closed, unanswered, after the idle timeout (not the header's).
    let t = Instant::now();
    let answer = exchange(s.addr, b"");
    let waited = t.elapsed();
    assert_eq!(answer, "", "an idle connection is closed without an answer");
    assert!(
        waited >= Duration::from_millis(1400) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
    // A keep-alive connection is served, then closed after the idle timeout; a request
    // taking longer than both timeouts to answer is not cut (it is in flight).
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = c.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    let t = Instant::now();
    let mut rest = Vec::new();
    let closed = c.read_to_end(&mut rest);
    let waited = t.elapsed();
    assert!(closed.is_ok() && rest.is_empty(), "{closed:?} {rest:?}");
    assert!(
        waited >= Duration::from_millis(1400) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
    assert!(counted(
        &s,
        r#"tandem_http_connection_errors_total{kind="timeout"} 1"#
    ));
    assert!(counted(
        &s,
        r#"tandem_http_connection_errors_total{kind="idle_timeout"} 2"#
    ));
}

#[test]
fn a_stream_longer_than_both_timeouts_is_not_cut() {
    let s = start_limited(HttpLimits {
        header_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(300),
        ..HttpLimits::default()
    });
    // The toy runner takes this long per step: 12 tokens outlast both timeouts.
    s.runner.lock().unwrap().step_delay = Duration::from_millis(100);
    let r = post(
        &s,
        "/v1/chat/completions",
        &chat_body(r#","max_tokens":12,"stream":true,"ignore_eos":true"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
}
