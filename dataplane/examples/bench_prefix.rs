//! Prefix caching, measured over real HTTP: time to first token of a request whose ~400-token
//! system prompt is new to the server (miss) against requests that repeat it with another
//! user turn (hit), on `tandem-dataplane --role both` with the prefix cache (the default)
//! and with `--no-prefix-cache`, side by side (prints figures; not a test). Run with
//! `make bench-prefix`, or:
//!
//! ```sh
//! cargo build --release -p tandem-dataplane --bin tandem-dataplane --example bench_prefix
//! ./target/release/examples/bench_prefix --reps 7
//! ```
//!
//! Both servers are started once and stay up; requests are sent one at a time, so the two
//! never compute at once. Each repetition, for each server in alternating order (on off,
//! off on, ...): one request with a system prompt no request used before (it begins with a
//! fresh conversation number, so not even its first KV block is cached: a miss), then
//! `--hits` requests with the same system prompt and other questions. A request is a
//! non-streaming `/v1/chat/completions` at temperature 0 with `max_tokens: 1`, so the time
//! from sending it to its complete response is the time to the first token (plus one small
//! JSON body). Figures: medians over repetitions of the miss and of each repetition's
//! median hit, with the range, and the servers' own `usage.prompt_tokens_details.cached_tokens`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Value, json};
use tandem_dataplane::parent::PARENT_PID_ENV;

#[derive(Parser, Debug)]
#[command(about = "Prefix cache on vs off: TTFT of a new system prompt vs a repeated one")]
struct Opts {
    #[arg(long, default_value = "target/release/tandem-dataplane")]
    tandem: PathBuf,
    #[arg(long, default_value = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Threads of each server.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Repetitions (each: one miss and `hits` hits per server).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Requests repeating the system prompt after the miss, per repetition.
    #[arg(long, default_value_t = 5)]
    hits: usize,
}

/// ~400 tokens (with the chat template) shared by the requests of a repetition.
const SYSTEM_PROMPT: &str = "You answer questions for visitors of the Harbour Street \
public library. Be friendly, short and exact, and use plain words. Opening hours: Monday \
to Friday from nine in the morning until eight in the evening, Saturday from ten until \
five, closed on Sundays and public holidays. The reading room on the second floor is \
quiet at all times; phone calls are only allowed in the entrance hall. Membership is free \
for everyone who lives, works or studies in the city; visitors from elsewhere pay twelve \
pounds a year. A member may borrow up to fifteen items at once: books for three weeks, \
films and music for one week, and magazines for one week, except the latest issue, which \
stays in the library. Loans can be renewed twice online or at the desk unless another \
member has reserved the item. Late returns cost twenty pence per item per day, at most \
five pounds per item; children's items are never fined. Reservations cost nothing, and a \
reserved item waits at the desk for seven days. Lost or damaged items are charged at \
their replacement price. The library lends laptops for use inside the building for up \
to four hours, against a member card. Printing costs ten pence a page in black and white \
and fifty pence in colour; scanning is free. The local history collection is on the \
third floor and may be used by appointment only, from Tuesday to Thursday. Groups of more \
than six people must book the meeting room, which seats twenty. Dogs are not allowed, \
except assistance dogs. If a question is not covered here, say that you do not know and \
give the desk's number, 0161 555 0199. Never make up titles, authors, fees or dates.";

const QUESTIONS: [&str; 8] = [
    "How many books can I borrow?",
    "Is the library open on Sunday?",
    "What does it cost to print in colour?",
    "Can I bring my dog?",
    "How long can I keep a film?",
    "Where is the local history collection?",
    "What happens if I return a book late?",
    "Can I borrow a laptop?",
];

