//! PD versus colocated serving on the real model, over real HTTP and real processes
//! (prints figures; not a test). Run with `make bench-pd`, or:
//!
//! ```sh
//! cargo build --release -p tandem-dataplane --bin tandem-dataplane --example bench_pd
//! ./target/release/examples/bench_pd [--bin target/release/tandem-dataplane] [--model M]
//! ```
//!
//! 1. `--role both` alone, then one prefill + one decode on loopback (never both at once):
//!    streaming `/v1/completions`, TTFT p50/p99 (request sent → first SSE event) and output
//!    throughput (completion tokens / wall time) at concurrency 1 and 32.
//! 2. KV transfer: the protocol's KV_CHUNK stream exactly as the roles move it
//!    (`chunks::plan` with CRC-32C, `kv::encode_chunk` into a frame ZeroMQ takes by
//!    ownership, `kv::decode_borrowed` in place, CRC check and one copy into the
//!    reassembly buffer) over a ZeroMQ DEALER → ROUTER on loopback TCP, against a raw
//!    loopback TCP stream of the same bytes, measured in the same run. `--kv-only` runs
//!    this part alone.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_dataplane::kv::chunks::{Assembler, BufferPool, plan};
use tandem_dataplane::kv::{self, HEADER_LEN, MAX_PAYLOAD};

const MAX_TOKENS: usize = 32;
const PROMPT: &str = "You are a helpful assistant. Summarise the following in one sentence: \
    the castle stood on a hill above the river, and every spring the knights rode out to \
    meet the dragon that lived in the caves beyond the forest, but the dragon only wanted";

