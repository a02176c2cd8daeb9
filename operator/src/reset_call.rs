//! The in-place reset call (docs/in-place-reset.md; `tandem_contract::reset`) as both
//! executors make it: `POST /admin/reset` on the member's HTTP port, signed with the
//! group key, bounded as a whole by the call's timeout. The answer is classified into a
//! [`ResetReply`]; the executors move a member's incarnation on only for
//! [`ResetReply::Ready`].
//!
//! The proof is an HMAC-SHA256 of `tandem_contract::reset::proof_message(role, N)` keyed
//! by the group key, so the key never crosses the wire and a proof seen on the wire only
//! repeats a reset that has happened.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use hmac::{Hmac, Mac};
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use sha2::Sha256;
use tandem_contract::{MemberRole, reset};
use tokio::net::TcpStream;

use crate::role::Role;

/// Largest answer read.
const MAX_BODY: usize = 64 << 10;
/// Time on top of the member's own wait for the connection and the answer to travel.
const SLACK: Duration = Duration::from_secs(1);

/// How a reset call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetReply {
    /// The member serves the new incarnation and is ready there (`reset` false: it already
    /// did, the call was a repeat).
    Ready {
        reset: bool,
        incarnation: String,
        took_ms: u64,
    },
    /// The member answered, but not with ready: its reason (`reset_incomplete`,
    /// `stale_incarnation`, `draining`, `reset_unauthorized`, …) and message.
    Refused {
        status: u16,
        reason: String,
        message: String,
    },
    /// No answer: connection refused, reset or timed out, or an answer that did not parse.
    Failed(String),
}

impl ResetReply {
    /// The metric label of the outcome.
    pub fn outcome(&self) -> &str {
        match self {
            Self::Ready { reset: true, .. } => "ready",
            Self::Ready { reset: false, .. } => "already",
            Self::Refused { reason, .. } => reason,
            Self::Failed(_) => "no_answer",
        }
    }
}

/// The `Authorization` header value of a reset of a `role` member to `to_incarnation`.
pub fn authorization(key: &str, role: Role, to_incarnation: i64) -> String {
    let role = match role {
        Role::Prefill => MemberRole::Prefill,
        Role::Decode => MemberRole::Decode,
    };
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("HMAC takes any key");
    mac.update(reset::proof_message(role, to_incarnation.max(0) as u64).as_bytes());
    format!(
        "{} {}",
        reset::AUTH_SCHEME,
        hex::encode(mac.finalize().into_bytes())
    )
}

#[derive(Deserialize)]
struct ReadyAnswer {
    #[serde(default)]
    ready: bool,
    #[serde(default)]
    reset: bool,
    #[serde(default)]
    incarnation: String,
    #[serde(default)]
    took_ms: u64,
}

#[derive(Deserialize)]
struct ErrorAnswer {
    error: ErrorFields,
}

#[derive(Deserialize)]
struct ErrorFields {
    #[serde(default)]
    message: String,
    #[serde(default)]
    code: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

/// Classify an answer of the reset call.
pub fn classify(status: StatusCode, body: &[u8]) -> ResetReply {
    if status == StatusCode::OK {
        return match serde_json::from_slice::<ReadyAnswer>(body) {
            Ok(a) if a.ready => ResetReply::Ready {
                reset: a.reset,
                incarnation: a.incarnation,
                took_ms: a.took_ms,
            },
            Ok(_) => ResetReply::Refused {
                status: status.as_u16(),
                reason: "reset_incomplete".into(),
                message: "answered 200 without ready".into(),
            },
            Err(e) => ResetReply::Failed(format!("answer of {} is not JSON: {e}", reset::PATH)),
        };
    }
    let (reason, message) = match serde_json::from_slice::<ErrorAnswer>(body) {
        Ok(a) => (
            a.error
                .code
                .or(a.error.kind)
                .unwrap_or_else(|| format!("http_{}", status.as_u16())),
            a.error.message,
        ),
        Err(_) if status == StatusCode::GATEWAY_TIMEOUT => (
            "reset_incomplete".into(),
            String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        ),
        Err(_) => (
            format!("http_{}", status.as_u16()),
            String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        ),
    };
    ResetReply::Refused {
        status: status.as_u16(),
        reason,
        message,
    }
}

/// Ask the member at `addr` to reset to `to_incarnation`, waiting up to `timeout` for it to
/// be ready there (plus a little for the exchange itself).
pub async fn call(
    addr: SocketAddr,
    role: Role,
    to_incarnation: i64,
    key: &str,
    timeout: Duration,
) -> ResetReply {
    let auth = authorization(key, role, to_incarnation);
    let body = serde_json::json!({
        "group_incarnation": to_incarnation,
        "timeout_ms": timeout.as_millis() as u64,
    })
    .to_string();
    let exchange = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake with {addr}: {e}"))?;
        let req = Request::post(reset::PATH)
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, auth)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let request = async move {
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| format!("POST {}: {e}", reset::PATH))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| format!("reading the answer of {}: {e}", reset::PATH))?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        let (result, _) = futures::join!(request, conn);
        result
    };
    match tokio::time::timeout(timeout + SLACK, exchange).await {
        Ok(Ok((status, body))) => classify(status, &body),
        Ok(Err(e)) => ResetReply::Failed(e),
        Err(_) => ResetReply::Failed(format!(
            "POST http://{addr}{}: no answer within {:.1}s",
            reset::PATH,
            (timeout + SLACK).as_secs_f64()
        )),
    }
}

/// How the controller makes reset calls: over HTTP in production ([`HttpResetCaller`]),
/// canned answers in the controller's mock-API tests.
pub trait ResetCaller: Send + Sync {
    fn call(
        &self,
        addr: SocketAddr,
        role: Role,
        to_incarnation: i64,
        key: String,
        timeout: Duration,
    ) -> BoxFuture<'static, ResetReply>;
}

/// [`call`] over a fresh TCP connection.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpResetCaller;

impl ResetCaller for HttpResetCaller {
    fn call(
        &self,
        addr: SocketAddr,
        role: Role,
        to_incarnation: i64,
        key: String,
        timeout: Duration,
    ) -> BoxFuture<'static, ResetReply> {
        Box::pin(async move { call(addr, role, to_incarnation, &key, timeout).await })
    }
}

#[cfg(test)]
mod tests;
