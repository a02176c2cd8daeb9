//! Harness for end-to-end tests: the real binary, the real model, real HTTP.

#![allow(dead_code)] // each test file uses a different subset

#[path = "../../src/test_support/http_client.rs"]
pub mod http_client;

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
    let dir = std::env::var_os("TANDEM_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache/models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model {} not found: run `make model` (or set TANDEM_MODEL_DIR)",
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

/// A free TCP port on 127.0.0.1 (free when asked; tests use it at once).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
        let port = free_port();
        let log = std::env::temp_dir().join(format!("tandem-dataplane-{port}.log"));
        let log_file = std::fs::File::create(&log).unwrap();
        // 256 KV blocks unless the test asks for another size.
        let blocks: &[&str] = if extra.contains(&"--kv-blocks") {
            &[]
        } else {
            &["--kv-blocks", "256"]
        };
        let child = Command::new(env!("CARGO_BIN_EXE_tandem-dataplane"))
            .args(role_args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--model")
            .arg(model_path())
            .args(blocks)
            .args(["--log-format", "json"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn tandem-dataplane");
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
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

    /// A sample's value in `/metrics` (0 when absent).
    pub fn metric(&self, line_prefix: &str) -> f64 {
        let body = self.get("/metrics").body;
        body.lines()
            .find_map(|l| {
                l.strip_prefix(line_prefix)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }

    /// The sum of every sample of a family (`name{...} v` lines), 0 when absent.
    pub fn metric_sum(&self, name: &str) -> f64 {
        let body = self.get("/metrics").body;
        body.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
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
