//! The local runtime's test harness: the real `tandem-operator local` binary on the example
//! manifest with test timings, one HTTP/1.1 request per connection, processes by PID.
//! Shared by `local_runtime.rs` and `local_in_place.rs`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};

use super::{dataplane, model, repo};

pub static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Probe period, failure threshold and not-ready window of the test spec.
pub const PROBE_PERIOD: u64 = 1;
pub const FAILURE_THRESHOLD: u64 = 3;
pub const WINDOW: u64 = 4;
/// The runtime's SIGTERM → SIGKILL delay in these tests.
pub const GRACE: u64 = 3;
/// `health.unresponsiveGraceSeconds` of the stopped-prefill test: the SIGKILL delay of a
/// hung member, shorter than [`GRACE`] so that the test tells them apart.
pub const UNRESPONSIVE_GRACE: u64 = 1;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The example manifest with test timings, a given name and the model's absolute path.
pub fn manifest(name: &str, edit: impl FnOnce(&mut serde_yaml::Value)) -> String {
    let text = std::fs::read_to_string(repo().join("manifests/examples/smollm2-local.yaml"))
        .expect("the example manifest");
    let mut m: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    m["metadata"]["name"] = name.into();
    m["spec"]["model"]["path"] = model().to_string_lossy().into_owned().into();
    let health: serde_yaml::Value = serde_yaml::from_str(&format!(
        "{{probePeriodSeconds: {PROBE_PERIOD}, failureThreshold: {FAILURE_THRESHOLD}, coRestartAfterSeconds: {WINDOW}}}"
    ))
    .unwrap();
    m["spec"]["health"] = health;
    m["spec"]["restart"]["backoff"] =
        serde_yaml::from_str("{baseSeconds: 1, maxSeconds: 10}").unwrap();
    // Small KV caches: two of these run at once on a small machine.
    for role in ["prefill", "decode"] {
        m["spec"][role]["args"] = serde_yaml::from_str("[--kv-blocks, '128']").unwrap();
    }
    edit(&mut m);
    serde_yaml::to_string(&m).unwrap()
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request on its own connection (`Connection: close`), chunked bodies
/// decoded. Panics when nothing comes back within `timeout`.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Response {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(timeout)).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{method} {path}: no complete answer within {timeout:?}: {e}"));
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut rest = &raw[split + 4..];
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        let mut out = Vec::new();
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = String::from_utf8_lossy(&rest[..eol]);
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let data = &rest[eol + 2..];
            out.extend_from_slice(&data[..n]);
            rest = &data[(n + 2).min(data.len())..];
        }
        out
    } else {
        rest.to_vec()
    };
    let body = String::from_utf8_lossy(&body).into_owned();
    Response {
        status,
        headers,
        body,
    }
}

pub fn chat_body(stream: bool) -> Value {
    json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    })
}

/// A process that is still there (not gone, not a zombie).
pub fn alive(pid: i64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the parenthesised command name.
            let state = stat.rsplit_once(')').map(|(_, r)| r.trim_start());
            !state.is_some_and(|s| s.starts_with('Z') || s.starts_with('X'))
        }
        Err(_) => false,
    }
}

/// Some process (not a zombie) is still in process group `pgid`.
pub fn group_alive(pgid: i64) -> bool {
    match killpg(Pid::from_raw(pgid as i32), None) {
        Err(Errno::ESRCH) => false,
        _ => std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i64>() else {
                return false;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            // Fields after the name: state, ppid, pgrp.
            f.len() > 2 && f[2] == pgid.to_string() && !f[0].starts_with('Z')
        }),
    }
}

pub fn signal(pid: i64, sig: Signal) {
    kill(Pid::from_raw(pid as i32), sig).unwrap_or_else(|e| panic!("kill -{sig} {pid}: {e}"));
}

pub struct Local {
    pub child: Child,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    pub file: PathBuf,
    pub exited: Option<ExitStatus>,
}

impl Local {
    /// Start the runtime and wait for its group to serve.
    pub fn start(name: &str, manifest: &str) -> Self {
        let mut l = Self::spawn(name, manifest);
        l.wait_for("the group to serve", Duration::from_secs(180), |l| {
            l.get("/ready").status == 200
        });
        l
    }

