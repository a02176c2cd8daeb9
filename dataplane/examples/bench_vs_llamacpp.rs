//! Tandem (`--role both`) side by side with llama.cpp's `llama-server`, over real HTTP, on
//! the same model, prompts and thread count (prints figures; not a test). Run with
//! `make bench-vs-llamacpp`, or:
//!
//! ```sh
//! cargo build --release -p tandem-dataplane --bin tandem-dataplane --example bench_vs_llamacpp
//! ./target/release/examples/bench_vs_llamacpp --llama-server "$(scripts/build-llama-server.sh)"
//! ```
//!
//! The two servers never run at the same time: for every workload and repetition one is
//! started, warmed up with one short request, measured and stopped, then the other; the
//! order alternates between repetitions (T L, L T, T L, ...) so drift of the machine falls
//! on both. Every request is a streaming `/v1/chat/completions` at temperature 0 with
//! `stream_options.include_usage`; token counts are the servers' own `usage` figures.
//!
//! Workloads:
//! - `gen C=1/8/32`: C clients, each sending requests back to back (4 each at C=1, 2 at
//!   C=8, 1 at C=32), 128-token generations from short prompts that each begin with a unique
//!   request id (so no server can reuse a cached prefix). Aggregate output tok/s = completion
//!   tokens of the run / wall time from the first request sent to the last token received.
//!   Equal lengths: `ignore_eos` is sent to both (Tandem ignored it before issue 13 item 2,
//!   so the prompts are story requests whose greedy SmolLM2 answers run past 128 tokens
//!   anyway, which keeps figures comparable with earlier runs); tok/s always comes from the
//!   servers' own counts and the table shows tokens per request for each, so a server that
//!   stopped early would show it.
//! - `prefix C=1/8`: one shared system prompt of ~400 tokens and distinct user turns, 16
//!   output tokens each. A first request with that system prompt (the cold one, shown on its
//!   own at C=1), then 8 more one after the other (C=1) or 16 in two waves of 8 (C=8).
//!
//! TTFT: request sent → first SSE event with non-empty content (the first token's text).
//! Each figure is the median over the repetitions of one run's figure (a run's median for
//! TTFT), with the range over repetitions.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Value, json};
use tandem_dataplane::parent::PARENT_PID_ENV;

#[derive(Parser, Debug)]
#[command(about = "Tandem vs llama-server, interleaved, same model/prompts/threads")]
struct Opts {
    /// The Tandem dataplane binary.
    #[arg(long, default_value = "target/release/tandem-dataplane")]
    tandem: PathBuf,
    /// The llama-server binary (scripts/build-llama-server.sh prints its path).
    #[arg(long)]
    llama_server: PathBuf,
    /// The GGUF model both servers load.
    #[arg(long, default_value = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Threads each server computes with (Tandem --threads; llama-server -t/-tb).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Repetitions of every workload on each server.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Output tokens per request of the generation workloads.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Concurrency levels of the generation workload.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    concurrency: Vec<usize>,
    /// Where the servers' logs go.
    #[arg(long, default_value = "target/bench-vs-llamacpp")]
    log_dir: PathBuf,
}

/// Slots / batch size of both servers.
const SLOTS: usize = 32;
/// Tokens of KV per llama-server slot; Tandem's default 2,048 blocks × 16 hold the same
/// 32 × 1,024 tokens.
const CTX_PER_SLOT: usize = 1024;
const PREFIX_MAX_TOKENS: usize = 16;
/// The `model` of every request: Tandem serves under this name (--served-model-name), a
/// single-model llama-server takes any name.
const SERVED_NAME: &str = "bench";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Tandem,
    Llama,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Tandem => "tandem",
            Kind::Llama => "llama-server",
        }
    }
}

// ----------------------------------------------------------------------------------------
// Servers

