use std::convert::Infallible;

use http::Response;
use hyper::body::Incoming;
use hyper::service::service_fn;
use tokio::net::TcpListener;

use super::*;

#[test]
fn the_proof_depends_on_key_role_and_incarnation() {
    let a = authorization("k1", Role::Prefill, 4);
    let (scheme, proof) = a.split_once(' ').unwrap();
    assert_eq!(scheme, reset::AUTH_SCHEME);
    assert_eq!(proof.len(), 64, "{proof}");
    assert!(
        proof
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(a, authorization("k1", Role::Prefill, 4));
    for other in [
        authorization("k2", Role::Prefill, 4),
        authorization("k1", Role::Decode, 4),
        authorization("k1", Role::Prefill, 5),
    ] {
        assert_ne!(a, other);
    }
}

#[test]
fn answers_are_classified() {
    let ok = br#"{"group_incarnation":3,"incarnation":"00ff00ff00ff00ff","reset":true,"ready":true,"took_ms":412,"rooms_ended":2}"#;
    assert_eq!(
        classify(StatusCode::OK, ok),
        ResetReply::Ready {
            reset: true,
            incarnation: "00ff00ff00ff00ff".into(),
            took_ms: 412
        }
    );
    let stale = br#"{"error":{"message":"asked for 2, serving 3","type":"invalid_request_error","param":null,"code":"stale_incarnation"}}"#;
    let r = classify(StatusCode::CONFLICT, stale);
    assert_eq!(r.outcome(), "stale_incarnation");
    assert!(matches!(r, ResetReply::Refused { status: 409, .. }));
    let incomplete = br#"{"group_incarnation":3,"ready":false}"#;
    assert_eq!(
        classify(StatusCode::GATEWAY_TIMEOUT, incomplete).outcome(),
        "reset_incomplete"
    );
    assert_eq!(
        classify(StatusCode::NOT_FOUND, b"nope").outcome(),
        "http_404"
    );
    assert!(matches!(
        classify(StatusCode::OK, b"not json"),
        ResetReply::Failed(_)
    ));
}

/// A one-connection server that records the request it got and answers `status`, `body`
/// after `delay`.
async fn serve_once(
    status: StatusCode,
    body: &'static str,
    delay: Duration,
) -> (
    SocketAddr,
    tokio::task::JoinHandle<Option<(String, String, String)>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.ok()?;
        let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
        let keep = seen.clone();
        let svc = service_fn(move |req: Request<Incoming>| {
            let keep = keep.clone();
            async move {
                let auth = req
                    .headers()
                    .get(header::AUTHORIZATION)
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                let line = format!("{} {}", req.method(), req.uri().path());
                let b = req.into_body().collect().await.unwrap().to_bytes();
                *keep.lock().unwrap() =
                    Some((line, auth, String::from_utf8_lossy(&b).into_owned()));
                tokio::time::sleep(delay).await;
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(status)
                        .body(Full::new(Bytes::from_static(body.as_bytes())))
                        .unwrap(),
                )
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), svc)
            .await;
        seen.lock().unwrap().take()
    });
    (addr, task)
}

#[tokio::test]
async fn the_call_posts_a_signed_body_and_reads_the_answer() {
    let (addr, server) = serve_once(
        StatusCode::OK,
        r#"{"group_incarnation":7,"incarnation":"0123456789abcdef","reset":true,"ready":true,"took_ms":3}"#,
        Duration::ZERO,
    )
    .await;
    let reply = call(addr, Role::Decode, 7, "key", Duration::from_secs(2)).await;
    assert_eq!(
        reply,
        ResetReply::Ready {
            reset: true,
            incarnation: "0123456789abcdef".into(),
            took_ms: 3
        }
    );
    let (line, auth, body) = server.await.unwrap().expect("a request");
    assert_eq!(line, format!("POST {}", reset::PATH));
    assert_eq!(auth, authorization("key", Role::Decode, 7));
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["group_incarnation"], 7);
    assert_eq!(body["timeout_ms"], 2000);
}

#[tokio::test]
async fn a_member_that_does_not_answer_in_time_is_a_failure_not_a_wait() {
    let (addr, _server) = serve_once(StatusCode::OK, "{}", Duration::from_secs(30)).await;
    let started = std::time::Instant::now();
    let reply = call(addr, Role::Prefill, 2, "key", Duration::from_millis(200)).await;
    assert!(matches!(reply, ResetReply::Failed(_)), "{reply:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closed = listener.local_addr().unwrap();
    drop(listener);
    let reply = call(closed, Role::Prefill, 2, "key", Duration::from_millis(200)).await;
    assert_eq!(reply.outcome(), "no_answer");
}
