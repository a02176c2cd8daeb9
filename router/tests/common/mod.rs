//! Stand-in decodes and a front server over real sockets, for the router's tests.
//!
//! A stand-in is a small HTTP/1.1 server written on raw TCP, so that a test can make it
//! fail at any point of an exchange: refuse, answer 503, close before its head, close
//! between its head and its first byte, close after its first byte. It serves the two
//! router calls the dataplane serves (`/tandem/report`, `/tandem/prompt-keys`) with the
//! same JSON, and records which prompts it served so that its report holds their keys as
//! a decode's prefix cache would.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tandem_router::{Router, Target, Targets};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a stand-in does with `/v1/*` requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behavior {
    /// 200 with a JSON body naming the stand-in.
    Answer,
    /// 200, chunked: `frames` SSE events `delay` apart, then `[DONE]`.
    Stream { frames: usize, delay_ms: u64 },
    /// 503 with an OpenAI error body.
    Unavailable,
    /// Reads the request, closes without a byte.
    CloseBeforeHead,
    /// Sends a chunked 200 head, then closes before the first chunk.
    CloseAfterHead,
    /// Sends a chunked 200 head and one chunk, then closes.
    CloseAfterFirstByte,
    /// A wedged engine: holds the request `ms` without a byte (reporting
    /// `engineStalledMs` meanwhile), then answers as `Answer` does.
    Hold { ms: u64 },
    /// A decode whose KV never comes (its KV loop stalled): holds the request `ms`
    /// without a byte while its reports say nothing is wrong, then answers as `Answer`.
    AwaitKv { ms: u64 },
}

pub struct StandIn {
    pub name: String,
    pub addr: SocketAddr,
    pub behavior: Mutex<Behavior>,
    /// `/v1/*` requests received.
    pub requests: AtomicUsize,
    pub prompt_key_calls: AtomicUsize,
    /// The keys of the prompts served (a decode's prefix cache, never evicting).
    pub cached: Mutex<BTreeSet<u64>>,
    /// The load it reports.
    pub waiting: AtomicUsize,
    /// Authorization headers seen on `/v1/*`.
    pub auth_seen: Mutex<Vec<Option<String>>>,
    /// When the request it holds (`Hold`) arrived: its engine's stall began.
    pub held_since: Mutex<Option<std::time::Instant>>,
    /// Held requests whose client (the router) went away before the answer.
    pub abandoned: AtomicUsize,
    /// A stopped process (SIGSTOP): every connection, report calls included, is read and
    /// held without an answer until this is cleared (then served as usual) or the client
    /// leaves.
    pub frozen: AtomicBool,
}

/// The stand-in's block keys of a prompt: one per 16 characters of the first message's
/// content, chained (a parent's key goes into its child's), like the engine's.
pub fn keys_of(body: &Value) -> Vec<u64> {
    let text = body["messages"][0]["content"]
        .as_str()
        .or_else(|| body["prompt"].as_str())
        .unwrap_or("");
    let mut parent = 0xcbf2_9ce4_8422_2325u64;
    text.as_bytes()
        .chunks_exact(16)
        .map(|c| {
            for b in c {
                parent = (parent ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
            }
            parent
        })
        .collect()
}

/// A prompt of `blocks` whole blocks for system prompt number `n`.
pub fn system_prompt(n: usize, blocks: usize) -> String {
    let unit = format!("prompt {n:04} txt "); // 16 characters
    assert_eq!(unit.len(), 16);
    unit.repeat(blocks)
}

pub fn chat(system: &str, user: &str, stream: bool) -> Value {
    json!({
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "stream": stream,
    })
}

struct Req {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

async fn read_request(s: &mut TcpStream) -> Option<Req> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.lines();
    let mut first = lines.next()?.split_whitespace();
    let method = first.next()?.to_string();
    let path = first.next()?.to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&tmp[..n]);
    }
    Some(Req {
        method,
        path,
        headers,
        body,
    })
}