struct Server {
    kind: Kind,
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Drop for Server {
    /// SIGTERM as Kubernetes would send it, SIGKILL if the server is still there 10 s later.
    fn drop(&mut self) {
        use nix::sys::signal::{Signal, kill};
        use nix::unistd::Pid;
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "{} ignored SIGTERM for 10 s; killing it (log: {})",
            self.kind.name(),
            self.log.display()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn start(kind: Kind, o: &Opts, seq: usize) -> Result<Server> {
    let port = free_port()?;
    let log = o.log_dir.join(format!("{}-{seq:03}.log", kind.name()));
    let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let threads = o.threads.to_string();
    let mut cmd = match kind {
        Kind::Tandem => {
            let mut c = Command::new(&o.tandem);
            c.args(["--role", "both", "--host", "127.0.0.1"])
                .args(["--port", &port.to_string()])
                .args(["--max-batch", &SLOTS.to_string()])
                .args(["--kv-blocks", &(SLOTS * CTX_PER_SLOT / 16).to_string()])
                .args(["--threads", &threads])
                .args(["--served-model-name", SERVED_NAME])
                .arg("--model")
                .arg(&o.model)
                // Dies with this process even when it is killed (PR_SET_PDEATHSIG).
                .env(PARENT_PID_ENV, std::process::id().to_string());
            c
        }
        Kind::Llama => {
            // setpriv (util-linux) sets PR_SET_PDEATHSIG and execs llama-server, so it too
            // dies with this process; the signal survives the exec.
            let mut c = Command::new("setpriv");
            c.args(["--pdeathsig", "KILL", "--"])
                .arg(&o.llama_server)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["-t", &threads, "-tb", &threads])
                .args(["-np", &SLOTS.to_string()])
                .args(["-c", &(SLOTS * CTX_PER_SLOT).to_string()])
                .arg("--cont-batching")
                .arg("-m")
                .arg(&o.model);
            c
        }
    };
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| match kind {
            Kind::Tandem => format!("starting {}", o.tandem.display()),
            Kind::Llama => format!(
                "starting setpriv (util-linux) for {}",
                o.llama_server.display()
            ),
        })?;
    let mut s = Server {
        kind,
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        log,
    };
    // Tandem: /ready (engine loaded, loops alive). llama-server: /health is 503 while the
    // model loads, 200 once it serves.
    let probe = if kind == Kind::Tandem {
        "/ready"
    } else {
        "/health"
    };
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Some(st) = s.child.try_wait()? {
            bail!(
                "{} exited with {st} while starting; see {}",
                kind.name(),
                s.log.display()
            );
        }
        if get_status(s.addr, probe) == Some(200) {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{} not ready after 180 s; see {}",
                kind.name(),
                s.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Warm-up: one short request, not counted.
    let body = chat_body("Warm-up.", "Say hello.", 4);
    s.request(&body).context("warm-up request")?;
    Ok(s)
}

impl Server {
    fn request(&mut self, body: &str) -> Result<Reply> {
        stream_chat(self.addr, body).with_context(|| {
            format!(
                "{} request failed (log: {})",
                self.kind.name(),
                self.log.display()
            )
        })
    }
}

// ----------------------------------------------------------------------------------------
// HTTP/1.1 and SSE, by hand: the timing of the first event is the figure we want.

fn get_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A `Transfer-Encoding: chunked` body as a plain byte stream.
struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let size = line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size, 16).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidData, format!("chunk size {line:?}"))
            })?;
            if size == 0 {
                self.done = true;
                return Ok(0);
            }
            self.left = size;
        }
        let want = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}

#[derive(Debug, Clone)]
struct Reply {
    ttft: Duration,
    completion_tokens: u64,
    prompt_tokens: u64,
}

fn stream_chat(addr: SocketAddr, body: &str) -> Result<Reply> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\
         Content-Type: application/json\r\nAccept: text/event-stream\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad status line {line:?}"))?;
    let mut chunked = false;
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        let l = line.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let body_reader: Box<dyn BufRead> = if chunked {
        Box::new(BufReader::new(Chunked {
            inner: r,
            left: 0,
            done: false,
        }))
    } else {
        Box::new(r)
    };
    if status != 200 {
        let mut text = String::new();
        let _ = { body_reader }.read_to_string(&mut text);
        bail!("HTTP {status}: {}", text.trim());
    }
    let mut tally = SseTally::default();
    for l in body_reader.lines() {
        if tally.line(&l?, t0.elapsed())? {
            break;
        }
    }
    tally.finish()
}

