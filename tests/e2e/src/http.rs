//! Plain HTTP/1.1 requests with a deadline (probes, health checks, chat requests), over one
//! fresh TCP connection each, as a kubelet probe or a client pod would make them.

use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Status and body of a response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

async fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<String>,
    timeout: Duration,
) -> Result<Response> {
    let work = async {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        let io = TokioIo::new(stream);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr)
            .header("user-agent", "tandem-e2e");
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let resp = sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        anyhow::Ok(Response {
            status,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        })
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| anyhow!("{method} http://{addr}{path}: no answer within {timeout:?}"))?
}

/// `GET http://<addr><path>`.
pub async fn get(addr: &str, path: &str, timeout: Duration) -> Result<Response> {
    send(addr, "GET", path, None, timeout).await
}

/// `POST http://<addr><path>` with a JSON body.
pub async fn post_json(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<Response> {
    send(addr, "POST", path, Some(body.to_string()), timeout).await
}
