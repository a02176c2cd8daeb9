//! Harness for end-to-end tests: the real binary, the real model, real HTTP.

#![allow(dead_code)] // each test file uses a different subset

#[path = "../../src/test_support/http_client.rs"]
pub mod http_client;
pub mod load;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub use http_client::{HttpResponse, request};

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The real model; a missing model fails the test (never a silent skip).
pub fn model_path() -> PathBuf {
    model_file("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A model file of the cache (`scripts/fetch-model.sh`); a missing one fails the test.
pub fn model_file(file: &str) -> PathBuf {
    let dir = std::env::var_os("TANDEM_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache/models"));
    let p = dir.join(file);
    assert!(
        p.is_file(),
        "model {} not found: run `make model` (or scripts/fetch-model.sh NAME; or set \
         TANDEM_MODEL_DIR)",
        p.display()
    );
    p
}

pub const MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1";

pub struct Server {
    pub addr: SocketAddr,
    pub child: Child,
    pub log: PathBuf,
}

/// A free TCP port on 127.0.0.1 (free when asked; tests use it at once). Never the same
/// port twice in one test process: servers started together must not race for one port
/// (nor share a log file, which is named after it).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

impl Server {
    /// Start the binary (`--role both`) on a free port and wait until `/ready` answers 200.
    pub fn start(extra: &[&str]) -> Self {
        let mut s = Self::spawn(&["--role", "both"], extra, &[]);
        s.wait_ready();
        s
    }

    /// Start the binary with `role_args` (e.g. `--role decode --prefill ...`) and `env`
    /// on a free HTTP port; does not wait.
    pub fn spawn(role_args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_in(None, role_args, extra, env)
    }

    /// [`Server::spawn`] on a given HTTP port (a restarted server where clients expect it).
    pub fn spawn_on(port: u16, role_args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_full(None, Some(port), role_args, extra, env)
    }

    /// [`Server::spawn`] inside a network namespace (`ip netns exec`), listening on every
    /// address there and reached at `reach` from this process; `None` is the loopback here.
    pub fn spawn_in(
        netns: Option<(&str, std::net::IpAddr)>,
        role_args: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn_full(netns, None, role_args, extra, env)
    }

    fn spawn_full(
        netns: Option<(&str, std::net::IpAddr)>,
        port: Option<u16>,
        role_args: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let port = port.unwrap_or_else(free_port);
        // One log per process start (a restart on the same port keeps the old log).
        static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = std::env::temp_dir().join(format!(
            "tandem-dataplane-{}-{port}-{n}.log",
            std::process::id()
        ));
        let log_file = std::fs::File::create(&log).unwrap();
        // 256 KV blocks unless the test asks for another size.
        let blocks: &[&str] = if extra.contains(&"--kv-blocks") {
            &[]
        } else {
            &["--kv-blocks", "256"]
        };
        let bin = env!("CARGO_BIN_EXE_tandem-dataplane");
        let (mut cmd, host, ip) = match netns {
            None => (
                Command::new(bin),
                "127.0.0.1",
                std::net::IpAddr::from([127, 0, 0, 1]),
            ),
            Some((ns, reach)) => {
                let mut c = Command::new("ip");
                // `ip netns exec` execs the binary: the child's pid is the server's.
                c.args(["netns", "exec", ns, bin]);
                (c, "0.0.0.0", reach)
            }
        };
        // The real model unless the test names another.
        if !extra.contains(&"--model") {
            cmd.arg("--model").arg(model_path());
        }
        let child = cmd
            .args(role_args)
            .args(["--host", host, "--port", &port.to_string()])
            .args(blocks)
            .args(["--log-format", "json"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn tandem-dataplane");
        Self {
            addr: SocketAddr::new(ip, port),
            child,
            log,
        }
    }

    /// Send a signal to the child (by pid, with `kill`: the crate forbids unsafe code).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Whether `/ready` answers 200 now (false when the server does not answer).
    pub fn is_ready(&self) -> bool {
        let Ok(s) = std::net::TcpStream::connect(self.addr) else {
            return false;
        };
        drop(s);
        request(self.addr, "GET", "/ready", None).status == 200
    }

    /// Poll `cond` every 50 ms until it holds; the elapsed time, or a panic at `timeout`.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        cond: impl Fn(&Self) -> bool,
    ) -> Duration {
        let start = Instant::now();
        loop {
            if cond(self) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "{what}: not reached in {timeout:?}; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!("server exited early ({st}); log:\n{}", self.log_text());
            }
            if std::net::TcpStream::connect(self.addr).is_ok()
                && request(self.addr, "GET", "/ready", None).status == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "server not ready in time; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> HttpResponse {
        request(self.addr, "POST", path, Some(&body.to_string()))
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        request(self.addr, "GET", path, None)
    }

    /// A sample's value in `/metrics`, by the start of its line (name and labels, then a
    /// space). A missing series fails the test: a renamed metric or label must not read as
    /// a silent zero (the server creates every known label set at 0 when it starts).
    pub fn metric(&self, line_prefix: &str) -> f64 {
        let body = self.get("/metrics").body;
        find_sample(&body, line_prefix).unwrap_or_else(|| {
            panic!(
                "no series {line_prefix:?} in /metrics of {}:\n{body}",
                self.addr
            )
        })
    }

    /// The sum of every sample of a family (`name{...} v` lines); a family with no sample
    /// at all fails the test.
    pub fn metric_sum(&self, name: &str) -> f64 {
        let body = self.get("/metrics").body;
        let values: Vec<f64> = body
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .collect();
        assert!(
            !values.is_empty(),
            "no series of family {name:?} in /metrics of {}:\n{body}",
            self.addr
        );
        values.iter().sum()
    }

    /// The `/ready` body (any status).
    pub fn ready_body(&self) -> serde_json::Value {
        self.get("/ready").json()
    }

    /// Resident memory of the process now, in KiB (from /proc).
    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.child.id())
    }

    /// Lines of the JSON log that contain every one of `needles`.
    pub fn log_lines(&self, needles: &[&str]) -> Vec<String> {
        self.log_text()
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .map(str::to_owned)
            .collect()
    }

    /// This process's incarnation as logged at start (16 hex digits).
    pub fn incarnation(&self) -> String {
        let line = self
            .log_lines(&["process incarnation"])
            .pop()
            .unwrap_or_else(|| panic!("no incarnation logged:\n{}", self.log_text()));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        v["fields"]["incarnation"]
            .as_str()
            .unwrap_or_else(|| panic!("{line}"))
            .to_owned()
    }

    /// SIGTERM, then the time until the process exited and its status (panics after
    /// `timeout`).
    pub fn sigterm_and_wait(&mut self, timeout: Duration) -> (Duration, ExitStatus) {
        let t = Instant::now();
        self.sigterm();
        let st = self.wait_exit(timeout);
        (t.elapsed(), st)
    }

    pub fn sigterm(&self) {
        // `kill` the binary: the crate forbids unsafe code, so no libc::kill.
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM failed");
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "server did not exit in {timeout:?}; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A sample's value by the start of its line, if the series exists.
pub fn find_sample(body: &str, line_prefix: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(line_prefix)
            .and_then(|rest| rest.trim().parse().ok())
    })
}