    /// Start the runtime; return once it is started (not waiting for the group).
    pub fn spawn(name: &str, manifest: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tandem-local-test-{name}-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_millis()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("manifest.yaml");
        std::fs::write(&file, manifest).unwrap();
        let port = free_port();
        let out = std::fs::File::create(dir.join("runtime.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tandem-operator"))
            .args(["local", "-f"])
            .arg(&file)
            .args(["--port", &port.to_string()])
            .arg("--log-dir")
            .arg(dir.join("logs"))
            .args(["--grace-period-seconds", &GRACE.to_string()])
            .arg("--dataplane")
            .arg(dataplane())
            .args(["--log-format", "json"])
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start tandem-operator local");
        Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            dir,
            file,
            exited: None,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("runtime.log")).unwrap_or_default()
    }

    pub fn get(&self, path: &str) -> Response {
        http(self.addr, "GET", path, None, Duration::from_secs(10))
    }

    pub fn status(&self) -> Value {
        self.get("/status").json()
    }

    pub fn chat(&self, stream: bool) -> Response {
        http(
            self.addr,
            "POST",
            "/v1/chat/completions",
            Some(&chat_body(stream)),
            Duration::from_secs(120),
        )
    }

    /// Poll `cond` every 100 ms; the elapsed time, or a panic with the runtime's log.
    pub fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        cond: impl Fn(&Self) -> bool,
    ) -> Duration {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.exited = Some(st);
                panic!(
                    "the runtime exited ({st}) waiting for {what}; log:\n{}",
                    self.log()
                );
            }
            // The endpoint may not listen yet right after the start.
            let ok = TcpStream::connect(self.addr).is_ok() && cond(self);
            if ok {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "{what}: not within {timeout:?}; status:\n{}\nlog:\n{}",
                TcpStream::connect(self.addr)
                    .map(|_| self.get("/status").body)
                    .unwrap_or_default(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The members of group 0, newest incarnation last.
    pub fn members(&self) -> Vec<Value> {
        let mut m: Vec<Value> = self.status()["members"].as_array().unwrap().clone();
        m.sort_by_key(|m| m["incarnation"].as_i64());
        m
    }

    /// The running member of `role` at `incarnation`.
    pub fn member(&self, role: &str, incarnation: i64) -> Value {
        self.members()
            .into_iter()
            .find(|m| m["role"] == role && m["incarnation"] == incarnation)
            .unwrap_or_else(|| {
                panic!(
                    "no {role} at incarnation {incarnation}: {}",
                    self.get("/status").body
                )
            })
    }

    pub fn group(&self) -> Value {
        self.status()["status"]["groupStatuses"][0].clone()
    }

    pub fn record(&self) -> Vec<Value> {
        self.status()["record"].as_array().unwrap().clone()
    }

    /// Sequence number of the first record entry of `kind` about `pod`.
    pub fn seq(record: &[Value], kind: &str, pod: &str) -> u64 {
        record
            .iter()
            .find(|e| e["kind"] == kind && e["pod"] == pod)
            .unwrap_or_else(|| panic!("no {kind} entry for {pod} in {record:#?}"))["seq"]
            .as_u64()
            .unwrap()
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.exited = Some(st);
                return st;
            }
            assert!(
                start.elapsed() < timeout,
                "the runtime did not exit within {timeout:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        if self.exited.is_none() && self.child.try_wait().ok().flatten().is_none() {
            let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
            let start = Instant::now();
            while self.child.try_wait().ok().flatten().is_none()
                && start.elapsed() < Duration::from_secs(GRACE * 2 + 5)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("runtime files kept in {}", self.dir.display());
        }
    }
}

pub fn pid_of(m: &Value) -> i64 {
    m["pid"].as_i64().unwrap()
}

pub fn name_of(m: &Value) -> String {
    m["name"].as_str().unwrap().to_string()
}

/// A chat answer through the local endpoint, its content.
pub fn assert_chat(l: &Local) -> String {
    let r = l.chat(false);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!content.is_empty(), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    content
}