/// What the events of one streamed chat completion told us, fed line by line (pure, so the
/// timing rules are unit-tested). Both servers send `data: {json}` lines, a role-only first
/// delta (empty or absent `content`), one delta per token or piece of text, `usage` in a
/// final chunk (`stream_options.include_usage`; Tandem also puts it in the finishing
/// chunk), and `data: [DONE]`.
#[derive(Debug, Default)]
struct SseTally {
    ttft: Option<Duration>,
    usage: Option<Value>,
}

impl SseTally {
    /// One line of the event stream, `now` = time since the request was sent. Returns
    /// true at `[DONE]`.
    fn line(&mut self, line: &str, now: Duration) -> Result<bool> {
        // Blank separators, comments (`: ping`), `event:` / `id:` fields carry no data.
        let Some(data) = line.strip_prefix("data:") else {
            return Ok(false);
        };
        let data = data.trim();
        if data == "[DONE]" {
            return Ok(true);
        }
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("SSE data is not JSON: {data}"))?;
        if let Some(e) = v.get("error") {
            bail!("error event: {e}");
        }
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if !content.is_empty() {
            self.ttft.get_or_insert(now);
        }
        if v["usage"].is_object() {
            self.usage = Some(v["usage"].clone());
        }
        Ok(false)
    }

    fn finish(self) -> Result<Reply> {
        let ttft = self.ttft.context("the stream ended without any content")?;
        let usage = self
            .usage
            .context("the stream carried no usage (stream_options.include_usage)")?;
        let count = |k: &str| {
            usage[k]
                .as_u64()
                .with_context(|| format!("usage without an integer {k}: {usage}"))
        };
        Ok(Reply {
            ttft,
            completion_tokens: count("completion_tokens")?,
            prompt_tokens: count("prompt_tokens")?,
        })
    }
}

// ----------------------------------------------------------------------------------------
// Workloads

/// ~400 tokens shared by every request of the prefix workload (our own text).
const SYSTEM_PROMPT: &str = "You are the support assistant of Northwind Rail, a regional \
train company. Answer travellers politely, briefly and accurately, in plain English. \
Ticket rules: single tickets are valid on the day of travel only; return tickets allow the \
return journey within one calendar month; season tickets cover unlimited travel between \
the two stations printed on them, by any route that does not pass through London. \
Children under five travel free; children from five to fifteen pay half the adult fare. \
A railcard gives one third off most fares but not off season tickets, and it must be \
carried on the journey. Refunds: an unused ticket can be refunded up to 28 days after its \
expiry, minus a ten pound administration fee; tickets bought with a voucher are refunded \
as a voucher. Delays: travellers whose train arrives fifteen to twenty-nine minutes late \
get a quarter of the single fare back, thirty to fifty-nine minutes half, and an hour or \
more the whole single fare; claims must be made within 28 days through the website, with \
a photo of the ticket. Bicycles: folding bicycles travel free at any time; other bicycles \
need a free reservation and are not allowed on trains arriving in a city between seven \
and ten in the morning. Dogs travel free, at most two per passenger, on a lead or in a \
basket, and may not occupy seats. Luggage: up to three items per passenger, two large \
ones and one small one. Lost property is kept for three months at the terminus of the \
train it was found on. If you do not know an answer, say so and give the help line, \
0300 123 4567, open from six in the morning until eleven at night every day except \
Christmas Day. Never invent timetables, platforms or prices, and never ask for payment \
details. Keep every answer under one hundred words.";

const QUESTIONS: [&str; 17] = [
    "Can I take my bicycle on the 8:15 into the city?",
    "My train was 40 minutes late. What do I get back?",
    "Is my four year old daughter free?",
    "I lost my umbrella on a train yesterday. Where is it?",
    "Can I bring my two dogs?",
    "How long is a return ticket valid?",
    "Does my railcard work on a season ticket?",
    "I bought a ticket with a voucher. How am I refunded?",
    "How much luggage may I carry?",
    "What is the phone number of the help line?",
    "My season ticket is for Oxford to Reading. Can I go via London?",
    "How do I claim for a delay?",
    "Do children of twelve pay full fare?",
    "Is the help line open on Christmas Day?",
    "Can I get a refund on a ticket that expired last week?",
    "My train arrived 65 minutes late. What now?",
    "Can my dog sit on the seat next to me?",
];