/// Resident memory of a process, in KiB (VmRSS from /proc/<pid>/status).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS for {pid}:\n{status}"))
}

/// The failing checks' reasons and the top-level reason of a `/ready` body.
pub fn ready_reasons(body: &serde_json::Value) -> Vec<String> {
    body["checks"]
        .as_array()
        .unwrap_or_else(|| panic!("no checks in {body}"))
        .iter()
        .filter(|c| c["ok"] == false)
        .map(|c| c["reason"].as_str().unwrap_or("").to_owned())
        .collect()
}

impl Drop for Server {
    fn drop(&mut self) {
        // Only our own child, by handle.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Protocol settings shared by the PD tests: short probe period so the suite stays fast.
pub const GROUP_KEY: &str = "test-group-key";

pub fn pd_env(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut env = vec![
        ("TANDEM_GROUP_KEY", GROUP_KEY),
        ("TANDEM_GROUP_INCARNATION", "7"),
        ("TANDEM_PROBE_PERIOD_SECONDS", "1"),
        ("TANDEM_FAILURE_THRESHOLD", "2"),
        ("TANDEM_BOOTSTRAP_TIMEOUT_SECONDS", "3"),
        ("TANDEM_KV_TIMEOUT_SECONDS", "30"),
    ];
    for (k, v) in extra {
        env.retain(|(ek, _)| ek != k);
        env.push((k, v));
    }
    env
}

/// A prefill on `kv_port`, ready.
pub fn start_prefill(kv_port: u16, env: &[(&str, &str)]) -> Server {
    let port = kv_port.to_string();
    let mut s = Server::spawn(&["--role", "prefill", "--kv-port", &port], &[], env);
    s.wait_ready();
    s
}

/// A decode against the prefills at `kv_ports` on localhost; waits for readiness when asked.
pub fn start_decode(kv_ports: &[u16], env: &[(&str, &str)], wait: bool) -> Server {
    let peers: Vec<String> = kv_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let peers = peers.join(",");
    let mut s = Server::spawn(&["--role", "decode", "--prefill", &peers], &[], env);
    if wait {
        s.wait_ready();
    }
    s
}

/// A check that cannot run on this machine: one line on stdout, and one line in the suite's
/// list of skipped checks (the file `$TANDEM_SKIPS_FILE`, which `make unit` prints at the
/// end), so that a skip never reads as a pass.
pub fn skipped(check: &str, why: &str) {
    let line = format!("skipped: {check}: {why}");
    println!("{line}");
    if let Some(path) = std::env::var_os("TANDEM_SKIPS_FILE") {
        use std::io::Write;
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            panic!("{line}; and it could not be listed in {path:?}: {e}");
        }
    }
}

/// Two network namespaces, `decode` and `prefill`, joined by a veth pair that carries the
/// KV traffic (`decode_kv` ↔ `prefill_kv`), plus one veth pair from this namespace to each
/// for HTTP (`decode_http`, `prefill_http`). Names and addresses are unique per process
/// and pair, so parallel runs do not collide; dropping it deletes both namespaces (and
/// with them every veth).
pub struct NetPair {
    pub decode: String,
    pub prefill: String,
    pub decode_http: std::net::IpAddr,
    pub prefill_http: std::net::IpAddr,
    pub prefill_kv: std::net::IpAddr,
    kv_link: String,
    root_links: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetPair {
    /// Build the namespaces; `Err` with the kernel's answer when it refuses (the caller
    /// skips, saying so).
    pub fn create(tag: u32) -> Result<Self, String> {
        let pid = std::process::id();
        let id = format!("{}{tag}", pid % 100_000);
        let decode = format!("tandem-{id}-d");
        let prefill = format!("tandem-{id}-p");
        ip(&["netns", "add", &decode])?;
        let mut pair = Self {
            decode: decode.clone(),
            prefill: prefill.clone(),
            decode_http: [0, 0, 0, 0].into(),
            prefill_http: [0, 0, 0, 0].into(),
            prefill_kv: [0, 0, 0, 0].into(),
            kv_link: format!("tkp{id}"),
            root_links: Vec::new(),
        };
        ip(&["netns", "add", &prefill])?;
        // 10.a.b.0/28 per pair, from the pid and tag: three /30 links.
        let a = 100 + (pid % 100) as u8;
        let b = ((pid / 100) as u8).wrapping_add((tag as u8).wrapping_mul(37));
        let addr = |n: u8| format!("10.{a}.{b}.{n}");
        for ns in [&decode, &prefill] {
            ip(&["netns", "exec", ns, "ip", "link", "set", "lo", "up"])?;
        }
        // HTTP links from here.
        for (ns, root_if, ns_if, base) in [
            (&decode, format!("thd{id}"), format!("thd{id}n"), 0u8),
            (&prefill, format!("thp{id}"), format!("thp{id}n"), 4u8),
        ] {
            ip(&[
                "link", "add", &root_if, "type", "veth", "peer", "name", &ns_if, "netns", ns,
            ])?;
            pair.root_links.push(root_if.clone());
            ip(&[
                "addr",
                "add",
                &format!("{}/30", addr(base + 1)),
                "dev",
                &root_if,
            ])?;
            ip(&["link", "set", &root_if, "up"])?;
            let inside = format!("{}/30", addr(base + 2));
            ip(&[
                "netns", "exec", ns, "ip", "addr", "add", &inside, "dev", &ns_if,
            ])?;
            ip(&["netns", "exec", ns, "ip", "link", "set", &ns_if, "up"])?;
        }
        pair.decode_http = addr(2).parse().unwrap();
        pair.prefill_http = addr(6).parse().unwrap();
        // The KV link between the two namespaces.
        let kd = format!("tkd{id}");
        let kp = pair.kv_link.clone();
        ip(&[
            "netns", "exec", &decode, "ip", "link", "add", &kd, "type", "veth", "peer", "name",
            &kp, "netns", &prefill,
        ])?;
        ip(&[
            "netns",
            "exec",
            &decode,
            "ip",
            "addr",
            "add",
            &format!("{}/30", addr(9)),
            "dev",
            &kd,
        ])?;
        ip(&["netns", "exec", &decode, "ip", "link", "set", &kd, "up"])?;
        ip(&[
            "netns",
            "exec",
            &prefill,
            "ip",
            "addr",
            "add",
            &format!("{}/30", addr(10)),
            "dev",
            &kp,
        ])?;
        ip(&["netns", "exec", &prefill, "ip", "link", "set", &kp, "up"])?;
        pair.prefill_kv = addr(10).parse().unwrap();
        Ok(pair)
    }

    /// Cut the KV link (the prefill's end goes down: nothing passes either way, and
    /// neither process is told).
    pub fn cut(&self) {
        ip(&[
            "netns",
            "exec",
            &self.prefill,
            "ip",
            "link",
            "set",
            &self.kv_link,
            "down",
        ])
        .unwrap();
    }

    pub fn heal(&self) {
        ip(&[
            "netns",
            "exec",
            &self.prefill,
            "ip",
            "link",
            "set",
            &self.kv_link,
            "up",
        ])
        .unwrap();
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for l in &self.root_links {
            let _ = ip(&["link", "del", l]);
        }
        let _ = ip(&["netns", "del", &self.decode]);
        let _ = ip(&["netns", "del", &self.prefill]);
    }
}

/// A copy of the model that differs in one byte of its metadata (`general.name`), so its
/// fingerprint differs while it loads and serves the same: a "different model" for the
/// handshake. Deleted when dropped.
pub struct OtherModel(pub PathBuf);

impl OtherModel {
    pub fn new() -> Self {
        let mut bytes = std::fs::read(model_path()).unwrap();
        let needle = b"Smollm2 135M";
        let at = bytes[..65536]
            .windows(needle.len())
            .position(|w| w == needle)
            .expect("general.name in the model's metadata");
        bytes[at + 6] = b'3';
        let path = std::env::temp_dir().join(format!(
            "tandem-other-model-{}-{}.gguf",
            std::process::id(),
            free_port()
        ));
        std::fs::write(&path, bytes).unwrap();
        Self(path)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for OtherModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A greedy 8-token chat with a long shared system prompt, with `top_logprobs`
/// alternatives per token: (content, logprobs, prompt tokens, cached prompt tokens).
pub fn chat_with_system(
    s: &Server,
    system: &str,
    question: &str,
    top_logprobs: u32,
) -> (String, serde_json::Value, u64, u64) {
    let r = s.post(
        "/v1/chat/completions",
        &serde_json::json!({
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": true,
            "top_logprobs": top_logprobs,
        }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let u = &v["usage"];
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned(),
        v["choices"][0]["logprobs"].clone(),
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}