async fn respond(s: &mut TcpStream, status: u16, body: &str) {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        503 => "Service Unavailable",
        _ => "Status",
    };
    let _ = s
        .write_all(
            format!(
                "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await;
}

/// Hold the connection `ms` without a byte: whether the client left meanwhile (a read of 0
/// bytes, or an error).
async fn client_left_within(s: &mut TcpStream, ms: u64) -> bool {
    let mut probe = [0u8; 1];
    let left = tokio::time::timeout(Duration::from_millis(ms), s.read(&mut probe)).await;
    matches!(left, Ok(Ok(0)) | Ok(Err(_)))
}

fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

const CHUNKED_HEAD: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";

impl StandIn {
    /// A stand-in listening on a free port.
    pub async fn start(name: &str, behavior: Behavior) -> Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = Arc::new(Self {
            name: name.into(),
            addr: listener.local_addr().unwrap(),
            behavior: Mutex::new(behavior),
            requests: AtomicUsize::new(0),
            prompt_key_calls: AtomicUsize::new(0),
            cached: Mutex::new(BTreeSet::new()),
            waiting: AtomicUsize::new(0),
            auth_seen: Mutex::new(Vec::new()),
            held_since: Mutex::new(None),
            abandoned: AtomicUsize::new(0),
            frozen: AtomicBool::new(false),
        });
        let me = s.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(me.clone().serve(stream));
            }
        });
        s
    }

    /// An address nothing listens on (a dead decode).
    pub async fn dead_addr() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    }

    pub fn set(&self, b: Behavior) {
        *self.behavior.lock().unwrap() = b;
    }

    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// Wait (at most 2 s) until a held request's client went away: the router closed its
    /// connection, which ends the request in a decode.
    pub async fn until_abandoned(&self) {
        tokio::time::timeout(Duration::from_secs(2), async {
            while self.abandoned.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no request held by {} was abandoned", self.name));
    }

    async fn serve(self: Arc<Self>, mut s: TcpStream) {
        let Some(req) = read_request(&mut s).await else {
            return;
        };
        let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
        while self.frozen.load(Ordering::SeqCst) {
            if client_left_within(&mut s, 20).await {
                if req.path.starts_with("/v1/") {
                    self.requests.fetch_add(1, Ordering::SeqCst);
                    self.abandoned.fetch_add(1, Ordering::SeqCst);
                }
                return;
            }
        }
        if req.path.starts_with("/tandem/report") {
            let keys: Vec<String> = self
                .cached
                .lock()
                .unwrap()
                .iter()
                .map(|k| format!("{k:016x}"))
                .collect();
            let version = keys.len();
            let r = json!({
                "blockTokens": 16,
                "waiting": self.waiting.load(Ordering::SeqCst),
                "running": 0,
                "kvBlocksUsed": 0,
                "kvBlocksTotal": 512,
                "kvCacheUsage": 0.0,
                "prefixVersion": version,
                "engineStalledMs": self.held_since.lock().unwrap()
                    .map_or(0, |t| t.elapsed().as_millis() as u64),
                "keys": keys,
            });
            return respond(&mut s, 200, &r.to_string()).await;
        }
        if req.path.starts_with("/tandem/prompt-keys") {
            self.prompt_key_calls.fetch_add(1, Ordering::SeqCst);
            if body.is_null() {
                return respond(&mut s, 400, r#"{"error":{"message":"not JSON"}}"#).await;
            }
            let keys: Vec<String> = keys_of(&body).iter().map(|k| format!("{k:016x}")).collect();
            let r = json!({"blockTokens": 16, "promptTokens": keys.len() * 16, "keys": keys});
            return respond(&mut s, 200, &r.to_string()).await;
        }
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.auth_seen.lock().unwrap().push(
            req.headers
                .iter()
                .find(|(k, _)| k == "authorization")
                .map(|(_, v)| v.clone()),
        );
        let behavior = *self.behavior.lock().unwrap();
        let answer = json!({"pod": self.name, "path": req.path, "method": req.method}).to_string();
        match behavior {
            Behavior::Answer => {
                self.cached.lock().unwrap().extend(keys_of(&body));
                respond(&mut s, 200, &answer).await;
            }
            Behavior::Stream { frames, delay_ms } => {
                self.cached.lock().unwrap().extend(keys_of(&body));
                let _ = s.write_all(CHUNKED_HEAD.as_bytes()).await;
                for i in 0..frames {
                    let ev = format!("data: {{\"pod\":\"{}\",\"i\":{i}}}\n\n", self.name);
                    if s.write_all(chunk(&ev).as_bytes()).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                }
                let _ = s.write_all(chunk("data: [DONE]\n\n").as_bytes()).await;
                let _ = s.write_all(b"0\r\n\r\n").await;
            }
            Behavior::Unavailable => {
                respond(
                    &mut s,
                    503,
                    r#"{"error":{"message":"no prefill with a healthy KV channel","type":"service_unavailable","code":"no_peer"}}"#,
                )
                .await;
            }
            Behavior::Hold { ms } => {
                self.held_since
                    .lock()
                    .unwrap()
                    .get_or_insert_with(std::time::Instant::now);
                let left = client_left_within(&mut s, ms).await;
                *self.held_since.lock().unwrap() = None;
                if left {
                    self.abandoned.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                self.cached.lock().unwrap().extend(keys_of(&body));
                respond(&mut s, 200, &answer).await;
            }
            Behavior::AwaitKv { ms } => {
                if client_left_within(&mut s, ms).await {
                    self.abandoned.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                respond(&mut s, 200, &answer).await;
            }
            Behavior::CloseBeforeHead => {}
            Behavior::CloseAfterHead => {
                let _ = s.write_all(CHUNKED_HEAD.as_bytes()).await;
                let _ = s.flush().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Behavior::CloseAfterFirstByte => {
                let _ = s.write_all(CHUNKED_HEAD.as_bytes()).await;
                let _ = s
                    .write_all(chunk("data: {\"first\":true}\n\n").as_bytes())
                    .await;
                let _ = s.flush().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let _ = s.shutdown().await;
    }

    /// This stand-in as a target of a Ready group `group` at incarnation 1.
    pub fn target(&self, group: i32) -> Target {
        Target {
            pod: self.name.clone(),
            group,
            incarnation: 1,
            addr: self.addr,
            group_ready: true,
            group_incarnation: 1,
        }
    }
}

/// A front server handing every request to `router.forward`; its address.
pub async fn front(router: Arc<Router>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let router = router.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let router = router.clone();
                    async move { Ok::<_, std::convert::Infallible>(router.forward(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// The chunked body ended with its last chunk (an answer that broke off has not).
    pub complete: bool,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One request on its own connection; chunked bodies decoded.
pub async fn send(addr: SocketAddr, path: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let body = body.to_string();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut raw)).await;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let (body, complete) = if chunked {
        let mut out = Vec::new();
        let mut complete = false;
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let n = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16)
                .unwrap_or(0);
            if n == 0 {
                complete = true;
                break;
            }
            let data = &rest[eol + 2..];
            out.extend_from_slice(&data[..n.min(data.len())]);
            rest = &data[(n + 2).min(data.len())..];
        }
        (out, complete)
    } else {
        (rest.to_vec(), true)
    };
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        complete,
    }
}

/// The router's metrics text.
pub fn metrics(registry: &prometheus_client::registry::Registry) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, registry).unwrap();
    s
}

/// The value of the series `name{labels}` (or without labels) in `text`.
pub fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

pub fn targets(t: Vec<Target>) -> Targets {
    Targets {
        targets: t,
        unavailable: "no group is ready: test".into(),
    }
}
