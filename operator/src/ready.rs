//! Reading a dataplane's `GET /ready` (docs/readiness.md): the HTTP exchange, bounded as a
//! kubelet probe is, and the body's format 1, read with serde. Both executors use it to
//! tell the planner why a running decode is not ready ([`ReadyDetail`]): the Kubernetes
//! controller asks each not-ready decode pod itself, the local runtime reads the bodies of
//! its own probes.
//!
//! A body that cannot be read is a reason too, never an error of the caller:
//! `probe_unreachable` (no answer within the timeout: refused, reset, timed out),
//! `probe_unknown_format` (a `format` this operator does not know: the reader refuses it
//! rather than guess at fields whose meaning may have changed) and `probe_malformed` (not
//! format-1 JSON).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpStream;

use crate::planner::ReadyDetail;

/// The `/ready` body format this operator reads.
pub const FORMAT: u64 = 1;
/// Timeout of one read (the kubelet's default probe `timeoutSeconds`).
pub const TIMEOUT: Duration = Duration::from_secs(1);
/// Largest body read.
const MAX_BODY: usize = 64 << 10;

/// Reasons of a body that could not be read.
pub const UNREACHABLE: &str = "probe_unreachable";
pub const UNKNOWN_FORMAT: &str = "probe_unknown_format";
pub const MALFORMED: &str = "probe_malformed";

/// The fields of a format-1 body the operator uses; other fields (and fields added later,
/// which the format allows) are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ReadyBody {
    pub format: u64,
    pub ready: bool,
    pub role: String,
    pub reason: Option<String>,
    pub message: Option<String>,
    /// What the first failing check says stalled (`no_progress`: `engine` or
    /// `kv_transfer`); absent from older dataplanes.
    #[serde(default)]
    pub stalled: Option<String>,
    pub checks: Vec<Check>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub reason: Option<String>,
    pub detail: String,
}

/// Why a body could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("/ready body has format {0}; this operator reads format {FORMAT}")]
    UnknownFormat(u64),
    #[error("/ready body is not format-{FORMAT} JSON: {0}")]
    Malformed(String),
}

impl BodyError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownFormat(_) => UNKNOWN_FORMAT,
            Self::Malformed(_) => MALFORMED,
        }
    }
}

/// Parse a body: the version first (a later format may lack format-1 fields, and must be
/// refused for its version, not for a missing field), then the fields.
pub fn parse(body: &[u8]) -> Result<ReadyBody, BodyError> {
    #[derive(Deserialize)]
    struct Version {
        format: u64,
    }
    let v: Version =
        serde_json::from_slice(body).map_err(|e| BodyError::Malformed(e.to_string()))?;
    if v.format != FORMAT {
        return Err(BodyError::UnknownFormat(v.format));
    }
    let b: ReadyBody =
        serde_json::from_slice(body).map_err(|e| BodyError::Malformed(e.to_string()))?;
    if !b.ready && b.reason.is_none() {
        return Err(BodyError::Malformed("not ready, but no reason".into()));
    }
    Ok(b)
}

/// What one read of `/ready` says about a pod that the kubelet reports not ready: `None`
/// when the process now answers ready (the kubelet will follow), else the reason and
/// message of the body, or why the body could not be read.
pub fn detail(answer: Result<(StatusCode, Bytes), String>) -> Option<ReadyDetail> {
    let (status, body) = match answer {
        Ok(a) => a,
        Err(e) => {
            return Some(ReadyDetail::new(UNREACHABLE, e));
        }
    };
    if status == StatusCode::OK {
        return None;
    }
    match parse(&body) {
        Ok(b) if b.ready => Some(ReadyDetail::new(
            MALFORMED,
            format!("/ready answered {status} with a body that says ready"),
        )),
        Ok(b) => Some(ReadyDetail {
            stalled: b.stalled,
            ..ReadyDetail::new(b.reason.unwrap_or_default(), b.message.unwrap_or_default())
        }),
        Err(e) => Some(ReadyDetail::new(
            e.reason(),
            format!("{e} (answered {status})"),
        )),
    }
}

/// Whether `reason` is one of the operator's own (the body could not be read), which are
/// worth a log line; the dataplane logs its own reasons.
pub fn is_read_failure(reason: &str) -> bool {
    matches!(reason, UNREACHABLE | UNKNOWN_FORMAT | MALFORMED)
}

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
        Err(_) => Err(format!(
            "GET http://{addr}{path}: timed out after {}s",
            timeout.as_secs_f64()
        )),
    }
}

/// How the controller reads a pod's `/ready`: over HTTP in production ([`HttpFetcher`]),
/// canned answers in the controller's mock-API tests.
pub trait ReadyFetcher: Send + Sync {
    /// The raw answer of `GET http://{addr}/ready`, or why there was none.
    fn fetch(&self, addr: SocketAddr) -> BoxFuture<'static, Result<(StatusCode, Bytes), String>>;
}

/// `GET /ready` over a fresh TCP connection, bounded by `timeout`.
#[derive(Debug, Clone, Copy)]
pub struct HttpFetcher {
    pub timeout: Duration,
}

impl Default for HttpFetcher {
    fn default() -> Self {
        Self { timeout: TIMEOUT }
    }
}

impl ReadyFetcher for HttpFetcher {
    fn fetch(&self, addr: SocketAddr) -> BoxFuture<'static, Result<(StatusCode, Bytes), String>> {
        Box::pin(get(addr, "/ready", self.timeout))
    }
}

#[cfg(test)]
mod tests;
