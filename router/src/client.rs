//! One HTTP/1.1 exchange with a decode on its own connection: the connection lives as long
//! as the response (its body included), so dropping the response closes it, which aborts
//! the request on the decode.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::AbortHandle;

/// How an exchange failed before a response head came back.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// No connection (refused, unreachable, or not within the connect timeout).
    #[error("no connection to {addr}: {why}")]
    Connect { addr: SocketAddr, why: String },
    /// Connected, but the connection failed or closed before a response head.
    #[error("{addr} closed the connection before answering: {why}")]
    Closed { addr: SocketAddr, why: String },
}

/// Aborts a task when dropped.
pub(crate) struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A response body holding its connection open until it is dropped.
pub struct Upstream {
    body: Incoming,
    _conn: AbortOnDrop,
}

impl hyper::body::Body for Upstream {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Send `req` to `addr` on a new connection; the response head, its body streaming.
pub async fn exchange(
    addr: SocketAddr,
    req: Request<Full<Bytes>>,
    connect_timeout: Duration,
) -> Result<Response<Upstream>, ExchangeError> {
    let stream = match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(ExchangeError::Connect {
                addr,
                why: e.to_string(),
            });
        }
        Err(_) => {
            return Err(ExchangeError::Connect {
                addr,
                why: format!("not within {} ms", connect_timeout.as_millis()),
            });
        }
    };
    let _ = stream.set_nodelay(true);
    let closed = |e: hyper::Error| ExchangeError::Closed {
        addr,
        why: e.to_string(),
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(closed)?;
    let conn = AbortOnDrop(
        tokio::spawn(async move {
            let _ = conn.await;
        })
        .abort_handle(),
    );
    let resp = sender.send_request(req).await.map_err(closed)?;
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, Upstream { body, _conn: conn }))
}

/// A small exchange read whole: status and body, all within `timeout`.
pub async fn fetch(
    addr: SocketAddr,
    req: Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<(http::StatusCode, Bytes), String> {
    let run = async {
        let resp = exchange(addr, req, timeout)
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{addr}: the body broke off: {e}"))?
            .to_bytes();
        Ok::<_, String>((status, body))
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "{addr}: no answer within {} ms",
            timeout.as_millis()
        )),
    }
}
