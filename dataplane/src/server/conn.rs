//! One HTTP/1.1 connection, with the limits a public endpoint needs ([`HttpLimits`]):
//!
//! | limit | answer |
//! | --- | --- |
//! | request head larger than `max_header_bytes` | 431, then close (hyper) |
//! | more than `max_headers` headers | 431, then close (hyper) |
//! | body larger than `max_body_bytes` | 413 (the route, before reading a declared length) |
//! | head not complete `header_timeout` after its first byte | 408, then close |
//! | no request for `idle_timeout` (before the first, between keep-alive requests) | close |
//!
//! The two timeouts are kept by [`Timed`], the socket as hyper reads it: it counts the
//! bytes read since the connection last became idle, so it knows whether a request has
//! begun, and fails the read (after writing the 408, when one has) at the deadline. A
//! connection is idle from its start and from the end of each response (when hyper drops
//! the response body), and busy while a request is in flight, when neither deadline runs
//! (a long stream is not a slow client).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::{AppState, Body, HttpLimits, routes};

/// When the drain begins, how long a connection that has not started a request yet gets
/// to start one (it was accepted just before, so its request is on its way).
const FIRST_REQUEST_AT_DRAIN: Duration = Duration::from_millis(500);

/// hyper's default read buffer; a larger header limit enlarges it.
const DEFAULT_READ_BUFFER: usize = 400 * 1024;

const TIMED_OUT_NONE: u8 = 0;
const TIMED_OUT_HEAD: u8 = 1;
const TIMED_OUT_IDLE: u8 = 2;