fn arg(name: &str) -> Option<String> {
    let mut it = std::env::args();
    while let Some(a) = it.next() {
        if a == name {
            return it.next();
        }
    }
    None
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(bin: &PathBuf, model: &PathBuf, args: &[&str]) -> Proc {
    let port = free_port();
    let child = Command::new(bin)
        .args(args)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--model")
        .arg(model)
        .args(["--kv-blocks", "1024", "--max-batch", "32"])
        .env("TANDEM_GROUP_KEY", "bench")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the dataplane binary (build it with --release first)");
    let p = Proc {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while http(p.addr, "GET", "/ready", "").0 != 200 {
        assert!(Instant::now() < deadline, "{args:?} not ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    p
}

/// One request; (status, body). Status 0 when the server does not answer.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// A streaming completion: (TTFT, completion tokens).
fn stream_one(addr: SocketAddr, i: usize) -> (Duration, usize) {
    let body = serde_json::json!({
        "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": format!("[{i}] {PROMPT}"),
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": true,
    })
    .to_string();
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: b\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut ttft = None;
    let mut tokens = 0;
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { break };
        let Some(data) = line.strip_prefix("data: {") else {
            continue;
        };
        ttft.get_or_insert_with(|| t0.elapsed());
        let v: serde_json::Value = serde_json::from_str(&format!("{{{data}")).unwrap();
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
        }
        assert!(v.get("error").is_none(), "request failed: {v}");
    }
    (ttft.expect("no SSE event"), tokens)
}

struct Run {
    p50: Duration,
    p99: Duration,
    tok_s: f64,
}

fn run(addr: SocketAddr, concurrency: usize, requests: usize) -> Run {
    stream_one(addr, 9999); // warm up
    let t0 = Instant::now();
    let mut results = Vec::new();
    for wave in 0..requests.div_ceil(concurrency) {
        let handles: Vec<_> = (0..concurrency.min(requests - wave * concurrency))
            .map(|j| {
                let i = wave * concurrency + j;
                std::thread::spawn(move || stream_one(addr, i))
            })
            .collect();
        results.extend(handles.into_iter().map(|h| h.join().unwrap()));
    }
    let wall = t0.elapsed();
    let mut ttfts: Vec<Duration> = results.iter().map(|r| r.0).collect();
    ttfts.sort();
    let pct = |q: f64| ttfts[((ttfts.len() - 1) as f64 * q).round() as usize];
    let tokens: usize = results.iter().map(|r| r.1).sum();
    Run {
        p50: pct(0.5),
        p99: pct(0.99),
        tok_s: tokens as f64 / wall.as_secs_f64(),
    }
}

fn serving(bin: &PathBuf, model: &PathBuf) -> Vec<(String, usize, Run)> {
    let mut out = Vec::new();
    let plan = [(1usize, 8usize), (32, 32)];
    {
        let both = spawn(bin, model, &["--role", "both"]);
        for (c, n) in plan {
            out.push(("both".to_owned(), c, run(both.addr, c, n)));
        }
    }
    let kv_port = free_port().to_string();
    let _prefill = spawn(bin, model, &["--role", "prefill", "--kv-port", &kv_port]);
    let peer = format!("127.0.0.1:{kv_port}");
    let decode = spawn(bin, model, &["--role", "decode", "--prefill", &peer]);
    for (c, n) in plan {
        out.push(("pd".to_owned(), c, run(decode.addr, c, n)));
    }
    let metrics = http(decode.addr, "GET", "/metrics", "").1;
    if let Some(l) = metrics
        .lines()
        .find(|l| l.starts_with("tandem_kv_transfer_bytes_total{direction=\"received\"}"))
    {
        println!("decode KV received over the run: {l}");
    }
    out
}

/// A synthetic export buffer shaped like SmolLM2's (30 layers), `bytes` long.
fn export_buffer(bytes: usize) -> Vec<u8> {
    let layers = 30usize;
    let per_layer = (bytes - 32) / layers;
    let mut b = vec![0u8; 32 + per_layer * layers];
    b[..4].copy_from_slice(b"TKV1");
    b[8..12].copy_from_slice(&(layers as u32).to_le_bytes());
    for (i, x) in b[32..].iter_mut().enumerate() {
        *x = (i * 31 % 251) as u8;
    }
    b
}

/// KV_CHUNK stream over ZeroMQ (codec + CRC + reassembly): bytes/s.
fn zmq_throughput(buf: &[u8], rounds: usize) -> f64 {
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.set_rcvhwm(10_000).unwrap();
    router
        .set_maxmsgsize((MAX_PAYLOAD + HEADER_LEN) as i64)
        .unwrap();
    let port = free_port();
    router.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
    let total = buf.len();
    let receiver = std::thread::spawn(move || {
        let mut rounds_done = 0;
        // As the decode does: reassembly buffers are reused across rooms.
        let pool = BufferPool::default();
        let mut asm = Assembler::with_pool(pool.clone());
        while rounds_done < rounds {
            // As the decode's loop does: frames stay ZeroMQ messages, the chunk header is
            // read in place, the data is checksummed and copied once into the buffer.
            let mut f = [
                zmq::Message::new(),
                zmq::Message::new(),
                zmq::Message::new(),
            ];
            for m in &mut f {
                router.recv(m, 0).unwrap();
            }
            let (_, d) = kv::decode_borrowed(&[&f[1][..], &f[2][..]]).unwrap();
            let kv::Decoded::Chunk(c) = d else {
                panic!("unexpected message")
            };
            if asm.push(c, u64::MAX).unwrap() {
                // Handed on whole (to the import, in the decode), then released.
                let done = std::mem::replace(&mut asm, Assembler::with_pool(pool.clone()));
                assert_eq!(done.into_payload().len(), total);
                rounds_done += 1;
            }
        }
        Instant::now()
    });
    // The sender's own context (own I/O thread), as in a separate prefill process.
    let dealer_ctx = zmq::Context::new();
    let dealer = dealer_ctx.socket(zmq::DEALER).unwrap();
    dealer.set_sndhwm(10_000).unwrap();
    dealer.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // From the first chunk being cut (CRC, copy) to the last one reassembled.
    let t0 = Instant::now();
    for r in 0..rounds {
        // As the prefill's loop does: one CRC pass and one copy into the payload frame,
        // which ZeroMQ takes by ownership.
        for c in plan(buf) {
            let [h, p] = kv::encode_chunk(1, 0, r as u64 + 1, &c);
            dealer.send(h, zmq::SNDMORE).unwrap();
            dealer.send(zmq::Message::from(p), 0).unwrap();
        }
    }
    let took = receiver.join().unwrap() - t0;
    (total * rounds) as f64 / took.as_secs_f64()
}

/// The same bytes over a raw loopback TCP stream: bytes/s.
fn tcp_throughput(buf: &[u8], rounds: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let total = buf.len() * rounds;
    let receiver = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = 0;
        let mut chunk = vec![0u8; 1 << 20];
        while got < total {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0);
            got += n;
        }
        Instant::now()
    });
    let mut s = TcpStream::connect(addr).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    for _ in 0..rounds {
        s.write_all(buf).unwrap();
    }
    let took = receiver.join().unwrap() - t0;
    total as f64 / took.as_secs_f64()
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = arg("--bin")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/release/tandem-dataplane"));
    let model = arg("--model")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    println!(
        "prompt ~{} chars, max_tokens {MAX_TOKENS}, streaming /v1/completions",
        PROMPT.len()
    );
    if std::env::args().any(|a| a == "--kv-only") {
        kv_transfer();
        return;
    }
    let results = serving(&bin, &model);
    println!("| setup | C  | TTFT p50 | TTFT p99 | output tok/s |");
    println!("|-------|----|----------|----------|--------------|");
    for (setup, c, r) in &results {
        println!(
            "| {setup:5} | {c:2} | {:6.1} ms | {:6.1} ms | {:8.1} |",
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.tok_s
        );
    }
    let at = |s: &str, c: usize| {
        results
            .iter()
            .find(|r| r.0 == s && r.1 == c)
            .map(|r| r.2.p50.as_secs_f64())
            .unwrap()
    };
    let overhead = (at("pd", 1) / at("both", 1) - 1.0) * 100.0;
    println!("PD overhead on TTFT p50 at C=1: {overhead:+.1} % (target <= 20 %)");
    kv_transfer();
}

fn kv_transfer() {
    // 64 MiB per round, as 30 layer chunks of ~2.2 MiB: a ~2,900-token prompt of SmolLM2 in F16.
    let buf = export_buffer(64 << 20);
    let rounds = 8;
    let z = zmq_throughput(&buf, rounds);
    let t = tcp_throughput(&buf, rounds);
    println!(
        "KV transfer: ZeroMQ KV_CHUNK stream {:.2} GB/s, raw TCP {:.2} GB/s: {:.0} % of raw (target >= 50 %)",
        z / 1e9,
        t / 1e9,
        z / t * 100.0
    );
}