const TOPICS: [&str; 8] = [
    "a lighthouse keeper who finds a map in a bottle",
    "a robot that learns to bake bread",
    "two rival gardeners in a small village",
    "a cat who runs a night train",
    "an astronaut stuck on the moon for a week",
    "a river that changes its course every summer",
    "a clockmaker whose clocks tell the future",
    "a young chess player and an old champion",
];

fn chat_body(system: &str, user: &str, max_tokens: usize) -> String {
    json!({
        "model": SERVED_NAME,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    })
    .to_string()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Workload {
    Gen(usize),
    Prefix(usize),
}

impl Workload {
    fn label(self) -> String {
        match self {
            Workload::Gen(c) => format!("gen C={c}"),
            Workload::Prefix(c) => format!("prefix C={c}"),
        }
    }
}

/// What one run of one workload on one server measured.
#[derive(Debug, Default, Clone)]
struct Run {
    tok_s: f64,
    ttft_ms: f64,
    cold_ttft_ms: Option<f64>,
    tokens_per_req: f64,
    prompt_tokens: f64,
}

/// `requests[i]` is the list of bodies client `i` sends back to back; all clients start
/// together. Returns the replies and the wall time.
fn clients(s: &Server, requests: Vec<Vec<String>>) -> Result<(Vec<Reply>, Duration)> {
    let addr = s.addr;
    let t0 = Instant::now();
    let handles: Vec<_> = requests
        .into_iter()
        .map(|bodies| {
            std::thread::spawn(move || {
                bodies
                    .iter()
                    .map(|b| stream_chat(addr, b))
                    .collect::<Result<Vec<_>>>()
            })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        let r = h
            .join()
            .map_err(|_| anyhow::anyhow!("client thread panicked"))?
            .with_context(|| format!("{} (log: {})", s.kind.name(), s.log.display()))?;
        out.extend(r);
    }
    Ok((out, t0.elapsed()))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn summarise(replies: &[Reply], wall: Duration) -> Run {
    let tokens: u64 = replies.iter().map(|r| r.completion_tokens).sum();
    let mut ttfts: Vec<f64> = replies.iter().map(|r| r.ttft.as_secs_f64() * 1e3).collect();
    let n = replies.len().max(1) as f64;
    Run {
        tok_s: tokens as f64 / wall.as_secs_f64(),
        ttft_ms: median(&mut ttfts),
        cold_ttft_ms: None,
        tokens_per_req: tokens as f64 / n,
        prompt_tokens: replies.iter().map(|r| r.prompt_tokens).sum::<u64>() as f64 / n,
    }
}

fn run_workload(s: &mut Server, w: Workload, rep: usize, o: &Opts) -> Result<Run> {
    match w {
        Workload::Gen(c) => {
            let per_client = match c {
                1 => 4,
                2..=8 => 2,
                _ => 1,
            };
            let requests = (0..c)
                .map(|i| {
                    (0..per_client)
                        .map(|k| {
                            let id = format!("Request {rep}.{c}.{i}.{k}.");
                            let topic = TOPICS[(i + k) % TOPICS.len()];
                            let system = format!(
                                "{id} You are a storyteller who writes long, detailed stories."
                            );
                            let user = format!(
                                "Write a long story about {topic}. Describe every scene in detail."
                            );
                            chat_body(&system, &user, o.max_tokens)
                        })
                        .collect()
                })
                .collect();
            let (replies, wall) = clients(s, requests)?;
            Ok(summarise(&replies, wall))
        }
        Workload::Prefix(c) => {
            // Different user turns per repetition, the same system prompt throughout.
            let q = |i: usize| {
                let question = QUESTIONS[(i + rep * 5) % QUESTIONS.len()];
                chat_body(SYSTEM_PROMPT, question, PREFIX_MAX_TOKENS)
            };
            let cold = s.request(&q(0))?;
            let (replies, wall) = if c == 1 {
                let requests = vec![(1..=8).map(q).collect()];
                clients(s, requests)?
            } else {
                // Two waves of c clients.
                let mut all = Vec::new();
                let mut wall = Duration::ZERO;
                for wave in 0..2 {
                    let requests = (0..c).map(|i| vec![q(1 + wave * c + i)]).collect();
                    let (r, w) = clients(s, requests)?;
                    all.extend(r);
                    wall += w;
                }
                (all, wall)
            };
            let mut run = summarise(&replies, wall);
            run.cold_ttft_ms = Some(cold.ttft.as_secs_f64() * 1e3);
            Ok(run)
        }
    }
}

// ----------------------------------------------------------------------------------------
// Machine, versions, report

/// The CPU's model, the flags that decide which kernels run (SIMD, VNNI, AMX), and the
/// whole flags line, from /proc/cpuinfo.
fn cpu_summary() -> (String, String, String) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let wanted: Vec<&str> = flags
        .split_whitespace()
        .filter(|f| {
            matches!(*f, "avx" | "avx2" | "fma" | "f16c" | "avx_vnni")
                || f.starts_with("avx512")
                || f.starts_with("amx")
                || f.contains("vnni")
        })
        .collect();
    let cpus = info.lines().filter(|l| l.starts_with("processor")).count();
    let model = format!("{} ({cpus} logical CPUs)", field("model name"));
    let simd = if wanted.is_empty() {
        "(none of avx/avx2/fma/f16c/avx512*/vnni/amx)".to_owned()
    } else {
        wanted.join(" ")
    };
    (model, simd, flags)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn version_of(bin: &Path) -> String {
    match Command::new(bin).arg("--version").output() {
        Ok(o) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            text.lines()
                .filter(|l| l.contains("version") || l.starts_with("tandem"))
                .collect::<Vec<_>>()
                .join("; ")
        }
        Err(e) => format!("? ({e})"),
    }
}

/// llama-server's `system_info` line (the instruction sets its CPU backend uses).
fn llama_system_info(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().find(|l| l.contains("system_info"))?;
    Some(line.split_once("system_info:")?.1.trim().to_owned())
}

fn range(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    let m = median(&mut s);
    (m, s[0], s[s.len() - 1])
}

fn cell(v: &[f64], digits: usize) -> String {
    let (m, lo, hi) = range(v);
    if v.len() == 1 {
        format!("{m:.digits$}")
    } else {
        format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
    }
}

type Results = Vec<(Workload, Kind, Run)>;

fn table(res: &Results, workloads: &[Workload]) -> String {
    let pick = |w: Workload, k: Kind, f: &dyn Fn(&Run) -> Option<f64>| -> Vec<f64> {
        res.iter()
            .filter(|(rw, rk, _)| *rw == w && *rk == k)
            .filter_map(|(_, _, r)| f(r))
            .collect()
    };
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| workload | metric | Tandem | llama-server | Tandem vs llama-server |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|");
    type Metric<'a> = (&'a str, usize, bool, Box<dyn Fn(&Run) -> Option<f64>>);
    for &w in workloads {
        let metrics: Vec<Metric> = match w {
            Workload::Gen(_) => vec![
                ("output tok/s", 1, true, Box::new(|r: &Run| Some(r.tok_s))),
                (
                    "TTFT ms (median)",
                    1,
                    false,
                    Box::new(|r: &Run| Some(r.ttft_ms)),
                ),
                (
                    "tokens / request",
                    1,
                    true,
                    Box::new(|r: &Run| Some(r.tokens_per_req)),
                ),
                (
                    "prompt tokens",
                    0,
                    true,
                    Box::new(|r: &Run| Some(r.prompt_tokens)),
                ),
            ],
            Workload::Prefix(1) => vec![
                (
                    "TTFT ms, first request",
                    1,
                    false,
                    Box::new(|r: &Run| r.cold_ttft_ms),
                ),
                (
                    "TTFT ms, next 8 (median)",
                    1,
                    false,
                    Box::new(|r: &Run| Some(r.ttft_ms)),
                ),
                (
                    "prompt tokens",
                    0,
                    true,
                    Box::new(|r: &Run| Some(r.prompt_tokens)),
                ),
            ],
            Workload::Prefix(_) => vec![(
                "TTFT ms, 2 waves (median)",
                1,
                false,
                Box::new(|r: &Run| Some(r.ttft_ms)),
            )],
        };
        for (name, digits, higher_better, f) in metrics {
            let a = pick(w, Kind::Tandem, &*f);
            let b = pick(w, Kind::Llama, &*f);
            if a.is_empty() || b.is_empty() {
                continue;
            }
            let (ma, mb) = (range(&a).0, range(&b).0);
            let ratio = if name.starts_with("tokens") || name.starts_with("prompt") {
                String::new()
            } else {
                // r > 1: Tandem is better by r× (more tok/s, or lower TTFT).
                let r = if higher_better { ma / mb } else { mb / ma };
                match (higher_better, r >= 1.0) {
                    (true, true) => format!("{r:.2}× faster"),
                    (true, false) => format!("{:.2}× slower", 1.0 / r),
                    (false, true) => format!("{r:.2}× lower"),
                    (false, false) => format!("{:.2}× higher", 1.0 / r),
                }
            };
            let _ = writeln!(
                t,
                "| {} | {name} | {} | {} | {ratio} |",
                w.label(),
                cell(&a, digits),
                cell(&b, digits)
            );
        }
    }
    t
}

fn main() -> Result<()> {
    let o = Opts::parse();
    let started = Instant::now();
    for (what, p) in [
        ("tandem binary", &o.tandem),
        ("llama-server binary", &o.llama_server),
        ("model", &o.model),
    ] {
        if !p.exists() {
            bail!("{what} {} does not exist", p.display());
        }
    }
    if o.reps == 0 || o.concurrency.iter().any(|&c| c == 0 || c > SLOTS) {
        bail!("--reps must be at least 1 and every --concurrency between 1 and {SLOTS}");
    }
    std::fs::create_dir_all(&o.log_dir)
        .with_context(|| format!("creating {}", o.log_dir.display()))?;
    let (cpu, simd, flags) = cpu_summary();
    let load_before = loadavg();
    println!("CPU: {cpu}");
    println!("CPU SIMD flags: {simd}");
    println!("CPU flags (/proc/cpuinfo): {flags}");
    println!("load average before: {load_before}");
    println!("tandem: {}", version_of(&o.tandem));
    println!("llama-server: {}", version_of(&o.llama_server));
    println!("model: {}", o.model.display());
    println!(
        "settings: {} threads each; Tandem --role both --max-batch {SLOTS} --kv-blocks {} \
         --threads {}; llama-server -np {SLOTS} -c {} --cont-batching -t {} -tb {}; \
         {} repetitions, servers alternating, one at a time",
        o.threads,
        SLOTS * CTX_PER_SLOT / 16,
        o.threads,
        SLOTS * CTX_PER_SLOT,
        o.threads,
        o.threads,
        o.reps
    );

    let mut workloads: Vec<Workload> = o.concurrency.iter().map(|&c| Workload::Gen(c)).collect();
    workloads.extend([Workload::Prefix(1), Workload::Prefix(8)]);
    let mut results: Results = Vec::new();
    let mut seq = 0;
    let mut system_info = None;
    for rep in 0..o.reps {
        for (wi, &w) in workloads.iter().enumerate() {
            let order = if (rep + wi) % 2 == 0 {
                [Kind::Tandem, Kind::Llama]
            } else {
                [Kind::Llama, Kind::Tandem]
            };
            for kind in order {
                seq += 1;
                let mut s = start(kind, &o, seq)?;
                let r = run_workload(&mut s, w, rep, &o)
                    .with_context(|| format!("{} on {}", w.label(), kind.name()))?;
                if kind == Kind::Llama && system_info.is_none() {
                    system_info = llama_system_info(&s.log);
                }
                drop(s);
                println!(
                    "rep {} {:12} {:13} {:7.1} tok/s  TTFT {:7.1} ms{}  {:5.1} tok/req  prompt {:4.0}  (load {})",
                    rep + 1,
                    w.label(),
                    kind.name(),
                    r.tok_s,
                    r.ttft_ms,
                    r.cold_ttft_ms
                        .map(|c| format!(" (first {c:.1} ms)"))
                        .unwrap_or_default(),
                    r.tokens_per_req,
                    r.prompt_tokens,
                    loadavg()
                );
                results.push((w, kind, r));
            }
        }
    }
    if let Some(si) = system_info {
        println!("llama-server system_info: {si}");
    }
    println!();
    println!(
        "Medians over {} repetitions (range in brackets); gen = {} output tokens requested, \
         prefix = ~400-token shared system prompt, {PREFIX_MAX_TOKENS} output tokens.",
        o.reps, o.max_tokens
    );
    println!();
    print!("{}", table(&results, &workloads));
    println!();
    println!("CPU: {cpu}; SIMD flags: {simd}");
    println!("load average before: {load_before}, after: {}", loadavg());
    println!("took {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Feeds `lines` with line i at i×10 ms; returns the tally's reply.
    fn tally(lines: &[&str]) -> Result<Reply> {
        let mut t = SseTally::default();
        for (i, l) in lines.iter().enumerate() {
            if t.line(l, ms(10 * i as u64))? {
                break;
            }
        }
        t.finish()
    }

    #[test]
    fn tandem_stream_ttft_is_the_first_nonempty_content() {
        let r = tally(&[
            r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            "",
            r#"data: {"choices":[{"index":0,"delta":{"content":"Once"},"finish_reason":null}]}"#,
            "",
            r#"data: {"choices":[{"index":0,"delta":{"content":" upon"},"finish_reason":null}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":31,"completion_tokens":2,"total_tokens":33}}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":31,"completion_tokens":2,"total_tokens":33}}"#,
            "data: [DONE]",
        ])
        .unwrap();
        assert_eq!(r.ttft, ms(20));
        assert_eq!((r.prompt_tokens, r.completion_tokens), (31, 2));
    }

    #[test]
    fn llama_stream_with_null_content_and_comments() {
        let r = tally(&[
            ": keep-alive",
            r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#,
            "event: message",
            r#"data:{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":128}}"#,
            "data: [DONE]",
            // Nothing after [DONE] counts.
            r#"data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
        ])
        .unwrap();
        assert_eq!(r.ttft, ms(30));
        assert_eq!((r.prompt_tokens, r.completion_tokens), (7, 128));
    }

    #[test]
    fn failures_are_named() {
        let err = |lines: &[&str]| format!("{:#}", tally(lines).unwrap_err());
        let e = err(&[r#"data: {"error":{"message":"queue full","code":503}}"#]);
        assert!(e.contains("error event") && e.contains("queue full"), "{e}");
        let e = err(&["data: {not json"]);
        assert!(e.contains("not JSON"), "{e}");
        let e = err(&[r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":0}}"#]);
        assert!(e.contains("without any content"), "{e}");
        let e = err(&[
            r#"data: {"choices":[{"delta":{"content":"x"}}]}"#,
            "data: [DONE]",
        ]);
        assert!(e.contains("no usage"), "{e}");
        let e = err(&[
            r#"data: {"choices":[{"delta":{"content":"x"}}]}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":3}}"#,
        ]);
        assert!(e.contains("completion_tokens"), "{e}");
    }

    fn dechunk(wire: &[u8]) -> io::Result<String> {
        let mut out = String::new();
        Chunked {
            inner: io::Cursor::new(wire),
            left: 0,
            done: false,
        }
        .read_to_string(&mut out)?;
        Ok(out)
    }

    #[test]
    fn chunked_bodies_decode_and_bad_ones_fail() {
        let wire = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n";
        assert_eq!(dechunk(wire).unwrap(), "hello world");
        let e = dechunk(b"zz\r\nhello\r\n").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let e = dechunk(b"a\r\nhel").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let e = dechunk(b"3\r\nabc\r\n").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn median_and_cells() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
        assert_eq!(cell(&[7.0], 1), "7.0");
        assert_eq!(cell(&[3.0, 1.0, 2.0], 0), "2 (1–3)");
    }
}
