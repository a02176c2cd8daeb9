//! Readiness probes of member processes: `GET /ready` with a timeout, as the kubelet's
//! HTTP probe does (`timeoutSeconds: 1`).
//!
//! Until a member has answered 200 once, it is probed every [`STARTUP_POLL`] — the local
//! counterpart of a startup probe with a short period — so a group comes up as soon as its
//! members do instead of a probe period later. From its first success on, it is probed at
//! the spec's `health.probePeriodSeconds`, and [`super::member::Readiness`] applies
//! `failureThreshold`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::mpsc::UnboundedSender;

use super::member::ProbeOutcome;
use super::runtime::Input;

/// Probe timeout (the kubelet's default `timeoutSeconds`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Probe period until the first success.
pub const STARTUP_POLL: Duration = Duration::from_millis(250);
/// Largest probe body read.
const MAX_BODY: usize = 64 << 10;

/// One HTTP/1.1 GET on a fresh connection, bounded by `timeout` as a whole. Nothing
/// outlives the call: on timeout the connection is dropped with the future.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), String> {
    let exchange = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake with {addr}: {e}"))?;
        let req = Request::get(path)
            .header(header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        // The sender moves into the request, so the connection closes once it is done.
        let request = async move {
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| format!("GET {path}: {e}"))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| format!("reading {path}: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        let (result, _) = futures::join!(request, conn);
        result
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("timed out after {}s", timeout.as_secs_f64())),
    }
}

/// Classify a `/ready` answer. A not-ready body's failing checks become the reason.
pub fn outcome(result: Result<(StatusCode, Bytes), String>) -> ProbeOutcome {
    match result {
        Ok((s, _)) if s == StatusCode::OK => ProbeOutcome::Ready,
        Ok((s, body)) => {
            let failing = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
                let checks = v["checks"].as_array()?;
                let bad: Vec<String> = checks
                    .iter()
                    .filter(|c| c["ok"] == Value::Bool(false))
                    .map(|c| {
                        format!(
                            "{}: {}",
                            c["name"].as_str().unwrap_or("?"),
                            c["detail"].as_str().unwrap_or("")
                        )
                    })
                    .collect();
                (!bad.is_empty()).then(|| bad.join("; "))
            });
            ProbeOutcome::NotReady(failing.unwrap_or_else(|| format!("/ready answered {s}")))
        }
        Err(e) => ProbeOutcome::Unreachable(e),
    }
}

/// Probe `addr` until the runtime goes away (the task is aborted when the member exits).
pub async fn run(pod: String, addr: SocketAddr, period: Duration, tx: UnboundedSender<Input>) {
    let mut succeeded = false;
    loop {
        let result = outcome(get(addr, "/ready", PROBE_TIMEOUT).await);
        succeeded |= result == ProbeOutcome::Ready;
        if tx
            .send(Input::Probe {
                pod: pod.clone(),
                outcome: result,
            })
            .is_err()
        {
            return;
        }
        tokio::time::sleep(if succeeded { period } else { STARTUP_POLL }).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_classified_with_their_reason() {
        assert_eq!(
            outcome(Ok((StatusCode::OK, Bytes::new()))),
            ProbeOutcome::Ready
        );
        let body = br#"{"ready":false,"checks":[{"name":"engine_heartbeat","ok":true,"detail":"fine"},{"name":"kv_channel","ok":false,"detail":"no PONG from 127.0.0.1:5 for 3s"}]}"#;
        assert_eq!(
            outcome(Ok((
                StatusCode::SERVICE_UNAVAILABLE,
                Bytes::from_static(body)
            ))),
            ProbeOutcome::NotReady("kv_channel: no PONG from 127.0.0.1:5 for 3s".into())
        );
        assert_eq!(
            outcome(Ok((StatusCode::NOT_FOUND, Bytes::from_static(b"nope")))),
            ProbeOutcome::NotReady("/ready answered 404 Not Found".into())
        );
        assert_eq!(
            outcome(Err("connect: refused".into())),
            ProbeOutcome::Unreachable("connect: refused".into())
        );
    }

    #[tokio::test]
    async fn a_server_that_accepts_but_never_answers_times_out() {
        // Like a SIGSTOPped process: the kernel accepts, nobody reads.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let started = std::time::Instant::now();
        let r = get(addr, "/ready", Duration::from_millis(300)).await;
        assert_eq!(r.unwrap_err(), "timed out after 0.3s");
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(listener);
        let r = get(addr, "/ready", Duration::from_millis(300)).await;
        assert!(r.unwrap_err().contains("refused"));
    }
}
