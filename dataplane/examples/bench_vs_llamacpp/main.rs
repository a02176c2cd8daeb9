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

mod http;
mod report;

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::json;
use tandem_dataplane::parent::PARENT_PID_ENV;

use http::{Reply, get_status, stream_chat};
use report::{Results, cpu_summary, llama_system_info, loadavg, median, table, version_of};

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
    /// The SVG of tok/s against concurrency (default
    /// `docs/bench-vs-llamacpp-<model file stem>.svg`; written when two or more
    /// concurrency levels ran).
    #[arg(long)]
    svg: Option<PathBuf>,
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
    /// Peak resident set so far (VmHWM of /proc/PID/status), in MB.
    fn peak_rss_mb(&self) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024.0 / 1e6)
    }

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
    /// The server's peak resident set (VmHWM) at the end of the run, in MB.
    peak_rss_mb: f64,
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
        peak_rss_mb: f64::NAN,
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

/// Bytes of the KV pool both servers hold: SLOTS × CTX_PER_SLOT tokens of F16 K and V
/// for every layer (from the GGUF's metadata), or `None` if it names no such dimensions.
fn kv_pool_bytes(model: &std::path::Path) -> Option<u64> {
    let g = tandem_dataplane::gguf::Gguf::open(model).ok()?;
    let arch = g.get_str("general.architecture").ok()?.to_string();
    let key = |k: &str| g.get_usize(&format!("{arch}.{k}")).ok();
    let (layers, heads, kv_heads, dim) = (
        key("block_count")?,
        key("attention.head_count")?,
        key("attention.head_count_kv")?,
        key("embedding_length")?,
    );
    let head_dim = key("attention.key_length").unwrap_or(dim / heads.max(1));
    let per_token = layers * 2 * kv_heads * head_dim * 2;
    Some((SLOTS * CTX_PER_SLOT * per_token) as u64)
}

/// The issue's targets against this run's medians: C=1 ≥ 1.2× and C=32 ≥ 3× llama-server's
/// tok/s, TTFT at C=1 no higher than llama-server's, peak RSS ≤ file + KV pool + 15 %.
fn targets(res: &Results, model: &std::path::Path) -> String {
    let med = |w: Workload, k: Kind, f: fn(&Run) -> f64| {
        let mut v: Vec<f64> = res
            .iter()
            .filter(|(rw, rk, _)| *rw == w && *rk == k)
            .map(|(_, _, r)| f(r))
            .collect();
        (!v.is_empty()).then(|| median(&mut v))
    };
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let mut out = String::from("Targets (medians of this run):\n");
    for (c, want) in [(1usize, 1.2), (32, 3.0)] {
        let w = Workload::Gen(c);
        if let (Some(a), Some(b)) = (
            med(w, Kind::Tandem, |r| r.tok_s),
            med(w, Kind::Llama, |r| r.tok_s),
        ) {
            out += &format!(
                "- C={c} tok/s: Tandem {a:.1} vs llama-server {b:.1} = {:.2}x (target >= {want}x): {}\n",
                a / b,
                verdict(a / b >= want)
            );
        }
    }
    let w = Workload::Gen(1);
    if let (Some(a), Some(b)) = (
        med(w, Kind::Tandem, |r| r.ttft_ms),
        med(w, Kind::Llama, |r| r.ttft_ms),
    ) {
        out += &format!(
            "- TTFT at C=1: Tandem {a:.1} ms vs llama-server {b:.1} ms (target <=): {}\n",
            verdict(a <= b)
        );
    }
    let file = std::fs::metadata(model)
        .map(|m| m.len() as f64 / 1e6)
        .unwrap_or(f64::NAN);
    match kv_pool_bytes(model) {
        Some(kv) => {
            let kv = kv as f64 / 1e6;
            let budget = (file + kv) * 1.15;
            for k in [Kind::Tandem, Kind::Llama] {
                let peak = res
                    .iter()
                    .filter(|(_, rk, _)| *rk == k)
                    .map(|(_, _, r)| r.peak_rss_mb)
                    .fold(f64::NAN, f64::max);
                out += &format!(
                    "- peak RSS, {} (largest of all runs): {peak:.0} MB; file {file:.0} MB + KV pool {kv:.0} MB ({} tokens of F16 K and V) + 15 % = {budget:.0} MB: {}\n",
                    k.name(),
                    SLOTS * CTX_PER_SLOT,
                    verdict(peak <= budget)
                );
            }
        }
        None => out += "- peak RSS: the GGUF names no KV dimensions; no budget computed\n",
    }
    out
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
                let mut r = run_workload(&mut s, w, rep, &o)
                    .with_context(|| format!("{} on {}", w.label(), kind.name()))?;
                r.peak_rss_mb = s.peak_rss_mb().unwrap_or(f64::NAN);
                if kind == Kind::Llama && system_info.is_none() {
                    system_info = llama_system_info(&s.log);
                }
                drop(s);
                println!(
                    "rep {} {:12} {:13} {:7.1} tok/s  TTFT {:7.1} ms{}  {:5.1} tok/req  prompt {:4.0}  RSS {:6.0} MB  (load {})",
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
                    r.peak_rss_mb,
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
    print!("{}", targets(&results, &o.model));
    let svg_path = o.svg.clone().unwrap_or_else(|| {
        let stem = o
            .model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy());
        PathBuf::from(format!("docs/bench-vs-llamacpp-{stem}.svg"))
    });
    let model_name = o
        .model
        .file_name()
        .map_or("?".into(), |s| s.to_string_lossy());
    let subtitle = format!(
        "{cpu}, {} threads each, {} reps; load {load_before} before, {} after",
        o.threads,
        o.reps,
        loadavg()
    );
    if let Some(svg) = report::svg(
        &results,
        &format!("{model_name}: Tandem vs llama-server"),
        &subtitle,
    ) {
        std::fs::write(&svg_path, svg)
            .with_context(|| format!("writing {}", svg_path.display()))?;
        println!("wrote {}", svg_path.display());
    }
    println!();
    println!("CPU: {cpu}; SIMD flags: {simd}");
    println!("load average before: {load_before}, after: {}", loadavg());
    println!("took {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}
