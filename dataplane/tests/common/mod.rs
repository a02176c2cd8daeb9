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

impl Server {
    /// Start the binary on a free port and wait until `/ready` answers 200.
    pub fn start(extra: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::env::temp_dir().join(format!("tandem-dataplane-{port}.log"));
        let log_file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tandem-dataplane"))
            .args([
                "--role",
                "both",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .arg("--model")
            .arg(model_path())
            .args(["--kv-blocks", "256", "--log-format", "json"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn tandem-dataplane");
        let mut s = Self {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
            log,
        };
        s.wait_ready();
        s
    }

    fn wait_ready(&mut self) {
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