struct Server {
    name: &'static str,
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        use nix::sys::signal::{Signal, kill};
        use nix::unistd::Pid;
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

fn start(o: &Opts, name: &'static str, extra: &[&str]) -> Result<Server> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new(&o.tandem)
        .args(["--role", "both", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--threads", &o.threads.to_string()])
        .args(["--served-model-name", "m", "--log-format", "json"])
        .args(extra)
        .arg("--model")
        .arg(&o.model)
        .env(PARENT_PID_ENV, std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", o.tandem.display()))?;
    let mut s = Server {
        name,
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while http(s.addr, "GET", "/ready", "").ok().map(|r| r.0) != Some(200) {
        if let Some(st) = s.child.try_wait()? {
            bail!("{name} exited with {st} while starting");
        }
        if Instant::now() > deadline {
            bail!("{name} not ready after 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Warm-up, not counted.
    s.ask("Warm-up.", "Say hello.")?;
    Ok(s)
}

/// One HTTP/1.1 exchange on a fresh connection: status and body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let mut c = TcpStream::connect(addr)?;
    write!(
        c,
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    c.read_to_string(&mut raw)?;
    let (head, rest) = raw.split_once("\r\n\r\n").context("no end of headers")?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status")?;
    Ok((status, rest.to_owned()))
}

impl Server {
    /// Seconds to the one-token answer, and the prompt's (tokens, cached tokens).
    fn ask(&mut self, system: &str, question: &str) -> Result<(f64, u64, u64)> {
        let body = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 1,
            "temperature": 0,
        })
        .to_string();
        let t = Instant::now();
        let (status, body) = http(self.addr, "POST", "/v1/chat/completions", &body)?;
        let secs = t.elapsed().as_secs_f64();
        if status != 200 {
            bail!("{}: HTTP {status}: {body}", self.name);
        }
        let v: Value = serde_json::from_str(&body).context("reply is not JSON")?;
        let u = &v["usage"];
        let n = |x: &Value| x.as_u64().context("usage lacks a count");
        Ok((
            secs,
            n(&u["prompt_tokens"])?,
            n(&u["prompt_tokens_details"]["cached_tokens"])?,
        ))
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn ms_cell(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(0.0, f64::max);
    format!("{:.1} ({:.1}–{:.1})", median(v) * 1e3, lo * 1e3, hi * 1e3)
}

#[derive(Default)]
struct Tally {
    miss: Vec<f64>,
    hit: Vec<f64>,
    prompt_tokens: Vec<u64>,
    cached_miss: Vec<u64>,
    cached_hit: Vec<u64>,
}

fn main() -> Result<()> {
    let o = Opts::parse();
    if o.reps == 0 || o.hits == 0 {
        bail!("--reps and --hits must be at least 1");
    }
    let mut servers = [
        start(&o, "prefix cache", &[])?,
        start(&o, "--no-prefix-cache", &["--no-prefix-cache"])?,
    ];
    let mut tally: [Tally; 2] = Default::default();
    for rep in 0..o.reps {
        for k in 0..2 {
            let i = (k + rep) % 2;
            // A conversation number no request used: even the first KV block is new.
            let system = format!("Conversation {}. {SYSTEM_PROMPT}", 1000 + rep * 2 + i);
            let t = &mut tally[i];
            let (secs, n, cached) = servers[i].ask(&system, QUESTIONS[rep % QUESTIONS.len()])?;
            t.miss.push(secs);
            t.prompt_tokens.push(n);
            t.cached_miss.push(cached);
            let mut hits = Vec::new();
            for h in 0..o.hits {
                let q = QUESTIONS[(rep + 1 + h) % QUESTIONS.len()];
                let (secs, _, cached) = servers[i].ask(&system, q)?;
                hits.push(secs);
                t.cached_hit.push(cached);
            }
            t.hit.push(median(&hits));
        }
    }
    let cpus = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    println!(
        "bench_prefix: {} reps × (1 miss + {} hits) per server, --threads {}, {cpus}; load {}",
        o.reps,
        o.hits,
        o.threads,
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!(
        "| server | prompt tokens | miss TTFT ms | hit TTFT ms | miss / hit | cached tokens (miss; hits) |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (s, t) in servers.iter().zip(&tally) {
        let span = |v: &[u64]| {
            let lo = v.iter().min().copied().unwrap_or(0);
            let hi = v.iter().max().copied().unwrap_or(0);
            if lo == hi {
                lo.to_string()
            } else {
                format!("{lo}–{hi}")
            }
        };
        println!(
            "| {} | {} | {} | {} | {:.1}× | {}; {} |",
            s.name,
            span(&t.prompt_tokens),
            ms_cell(&t.miss),
            ms_cell(&t.hit),
            median(&t.miss) / median(&t.hit),
            span(&t.cached_miss),
            span(&t.cached_hit),
        );
    }
    let (on, off) = (&tally[0], &tally[1]);
    println!(
        "hit TTFT with the cache: {:.1}× lower than its miss, {:.1}× lower than a hit without it",
        median(&on.miss) / median(&on.hit),
        median(&off.hit) / median(&on.hit)
    );
    Ok(())
}
