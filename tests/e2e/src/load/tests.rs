//! The recovery columns from made-up outcomes, and the client against a real HTTP server
//! on the loopback interface that answers, refuses and hangs in turn.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

fn at(sent_ms: u64, ended_ms: u64, outcome: Outcome) -> Sample {
    Sample {
        sent: Duration::from_millis(sent_ms),
        ended: Duration::from_millis(ended_ms),
        outcome,
    }
}

const FAULT: Duration = Duration::from_secs(10);
const TIMEOUT: Duration = Duration::from_secs(15);

#[test]
fn the_columns_follow_the_requests_after_the_fault() {
    let refused = || Outcome::Refused(503, "no_ready_group".into());
    let samples = [
        // Ended before the fault: not counted, however it ended.
        at(9_000, 9_100, Outcome::Timeout),
        // In flight when the fault came: counted (its wait is the longest).
        at(9_800, 13_400, Outcome::Ok),
        at(10_000, 13_000, Outcome::Timeout),
        at(10_500, 12_000, refused()),
        at(11_000, 11_200, refused()),
        // An answer between failures is not "served again" yet.
        at(11_500, 11_600, Outcome::Ok),
        at(12_000, 12_100, Outcome::Error),
        at(12_500, 14_000, Outcome::Ok),
        at(13_000, 13_500, Outcome::Ok),
    ];
    let r = recovery(&samples, FAULT, TIMEOUT);
    assert_eq!(r.requests, 8);
    assert_eq!(r.failed, 4);
    // The first refusal answered (11.2 s), not the first sent (12.0 s).
    assert_eq!(r.refused_after, Some(1.2));
    // The first answer of the requests sent after the last failure (sent 12.0 s): 13.5 s.
    assert_eq!(r.served_again, Some(3.5));
    assert_eq!(r.longest_wait, 3.6);
    let outcomes: Vec<(&str, usize)> = r
        .outcomes
        .iter()
        .map(|(o, n)| (o.as_str(), n.count))
        .collect();
    assert_eq!(
        outcomes,
        [
            ("connection error", 1),
            ("refused 503 no_ready_group", 2),
            ("timeout", 1)
        ]
    );
    let refused = r.outcomes["refused 503 no_ready_group"];
    assert_eq!((refused.first_sent, refused.last_sent), (0.5, 1.0));
    assert_eq!(
        r.to_string(),
        "refused after 1.20 s, longest wait 3.60 s, served again 3.50 s, failed 4 of 8: \
         connection error ×1 sent 2.0–2.0 s, refused 503 no_ready_group ×2 sent 0.5–1.0 s, \
         timeout ×1 sent 0.0–0.0 s"
    );
}

#[test]
fn no_failure_is_served_at_once_and_a_wait_is_capped_at_the_timeout() {
    let samples = [
        at(10_000, 10_100, Outcome::Ok),
        at(10_200, 40_000, Outcome::Ok),
    ];
    let r = recovery(&samples, FAULT, TIMEOUT);
    assert_eq!(
        (r.failed, r.served_again, r.refused_after),
        (0, Some(0.0), None)
    );
    assert_eq!(r.longest_wait, 15.0);
    // Failures and nothing served after them: not served again.
    let r = recovery(&[at(10_000, 25_000, Outcome::Timeout)], FAULT, TIMEOUT);
    assert_eq!((r.failed, r.served_again), (1, None));
}

/// An HTTP server answering its `n`th request by `n % 3`: 200, 503 with an error code, or
/// never (the connection held open).
async fn server() -> (String, Arc<AtomicU32>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let served = Arc::new(AtomicU32::new(0));
    let n = served.clone();
    tokio::spawn(async move {
        loop {
            let (mut c, _) = l.accept().await.unwrap();
            let i = n.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                // The whole request: headers, then the body its length says.
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let k = c.read(&mut chunk).await.unwrap_or(0);
                    if k == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..k]);
                    let text = String::from_utf8_lossy(&buf);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(str::to_owned)
                            })
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let (status, body) = match i % 3 {
                    0 => ("200 OK", "{}".to_owned()),
                    1 => (
                        "503 Service Unavailable",
                        json!({"error": {"code": "no_ready_group", "message": "x"}}).to_string(),
                    ),
                    _ => {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        return;
                    }
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = c.write_all(resp.as_bytes()).await;
            });
        }
    });
    (addr, served)
}

#[tokio::test]
async fn every_request_sent_ends_answered_refused_or_timed_out() {
    let (addr, served) = server().await;
    let timeout = Duration::from_millis(300);
    let load = Load::start(
        &addr,
        "/v1/chat/completions",
        |n| json!({"model": "m", "n": n}),
        Duration::from_millis(50),
        timeout,
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let samples = load.stop().await;
    // Stopping waits for the requests in flight: every one the server saw is a sample.
    assert_eq!(samples.len() as u32, served.load(Ordering::SeqCst));
    assert!(samples.len() >= 6, "{} requests in 600 ms", samples.len());
    for s in &samples {
        let wait = s.ended - s.sent;
        match &s.outcome {
            Outcome::Ok => {}
            Outcome::Refused(status, code) => {
                assert_eq!((*status, code.as_str()), (503, "no_ready_group"))
            }
            Outcome::Timeout => assert!(wait >= timeout, "timed out after {wait:?}"),
            Outcome::Error => panic!("no connection fails here: {s:?}"),
        }
    }
    let count = |o: fn(&Outcome) -> bool| samples.iter().filter(|s| o(&s.outcome)).count();
    let (ok, refused, timeouts) = (
        count(|o| *o == Outcome::Ok),
        count(|o| matches!(o, Outcome::Refused(..))),
        count(|o| *o == Outcome::Timeout),
    );
    // The server's turns, in the order it accepted: a third each (give or take one).
    let third = samples.len() / 3;
    for n in [ok, refused, timeouts] {
        assert!(
            n + 1 >= third && n <= third + 1,
            "{ok} ok, {refused} refused, {timeouts} timed out"
        );
    }
    let r = recovery(&samples, Duration::ZERO, timeout);
    assert_eq!(r.failed, refused + timeouts);
    assert!(r.refused_after.is_some());
    assert!((r.longest_wait - timeout.as_secs_f64()).abs() < 1e-9);
}

#[tokio::test]
async fn a_closed_port_is_a_connection_error() {
    // A port bound and closed again: nothing listens there.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let load = Load::start(
        &addr,
        "/",
        |_| json!({}),
        Duration::from_millis(50),
        Duration::from_secs(1),
    );
    tokio::time::sleep(Duration::from_millis(120)).await;
    let samples = load.stop().await;
    assert!(!samples.is_empty());
    assert!(
        samples.iter().all(|s| s.outcome == Outcome::Error),
        "{samples:?}"
    );
}
