//! The operator's own HTTP endpoint: `/metrics`, `/health`, `/ready`.
//!
//! `/health` answers 200 while the process serves HTTP at all.
//! `/ready` answers 200 when this replica is doing its job:
//! - without leader election: once the controller has started;
//! - with leader election: when the last election round (renew, or a check of someone
//!   else's live lease) succeeded recently, and — if we are the leader — the controller
//!   has started. A healthy standby is Ready on purpose: otherwise a Deployment with
//!   several replicas would never finish a rolling update, and `/ready` would only say
//!   who leads (the `tandem_operator_is_leader` metric says that).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::Future;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::metrics::Metrics;

/// Election state as seen by `/ready`.
#[derive(Clone)]
pub struct ElectionView {
    pub leader: watch::Receiver<bool>,
    /// When the last election round succeeded.
    pub last_ok: watch::Receiver<Option<Instant>>,
    /// A round older than this makes the replica not ready.
    pub stale_after: Duration,
}

/// What `/ready` reports.
#[derive(Clone, Default)]
pub struct Readiness {
    pub controller_started: Arc<AtomicBool>,
    pub election: Option<ElectionView>,
}

impl Readiness {
    pub fn set_controller_started(&self, started: bool) {
        self.controller_started.store(started, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        let started = self.controller_started.load(Ordering::SeqCst);
        match &self.election {
            None => started,
            Some(e) => {
                let fresh = e
                    .last_ok
                    .borrow()
                    .is_some_and(|t| t.elapsed() < e.stale_after);
                fresh && (!*e.leader.borrow() || started)
            }
        }
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Answer one request (no I/O).
pub fn route(
    method: &Method,
    path: &str,
    metrics: &Metrics,
    readiness: &Readiness,
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    }
    match path {
        "/metrics" => {
            let mut r = text(StatusCode::OK, metrics.encode());
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            r
        }
        "/health" => text(StatusCode::OK, "ok\n"),
        "/ready" if readiness.is_ready() => text(StatusCode::OK, "ready\n"),
        "/ready" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// Serve until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let (stream, peer): (_, SocketAddr) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let readiness = readiness.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let resp = route(req.method(), req.uri().path(), &metrics, &readiness);
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(%peer, "connection ended: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn body(r: Response<Full<Bytes>>) -> String {
        let b = r.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(b.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn routes() {
        let m = Metrics::new();
        let r = Readiness::default();
        let get = Method::GET;
        assert_eq!(route(&get, "/health", &m, &r).status(), StatusCode::OK);
        assert_eq!(
            route(&get, "/ready", &m, &r).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        r.set_controller_started(true);
        assert_eq!(route(&get, "/ready", &m, &r).status(), StatusCode::OK);
        assert_eq!(route(&get, "/nope", &m, &r).status(), StatusCode::NOT_FOUND);
        assert_eq!(
            route(&Method::POST, "/health", &m, &r).status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
        let metrics = body(route(&get, "/metrics", &m, &r)).await;
        assert!(metrics.contains("tandem_operator_reconciles_total"));
        assert!(metrics.ends_with("# EOF\n"));
    }

    #[test]
    fn readiness_with_election() {
        let (leader_tx, leader) = watch::channel(false);
        let (ok_tx, last_ok) = watch::channel(None);
        let r = Readiness {
            controller_started: Arc::default(),
            election: Some(ElectionView {
                leader,
                last_ok,
                stale_after: Duration::from_secs(30),
            }),
        };
        assert!(!r.is_ready(), "no election round yet");
        ok_tx.send_replace(Some(Instant::now()));
        assert!(r.is_ready(), "healthy standby");
        leader_tx.send_replace(true);
        assert!(!r.is_ready(), "leader without a running controller");
        r.set_controller_started(true);
        assert!(r.is_ready());
    }

    #[tokio::test]
    async fn serves_over_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, mut stop) = watch::channel(false);
        let server = tokio::spawn(serve(
            listener,
            Arc::new(Metrics::new()),
            Readiness::default(),
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        ));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.ends_with("ok\n"));
        stop_tx.send_replace(true);
        server.await.unwrap();
    }
}