/// What the socket wrapper and the service share about one connection.
#[derive(Debug)]
struct Activity {
    /// Requests whose response has not ended.
    in_flight: AtomicUsize,
    /// A request has been handed to the service (for the drain).
    started: AtomicBool,
    /// Bytes read from the socket, and how many had been read when it last became idle.
    read: AtomicU64,
    read_at_idle: AtomicU64,
    /// When it last became idle, and when the first byte after that arrived.
    idle_since: Mutex<Instant>,
    head_since: Mutex<Option<Instant>>,
    /// Which deadline closed the connection (`TIMED_OUT_*`).
    timed_out: AtomicU8,
    /// The task that last found nothing to read: woken when a response ends, so that it
    /// reads again and arms the idle deadline (a read pending during the request armed
    /// none).
    reader: Mutex<Option<Waker>>,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            read: AtomicU64::new(0),
            read_at_idle: AtomicU64::new(0),
            idle_since: Mutex::new(Instant::now()),
            head_since: Mutex::new(None),
            timed_out: AtomicU8::new(TIMED_OUT_NONE),
            reader: Mutex::new(None),
        }
    }

    fn request_started(&self) {
        self.started.store(true, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    fn response_ended(&self) {
        if self.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.read_at_idle
                .store(self.read.load(Ordering::Relaxed), Ordering::Relaxed);
            *lock(&self.idle_since) = Instant::now();
            *lock(&self.head_since) = None;
            if let Some(w) = lock(&self.reader).take() {
                w.wake();
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The socket as hyper reads it: counts what is read and enforces the header and idle
/// deadlines (see the module header).
struct Timed {
    inner: TcpStream,
    activity: Arc<Activity>,
    limits: HttpLimits,
    sleep: Pin<Box<tokio::time::Sleep>>,
    /// The deadline `sleep` is set to.
    armed: Option<Instant>,
}

/// A 408 in OpenAI's error shape, written once when a request head does not arrive in time.
fn request_timeout_response(limit: Duration) -> Vec<u8> {
    let body = format!(
        r#"{{"error":{{"message":"the request head was not received within {} s","type":"invalid_request_error","param":null,"code":"request_timeout"}}}}"#,
        limit.as_secs_f64()
    );
    format!(
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

impl Timed {
    fn new(inner: TcpStream, activity: Arc<Activity>, limits: HttpLimits) -> Self {
        Self {
            inner,
            activity,
            limits,
            sleep: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
            armed: None,
        }
    }

    /// The deadline that applies now, and which one it is.
    fn deadline(&self) -> Option<(Instant, u8)> {
        let a = &self.activity;
        if a.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        match *lock(&a.head_since) {
            Some(t) => Some((t + self.limits.header_timeout, TIMED_OUT_HEAD)),
            None => Some((
                *lock(&a.idle_since) + self.limits.idle_timeout,
                TIMED_OUT_IDLE,
            )),
        }
    }
}

impl AsyncRead for Timed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = (buf.filled().len() - before) as u64;
                let a = &this.activity;
                let read = a.read.fetch_add(n, Ordering::Relaxed) + n;
                if n > 0 && a.in_flight.load(Ordering::Relaxed) == 0 {
                    let mut head = lock(&a.head_since);
                    if head.is_none() && read > a.read_at_idle.load(Ordering::Relaxed) {
                        *head = Some(Instant::now());
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let Some((at, which)) = this.deadline() else {
                    *lock(&this.activity.reader) = Some(cx.waker().clone());
                    return Poll::Pending;
                };
                if this.armed != Some(at) {
                    this.sleep
                        .as_mut()
                        .reset(tokio::time::Instant::from_std(at));
                    this.armed = Some(at);
                }
                if this.sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.activity.timed_out.store(which, Ordering::Relaxed);
                if which == TIMED_OUT_HEAD {
                    // Best effort: the client is told why before the connection closes.
                    let answer = request_timeout_response(this.limits.header_timeout);
                    let _ = Pin::new(&mut this.inner).poll_write(cx, &answer);
                    let _ = Pin::new(&mut this.inner).poll_flush(cx);
                }
                let what = if which == TIMED_OUT_HEAD {
                    "request head timeout"
                } else {
                    "idle timeout"
                };
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, what)))
            }
        }
    }
}

impl AsyncWrite for Timed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A response body that tells the connection when the response has ended (hyper drops it
/// once written, or when the client goes away).
struct Tracked {
    inner: Body,
    activity: Arc<Activity>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.activity.response_ended();
    }
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pub(super) async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<AppState>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    keep_alive: bool,
) {
    let metrics = state.metrics.clone();
    let limits = state.limits;
    let activity = Arc::new(Activity::new());
    let svc = service_fn({
        let activity = activity.clone();
        move |req| {
            activity.request_started();
            let (state, activity) = (state.clone(), activity.clone());
            async move {
                let res = routes::route(state, req).await;
                Ok::<_, Infallible>(res.map(|inner| {
                    Tracked {
                        inner,
                        activity: activity.clone(),
                    }
                    .boxed_unsync()
                }))
            }
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(keep_alive)
        .max_headers(limits.max_headers)
        .max_header_size(limits.max_header_bytes)
        .max_buf_size(DEFAULT_READ_BUFFER.max(limits.max_header_bytes + 8192))
        .serve_connection(
            TokioIo::new(Timed::new(stream, activity.clone(), limits)),
            svc,
        );
    tokio::pin!(conn);
    let res = tokio::select! {
        r = conn.as_mut() => r,
        // The guard `wait_for` returns is not Send: drop it inside the future. (A
        // connection without keep-alive serves one request and closes by itself.)
        _ = async { drop(stop.wait_for(|s| *s).await) }, if keep_alive => {
            // A connection accepted just before the drain began may not have had its
            // request read yet (a probe, a scrape): a graceful shutdown now would close it
            // unanswered. Let it start its request first (bounded), then finish the
            // request in flight (a stream runs to its end) and close.
            let first_request = async {
                let t0 = tokio::time::Instant::now();
                while !activity.started.load(Ordering::Relaxed) && t0.elapsed() < FIRST_REQUEST_AT_DRAIN {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::select! {
                r = conn.as_mut() => r,
                _ = first_request => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            }
        }
    };
    // A deadline ends the connection whether hyper reports it (a partial head) or takes it
    // for a quiet close (an idle connection).
    let kind = match (activity.timed_out.load(Ordering::Relaxed), &res) {
        (TIMED_OUT_HEAD, _) => Some("timeout"),
        (TIMED_OUT_IDLE, _) => Some("idle_timeout"),
        (_, Err(e)) => Some(connection_error_kind(e)),
        (_, Ok(())) => None,
    };
    if let Some(kind) = kind {
        metrics.connection_error(kind);
        let error = res.err().map(|e| e.to_string()).unwrap_or_default();
        match kind {
            // Typically a client that went away mid-response, or one that stayed quiet:
            // common, not a server fault.
            "io_error" | "idle_timeout" => tracing::debug!(%peer, kind, %error, "connection ended"),
            _ => tracing::info!(%peer, kind, %error, "connection ended with a protocol error"),
        }
    }
}

/// Metric label of an HTTP connection error (hyper answered 400 / 431 itself when it could).
fn connection_error_kind(e: &hyper::Error) -> &'static str {
    if e.is_parse_too_large() {
        "header_too_large"
    } else if e.is_parse() {
        "parse_error"
    } else if e.is_incomplete_message() {
        "incomplete_request"
    } else if e.is_timeout() {
        "timeout"
    } else if e.is_body_write_aborted() {
        "body_write_aborted"
    } else {
        "io_error"
    }
}
