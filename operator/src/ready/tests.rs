//! The body parser against the documented example (docs/readiness.md), and the HTTP read
//! against a real HTTP server on the loopback interface.

use std::convert::Infallible;
use std::net::SocketAddr;

use http::Response;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use super::*;

/// The format-1 example body of docs/readiness.md, as the document shows it: the parser
/// is held to what users are told.
fn documented_body() -> Value {
    let doc = include_str!("../../../docs/readiness.md");
    let start = doc.find("```json\n").expect("a JSON example") + "```json\n".len();
    let len = doc[start..].find("```").expect("the end of the example");
    serde_json::from_str(&doc[start..start + len]).expect("the documented body is JSON")
}

fn bytes(v: &Value) -> Bytes {
    Bytes::from(serde_json::to_vec(v).unwrap())
}

#[test]
fn the_documented_body_parses_with_its_reason() {
    let b = parse(&bytes(&documented_body())).unwrap();
    assert_eq!(b.format, 1);
    assert!(!b.ready);
    assert_eq!(b.role, "decode");
    assert_eq!(b.reason.as_deref(), Some("auth_failed"));
    assert!(
        b.message
            .as_deref()
            .unwrap()
            .starts_with("handshake 10.0.3.7:5600: ")
    );
    let failing: Vec<&str> = b
        .checks
        .iter()
        .filter(|c| !c.ok)
        .map(|c| c.reason.as_deref().unwrap())
        .collect();
    assert_eq!(failing, ["auth_failed", "no_session"]);

    let d = detail(Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        bytes(&documented_body()),
    )))
    .unwrap();
    assert_eq!(d.reason, "auth_failed");
    assert_eq!(d.message, b.message.unwrap());
}

#[test]
fn what_stalled_reaches_the_detail_and_a_body_without_it_says_nothing() {
    let mut v = documented_body();
    v["reason"] = json!("no_progress");
    v["message"] = json!("engine_progress: kv_transfer: KV bytes in flight and none moved");
    v["stalled"] = json!("kv_transfer");
    let d = detail(Ok((StatusCode::SERVICE_UNAVAILABLE, bytes(&v)))).unwrap();
    assert_eq!(d.reason, "no_progress");
    assert_eq!(d.stalled.as_deref(), Some("kv_transfer"));
    // An older dataplane's body, without the field: read, with nothing stalled said.
    v.as_object_mut().unwrap().remove("stalled");
    let d = detail(Ok((StatusCode::SERVICE_UNAVAILABLE, bytes(&v)))).unwrap();
    assert_eq!((d.reason.as_str(), d.stalled), ("no_progress", None));
    // The documented body (auth_failed) says `stalled: null`.
    let d = detail(Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        bytes(&documented_body()),
    )))
    .unwrap();
    assert_eq!(d.stalled, None);
}

#[test]
fn fields_added_later_are_ignored_but_another_format_is_refused() {
    let mut v = documented_body();
    v["new_field"] = json!({"x": 1});
    assert!(
        parse(&bytes(&v)).is_ok(),
        "new fields may appear in any version"
    );

    // A format 2 body that dropped `checks`: refused for its version, not a missing field.
    let v2 = json!({"format": 2, "ready": false, "reason": "auth_failed"});
    assert_eq!(parse(&bytes(&v2)), Err(BodyError::UnknownFormat(2)));
    let d = detail(Ok((StatusCode::SERVICE_UNAVAILABLE, bytes(&v2)))).unwrap();
    assert_eq!(d.reason, "probe_unknown_format");
    assert_eq!(
        d.message,
        "/ready body has format 2; this operator reads format 1 (answered 503 Service Unavailable)"
    );
}

#[test]
fn unreadable_answers_are_reasons() {
    let d = |status: StatusCode, body: &'static [u8]| {
        detail(Ok((status, Bytes::from_static(body)))).unwrap()
    };
    let html = d(StatusCode::SERVICE_UNAVAILABLE, b"<html>busy</html>");
    assert_eq!(html.reason, "probe_malformed");
    assert!(
        html.message.contains("not format-1 JSON"),
        "{}",
        html.message
    );

    let mut no_reason = documented_body();
    no_reason["reason"] = Value::Null;
    let no_reason = detail(Ok((StatusCode::SERVICE_UNAVAILABLE, bytes(&no_reason)))).unwrap();
    assert_eq!(no_reason.reason, "probe_malformed");
    assert!(
        no_reason.message.contains("no reason"),
        "{}",
        no_reason.message
    );

    let mut says_ready = documented_body();
    says_ready["ready"] = json!(true);
    let says_ready = detail(Ok((StatusCode::SERVICE_UNAVAILABLE, bytes(&says_ready)))).unwrap();
    assert_eq!(says_ready.reason, "probe_malformed");

    let gone = detail(Err("connect 10.0.0.1:8000: Connection refused".into())).unwrap();
    assert_eq!(gone.reason, "probe_unreachable");
    assert_eq!(gone.message, "connect 10.0.0.1:8000: Connection refused");
    for r in [UNREACHABLE, UNKNOWN_FORMAT, MALFORMED] {
        assert!(is_read_failure(r));
    }
    assert!(!is_read_failure("auth_failed"));
}

#[test]
fn a_ready_answer_is_no_detail() {
    assert_eq!(detail(Ok((StatusCode::OK, Bytes::new()))), None);
}

/// A real HTTP/1.1 server on 127.0.0.1 that answers every request with `status` and
/// `body`, and records the request targets it saw.
async fn serve(
    status: StatusCode,
    body: Bytes,
) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (body, tx) = (body.clone(), tx.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let _ = tx.send(req.uri().to_string());
                    let body = body.clone();
                    async move {
                        Ok::<_, Infallible>(
                            Response::builder()
                                .status(status)
                                .header(header::CONTENT_TYPE, "application/json")
                                .body(Full::new(body))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, rx)
}

#[tokio::test]
async fn the_http_fetcher_reads_a_served_body() {
    let (addr, mut seen) = serve(StatusCode::SERVICE_UNAVAILABLE, bytes(&documented_body())).await;
    let answer = HttpFetcher::default().fetch(addr).await;
    assert_eq!(seen.recv().await.as_deref(), Some("/ready"));
    let d = detail(answer).unwrap();
    assert_eq!(d.reason, "auth_failed");
    assert!(
        d.message.contains("WELCOME MAC does not verify"),
        "{}",
        d.message
    );
}

#[tokio::test]
async fn a_silent_or_absent_server_is_unreachable_within_the_timeout() {
    // Like a SIGSTOPped process: the kernel accepts, nobody reads.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fetcher = HttpFetcher {
        timeout: Duration::from_millis(300),
    };
    let started = std::time::Instant::now();
    let d = detail(fetcher.fetch(addr).await).unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(d.reason, "probe_unreachable");
    assert_eq!(
        d.message,
        format!("GET http://{addr}/ready: timed out after 0.3s")
    );
    drop(listener);
    let d = detail(fetcher.fetch(addr).await).unwrap();
    assert_eq!(d.reason, "probe_unreachable");
    assert!(d.message.contains("refused"), "{}", d.message);
}
